"""The draft checkpoint that train_draft writes (``draft/checkpoint.safetensors``): the draft's vLLM
tensors, with its DraftConfig, the target's facts and the run's statistics in the metadata; and the
training config it was made with. It sits low, so export and the report read a checkpoint without
importing the trainer."""

import copy
import json
from dataclasses import fields

from ..settings import DraftSettings, TrainSettings
from ..states.target import TargetFacts
from ..util import save_safetensors
from .config import DraftConfig
from .dflash import KIND as DFLASH, DFlashConfig

CHECKPOINT_FORMAT = "eaglenest.draft/1"


def train_record(settings: TrainSettings) -> dict:
    """The training settings as the checkpoint records them (its ``train.config``) and the resume fingerprint
    hashes them (``train.run_fingerprint``): flat, every field but where it runs and the stage objects, then the
    draft's shape keys and its DFlash settings. Its keys and their order are a format: changing them breaks
    the resume of states saved before."""
    skip = ("device", "gpus", "nproc", "draft", "hidden")
    out = {f.name: copy.deepcopy(getattr(settings, f.name)) for f in fields(settings) if f.name not in skip}
    return {**out, **settings.draft.shape(), "dflash": settings.draft.dflash.fingerprint()}


def draft_config(info: TargetFacts, draft_vocab_size, draft: DraftSettings) -> DraftConfig | DFlashConfig:
    """The draft's shape: the target's sizes unless ``draft`` overrides them."""
    if draft.kind == DFLASH:
        return DFlashConfig.from_target(info, draft_vocab_size, draft)
    return DraftConfig.from_target(info, draft_vocab_size, **draft.shape())


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
