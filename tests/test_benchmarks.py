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


def test_memory_budget_counts_the_masters_and_fp8_copies_as_the_difference():
    out = subprocess.run([sys.executable, "benchmarks/memory_budget.py", "--sizes", "tiny", "--peaks", "tiny=1.0,0.9"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads([line for line in out.stdout.splitlines() if line.startswith("SUMMARY ")][-1][len("SUMMARY "):])[0]
    H, I, nh, nkv, _ = 256, 688, 4, 2, 2048  # bench_train.SIZES["tiny"]
    hd = H // nh
    layer = 2 * H * nh * hd + 2 * 2 * H * nkv * hd + nh * hd * H + 3 * H * I  # q/k/v read 2H; o; the MLP
    assert row["trained_params"] == 3 * H * H + layer + 4 * H  # fc, the layer, its three norms and the final one
    parts = row["bytes"]
    diff = sum(p["ours"] - p["peer"] for p in parts.values())
    assert diff == 4 * row["trained_params"] + layer  # fp32 masters + the layer's e4m3 copies (1 byte each)
    assert {k for k, p in parts.items() if p["ours"] != p["peer"]} == {"fp32 master weights", "e4m3 weight copies (one step)"}
    assert row["rest_gib"]["ours"] == round(1.0 - sum(p["ours"] for p in parts.values()) / 2**30, 2)
