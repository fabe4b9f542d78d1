"""Training through the rule, as a user meets it: `snakemake draft/checkpoint.safetensors` killed with
kill -9 after a saved state resumes on the rerun to the very checkpoint an uninterrupted run gives, and
the rule's torchrun branch (train.nproc: 2, two CPU processes under gloo) follows the same curve.

The traces, hidden states, target head and vocabulary are the session's vLLM-backend run's
(conftest.vllm_backend_run, shared with other modules; this module starts no vLLM of its own); each
training run is a copy of that directory (mtimes kept, so nothing upstream reruns) with this module's
training settings."""
import csv
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch
import yaml

from eaglenest.draft.checkpoint import load_checkpoint
from tests.support.processes import descendants_running
from tests.support.workflow import rules_run, run_snakemake, snakemake_cmd

pytestmark = pytest.mark.vllm  # the session run it copies starts vLLM for the traces and states
# 1 process x grad_accum 2 = 2 processes x 1: the same global batch, so the same run (test_ddp).
TRAIN = {"max_steps": 12, "batch_tokens": 1024, "save_every": 4, "ttt_length": 3, "lr": 3e-3, "warmup_steps": 2,
         "grad_accum": 2}
CHECKPOINT = "draft/checkpoint.safetensors"


@pytest.fixture(scope="module")
def copy_of(vllm_backend_run, tmp_path_factory):
    """A copy of the vLLM-backend run's directory training with ``TRAIN`` updated by ``train`` (its own
    training settings: its draft is stale there and trained again)."""
    upstream, _ = vllm_backend_run

    def make(name, **train):
        wd = tmp_path_factory.mktemp(name)
        shutil.rmtree(wd)
        shutil.copytree(upstream, wd, symlinks=True)
        cfg = yaml.safe_load((wd / "config.yaml").read_text())
        cfg["train"] = {**TRAIN, **train}
        (wd / "config.yaml").write_text(yaml.safe_dump(cfg))
        return wd
    return make


def _planned(wd):
    return rules_run(run_snakemake(wd, CHECKPOINT, "-n"))


def _curve(wd):
    return [(r["step"], round(float(r["loss"]), 4)) for r in csv.DictReader(open(wd / "draft/train_metrics.csv"))]


def _same_checkpoint(a, b):
    ta, tb = load_checkpoint(a / CHECKPOINT)[0], load_checkpoint(b / CHECKPOINT)[0]
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture(scope="module")
def straight(copy_of):
    wd = copy_of("straight")
    assert "train_draft" in _planned(wd) and "generate_traces" not in _planned(wd)  # only training reruns
    run_snakemake(wd, CHECKPOINT)
    return wd


def test_kill_9_of_the_training_job_then_rerun_resumes_to_the_same_checkpoint(straight, copy_of):
    wd = copy_of("killed")
    proc = subprocess.Popen(snakemake_cmd(wd, CHECKPOINT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not list((wd / "draft/.train_state").glob("step_4.pt")):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no saved state within 10 minutes"
            time.sleep(0.1)
        jobs = descendants_running(proc.pid, "train_draft.py")
        assert jobs, "the train_draft job of this workflow is running"
        for pid in jobs:
            os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (wd / CHECKPOINT).exists()
    saved = sorted(p.name for p in (wd / "draft/.train_state").glob("step_*.pt"))
    assert saved and "step_12.pt" not in saved, saved
    run_snakemake(wd, CHECKPOINT)
    log = (wd / "logs/train_draft.log").read_text()
    assert "resuming from" in log, log[-2000:]
    assert _same_checkpoint(straight, wd)
    assert _curve(straight) == _curve(wd)
    assert not list((wd / "draft/.train_state").glob("step_*.pt")), "a finished run leaves no resume points"


def test_the_rules_torchrun_branch_with_two_cpu_processes(straight, copy_of):
    wd = copy_of("ddp", nproc=2, grad_accum=1, device="cpu")
    run_snakemake(wd, CHECKPOINT)
    log = (wd / "logs/train_draft.log").read_text()
    assert "torch.distributed.run" in log and "--nproc_per_node=2" in log, log[-2000:]
    assert re.search(r"train_draft: \d+ steps, \d+ tokens", log), "the torchrun processes' own output is in the log"
    assert _curve(straight) == _curve(wd)
    a, b = load_checkpoint(straight / CHECKPOINT)[0], load_checkpoint(wd / CHECKPOINT)[0]
    # Two processes sum their gradients in another order than one: float32 rounding, which Adam's
    # normalised steps carry into single weights (seen: 1e-5 on 1 of 32,768 under load). A branch that
    # dropped a process's gradients would be a step's size (lr) off in most of them.
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)
