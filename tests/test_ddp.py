"""Training under torchrun: 2 processes (gloo, CPU) follow the same loss curve as 1 process with the
same global batch, and a run resumes across a change of the number of processes."""
import csv
import os
import subprocess
import sys

import torch

from eaglenest.draft import train
from eaglenest.draft.checkpoint import load_checkpoint
from eaglenest.draft.launch import write_settings
from tests.support.training import train_settings
from tests.support.training_run import CONFIG, run


def torchrun(data, out, config, nproc):
    settings = write_settings(train_settings(config), out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "eaglenest.draft.launch", "--hidden", *map(str, data["hidden_paths"]), "--vocab", str(data["vocab_path"]),
           "--head", str(data["head_path"]), "--out", str(out / "checkpoint.safetensors"),
           "--metrics", str(out / "train_metrics.csv"), "--state-dir", str(out / ".train_state"),
           "--settings", str(settings)]
    out_ = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out_.returncode == 0, out_.stderr[-3000:]
    return out_.stderr


def _curve(out):
    return [(r["tokens"], round(float(r["loss"]), 4)) for r in csv.DictReader(open(out / "train_metrics.csv"))]


def test_torchrun_two_processes_match_one_with_the_same_global_batch(data, tmp_path):
    config = {**CONFIG, "max_steps": 4}
    torchrun(data, tmp_path / "ddp", config, nproc=2)
    run(data, tmp_path / "one", {**config, "grad_accum": 2})
    assert _curve(tmp_path / "ddp") == _curve(tmp_path / "one")
    a = load_checkpoint(tmp_path / "ddp" / "checkpoint.safetensors")[0]
    b = load_checkpoint(tmp_path / "one" / "checkpoint.safetensors")[0]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_resume_across_a_change_of_process_count(data, tmp_path, monkeypatch):
    config = {**CONFIG, "max_steps": 4, "save_every": 2}
    # 1 process x grad_accum 2, killed after its step-2 state is saved ...
    saved = train._save_state

    def save_then_die(state_dir, step, state, keep):
        saved(state_dir, step, state, keep)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(train, "_save_state", save_then_die)
    try:
        run(data, tmp_path / "mixed", {**config, "grad_accum": 2})
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(train, "_save_state", saved)
    assert list((tmp_path / "mixed" / ".train_state").glob("step_*"))
    # ... resumed by 2 processes x 1: the same run as one process throughout.
    log = torchrun(data, tmp_path / "mixed", config, nproc=2)
    assert "resuming from" in log and "step 2 of 4" in log, log[-2000:]
    run(data, tmp_path / "one", {**config, "grad_accum": 2})
    assert _curve(tmp_path / "mixed") == _curve(tmp_path / "one")
