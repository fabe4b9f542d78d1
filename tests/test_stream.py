"""hidden.mode: stream against real vLLM (the toy on CPU, float32), through the real workflow.

The session's vLLM-backend run (conftest.vllm_backend_run: files mode up to draft/checkpoint; trace
server, extraction server, shards, training) is files mode; a working directory here takes its prompts
and traces (copied, mtimes kept) and trains in stream mode with hidden.stream.max_disk_gb set to a quarter of
one shard, while a thread measures the disk its per-request files and cache take. That run is killed
twice on its way: kill -9 of the training job once step 10 is saved, then kill -9 of the extraction
server once step 20 is saved; each rerun resumes from the last saved state. Same traces, seed and
settings as the files run: the same batches in the same order, so the same draft, which the resumed
stream run must end at (and export to the same vLLM-format draft, so vLLM's acceptance of the files
draft, tests/test_backends_acceptance.py, is this draft's too).
"""
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import torch
import yaml

from eaglenest.draft.checkpoint import load_checkpoint
from eaglenest.serving.local import LocalPaths, read_pidfile
from tests.support.config import TRAIN
from tests.support.processes import descendants_running
from tests.support.workflow import copy_traces, run_snakemake, snakemake_cmd

pytestmark = pytest.mark.vllm
CHECKPOINT = "draft/checkpoint.safetensors"


def _disk_use(dirs):
    total = 0
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(root, f))
                except OSError:
                    pass
    return total


class PeakDisk:
    """The most bytes the files under ``dirs`` took at once, sampled every few milliseconds."""

    def __init__(self, dirs):
        self.dirs, self.peak, self.samples = dirs, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, _disk_use(self.dirs))
            self.samples += 1
            time.sleep(0.002)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _stream_copy(src, dst, **stream):
    """A working directory with ``src``'s prompts and traces, configured for stream mode (``stream``: hidden.stream's keys)."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load((src / "config.yaml").read_text())
    cfg["hidden"].update({"mode": "stream", "stream": stream})
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
    copy_traces(src, dst)
    return cfg


def _train_seconds(wd):
    return load_checkpoint(wd / CHECKPOINT)[3]["seconds"]


def _run_until(wd, saved_step, what):
    """Start the workflow; once ``step_{saved_step}.pt`` is saved, call ``what(proc)``; return its output."""
    proc = subprocess.Popen(snakemake_cmd(wd, CHECKPOINT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while not (wd / f"draft/.train_state/step_{saved_step}.pt").exists():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no saved state within 15 minutes"
            time.sleep(0.1)
        what(proc)
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode != 0, out[-3000:]
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def runs(vllm_backend_run, tmp_path_factory):
    """The stream run, killed twice and resumed to the end: the logs after each kill, its peak disk."""
    wd_f, cfg = vllm_backend_run
    # About two epochs of the 300 toy traces, so later epochs read sequences again (cache or
    # re-extraction); the kills wait for the states saved at steps 10 and 20.
    assert cfg["train"] == TRAIN and TRAIN["save_every"] == 10 and TRAIN["max_steps"] == 60, cfg["train"]
    wd_s = tmp_path_factory.mktemp("stream")
    shard = wd_f / "hidden/shard_0.safetensors"
    budget = shard.stat().st_size / 4
    stream_cfg = _stream_copy(wd_f, wd_s, max_disk_gb=budget / 1e9)
    plan = run_snakemake(wd_s, CHECKPOINT, "-n")
    assert "rule generate_traces:" not in plan.stdout and "rule extract_hidden" not in plan.stdout, plan.stdout[-3000:]

    def kill_training(proc):
        jobs = descendants_running(proc.pid, "train_draft.py")
        assert jobs, "the train_draft job of this workflow is running"
        for pid in jobs:
            os.kill(pid, signal.SIGKILL)

    def kill_server(proc):
        record = read_pidfile(LocalPaths(wd_s / "logs/hidden_server"))
        assert record, "the extraction server's pidfile"
        os.killpg(record["pgid"], signal.SIGKILL)  # a process group this test's workflow started

    logs = {}
    # hidden states on disk: the per-request files and the cache (target_head.safetensors is no state)
    with PeakDisk([wd_s / "hidden/.vllm_states", wd_s / "draft/.train_state/stream_cache"]) as peak:
        _run_until(wd_s, 10, kill_training)
        logs["killed"] = (wd_s / "logs/train_draft.log").read_text()
        checkpoint_after_kill = (wd_s / CHECKPOINT).exists()
        # the rerun resumes from step 10; its server dies once it has saved step 20
        _run_until(wd_s, 20, kill_server)
        logs["server_died"] = (wd_s / "logs/train_draft.log").read_text()
        run_snakemake(wd_s, CHECKPOINT, timeout=1500)
    logs["final"] = (wd_s / "logs/train_draft.log").read_text()
    result = {"files": wd_f, "stream": wd_s, "cfg": stream_cfg, "budget": budget, "shard_bytes": shard.stat().st_size,
              "stream_peak": peak.peak, "samples": peak.samples, "logs": logs,
              "checkpoint_after_kill": checkpoint_after_kill,
              "seconds": {"files": _train_seconds(wd_f), "stream (its last run)": _train_seconds(wd_s)}}
    print("\nstream vs files:", json.dumps({k: str(v) for k, v in result.items() if k != "logs"}))
    return result


def test_stream_mode_trains_the_files_mode_draft_under_the_disk_budget(runs):
    wd_f, wd_s = runs["files"], runs["stream"]
    assert not list((wd_s / "hidden").glob("shard_*")), "stream mode wrote no shard"
    assert runs["samples"] > 100
    assert 0 < runs["stream_peak"] <= runs["budget"] < runs["shard_bytes"], runs
    log = runs["logs"]["final"]
    summary = [line for line in log.splitlines() if line.startswith("stream:")]
    assert summary and "re-extracted" in summary[-1], log[-2000:]
    # the states directory and the cache are (nearly) empty once training is done. Two suite runs (2026-12-04)
    # found 133,792 and 148,184 bytes there after the run, one file's worth. Two ways one could stay were closed
    # since (test_stream_stub.py: a killed server's half-written .tmp, and requests dropped in flight at close());
    # until no suite shows it again, what is left must stay within the run's disk budget, its names in the message.
    deadline = time.monotonic() + 30
    while _disk_use([wd_s / "hidden/.vllm_states", wd_s / "draft/.train_state"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [str(p) for d in ("hidden/.vllm_states", "draft/.train_state") for p in (wd_s / d).rglob("*")
            if p.is_file() and p.stat().st_size]
    assert _disk_use([wd_s / "hidden/.vllm_states", wd_s / "draft/.train_state"]) <= runs["budget"], left
    a, b = load_checkpoint(wd_f / CHECKPOINT)[0], load_checkpoint(wd_s / CHECKPOINT)[0]
    assert a.keys() == b.keys()
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"\nlargest weight difference files vs stream: {diff:.3g}; {summary[-1]}")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def test_the_stream_draft_exports_to_the_files_draft(runs):
    """The same weights give the same vLLM-format draft: what vLLM accepts of the files draft
    (tests/test_backends_acceptance.py measures it) it accepts of this one."""
    from eaglenest.draft.export import load_exported

    wd_f, wd_s = runs["files"], runs["stream"]
    run_snakemake(wd_s, "draft/checkpoint")
    (config_f, tensors_f), (config_s, tensors_s) = load_exported(wd_f / "draft/checkpoint"), load_exported(wd_s / "draft/checkpoint")
    assert config_f == config_s
    assert tensors_f.keys() == tensors_s.keys()
    for k in tensors_f:
        torch.testing.assert_close(tensors_f[k], tensors_s[k], rtol=1e-4, atol=1e-5, msg=k)


def test_kill_9_of_training_then_a_dead_extraction_server_each_rerun_resumes(runs):
    assert not runs["checkpoint_after_kill"]
    log = runs["logs"]["server_died"]
    assert "resuming from" in log and "step_10.pt" in log, log[-3000:]
    assert re.search(r"the extraction server at http://127\.0\.0\.1:\d+", log) and "rerun" in log, log[-3000:]
    assert "Traceback" not in log.split("resuming from")[-1], log[-3000:]
    log = runs["logs"]["final"]
    assert "resuming from" in log and "(step 20 of 60)" in log, log[-3000:]
    # and ends at the draft an uninterrupted run gives: test_stream_mode_trains_the_files_mode_draft_under_the_disk_budget
