"""The benchmarks run on the CPU at tiny sizes (--small): their imports and plumbing stay in step
with the library, so a GPU call is never spent on an ImportError. The figures mean nothing here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args", [
    ["benchmarks/bench_train_e2e.py", "--sizes", "llama8b", "--small", "--steps", "3", "--warmup", "1", "--seqs", "4"],
    ["benchmarks/bench_train.py", "--sizes", "llama8b", "--ttt", "2", "--iters", "2", "--small"],
    ["benchmarks/bench_train.py", "--sizes", "llama8b", "--ttt", "2", "--iters", "2", "--small", "--target-argmax", "full"],
    ["benchmarks/bench_extract.py", "--small", "--seqs", "4"],
], ids=["train_e2e", "train_step", "train_step_full_vocab_argmax", "extract"])
def test_benchmark_runs_at_tiny_sizes(args, tmp_path):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = [line for line in out.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert summary, out.stdout[-2000:]
    rows = json.loads(summary[-1][len("SUMMARY "):])
    assert rows and all(r["tokens_per_s"] > 0 for r in rows)


def test_fp8_accuracy_runs_at_tiny_sizes_with_fp8_forced_on_the_cpu(tmp_path):
    args = ["benchmarks/fp8_accuracy.py", "--cpu-fp8", "--steps", "4", "--seqs", "16", "--ttt", "2", "--batch-tokens", "256", "--out", str(tmp_path)]
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), "TMPDIR": str(tmp_path)})
    summary = [line for line in out.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert summary, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(summary[-1][len("SUMMARY "):])
    assert [r["position"] for r in result["acc"]] == [0, 1] and result["data"]["sequences"] > 0
    assert json.loads((tmp_path / "fp8_accuracy.json").read_text())["curve"][-1][0] == 4
