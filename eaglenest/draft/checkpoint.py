"""The draft checkpoint that train_draft writes (``draft/checkpoint.safetensors``): the draft's vLLM
tensors, with its DraftConfig, the target's facts and the run's statistics in the metadata; and the
training config it was made with. It sits low, so export and the report read a checkpoint without
importing the trainer."""

import json

from ..settings import DraftSettings, TrainSettings
from ..states.target import TargetFacts
from ..util import save_safetensors
from .config import DraftConfig
from .dflash import KIND as DFLASH, DFlashConfig

CHECKPOINT_FORMAT = "eaglenest.draft/1"

# The training config's keys and their defaults (the schema's): settings.TrainSettings.config().
DEFAULTS = TrainSettings.defaults().config()


def resolve_config(config):
    unknown = sorted(set(config or {}) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown training config keys {unknown}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **(config or {})}


def draft_config(info: TargetFacts, draft_vocab_size, cfg) -> DraftConfig | DFlashConfig:
    """The draft's shape: the target's sizes unless the (resolved) training config overrides them."""
    if cfg["kind"] == DFLASH:
        return DFlashConfig.from_target(info, draft_vocab_size, cfg)
    return DraftConfig.from_target(info, draft_vocab_size, **{k: cfg[k] for k in DraftSettings.defaults().shape()})


def load_checkpoint(path):
    """``(tensors, draft_config, TargetFacts, train_stats)`` of a train_draft checkpoint."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: not an eaglenest draft checkpoint (format {meta.get('format')!r})")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    facts = TargetFacts.from_dict(json.loads(meta["target"]), f"{path}'s metadata", "train it again with this version")
    stored = json.loads(meta["draft_config"])
    config = DFlashConfig.from_dict(stored) if stored.get("kind") == DFLASH else DraftConfig.from_dict(stored)
    return tensors, config, facts, json.loads(meta["train"])



def save_checkpoint(path, tensors, dcfg: DraftConfig | DFlashConfig, info: TargetFacts, train: dict):
    """Write ``tensors`` as a checkpoint ``load_checkpoint`` reads back."""
    metadata = {
        "format": CHECKPOINT_FORMAT,
        "draft_config": json.dumps(dcfg.to_dict()),
        "target": json.dumps(info.to_dict()),
        "train": json.dumps(train, default=str),
    }
    save_safetensors(tensors, path, metadata)
