"""Drafts trained from either hidden-state backend are accepted alike by real vLLM.

The real workflow runs with `hidden.backend: vllm` up to draft/checkpoint; a second working
directory takes the same prompts and traces (copied) and runs with `hidden.backend: transformers`.
Both drafts are trained with the same seed and settings, then served one after the other with the
toy target (vLLM on CPU, float32) on the held-out prompts; their mean acceptance lengths, read from
vLLM's counters, must agree within 0.05. Five vLLM starts in all."""
import json
import os
import shutil
import time

import pytest

from conftest import free_port, run_snakemake, write_config
from eaglenest.serving.settings import ServerConfig
from eaglenest.serving.vllm import speculative_config
from eaglenest.validation.validate import measure_run, read_prompts, request_settings

pytestmark = pytest.mark.vllm
K = 3
# Short but enough for the draft to learn much of the toy's arithmetic steps: about 1.5 minutes on 2 cores.
TRAIN = {"max_steps": 60, "lr": 3e-3, "warmup_steps": 5, "batch_tokens": 2048, "ttt_length": 3, "save_every": 1000}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    t0 = time.monotonic()
    common = dict(dataset={"limit": 300, "heldout": 24}, shards=1, generation={"concurrency": 64}, train=TRAIN)
    wd_v, wd_t = tmp_path_factory.mktemp("vllm"), tmp_path_factory.mktemp("transformers")
    cfg = write_config(wd_v, server={"port": free_port()}, hidden={"backend": "vllm", "dtype": "float32"}, **common)
    run_snakemake(wd_v, "draft/checkpoint", timeout=1200)
    write_config(wd_t, server={"port": cfg["server"]["port"]}, hidden={"backend": "transformers", "dtype": "float32"},
                 **common)
    for part in ("data", "traces"):  # the same traces: only the hidden states differ
        shutil.copytree(wd_v / part, wd_t / part)
    shutil.copy2(wd_v / "server.stopped", wd_t / "server.stopped")
    out = run_snakemake(wd_t, "draft/checkpoint", timeout=1200)
    assert "generate_traces" not in out.stdout + out.stderr, "the copied traces were used as they are"
    prompts = read_prompts(wd_v / "data/prompts/heldout.jsonl")
    server = ServerConfig.from_dict(cfg["server"])
    settings = request_settings(cfg["generation"]["max_tokens"])
    runs = {}
    for name, wd in (("vllm", wd_v), ("transformers", wd_t)):
        run = measure_run(name, server, speculative_config("eagle3", K, wd / "draft/checkpoint"), prompts, settings,
                          log_dir=wd / "logs/validate", concurrency=8, warmup_requests=1, workflow_pid=os.getpid())
        runs[name] = {k: v for k, v in run.items() if k != "answers"}
    runs["seconds"] = round(time.monotonic() - t0, 1)
    (wd_v / "backends_acceptance.json").write_text(json.dumps(runs, indent=1))
    print("\nacceptance by backend:", json.dumps({k: v["acceptance_length"] for k, v in runs.items() if k != "seconds"}),
          f"({runs['seconds']} s)")
    return runs


def test_drafts_from_both_backends_reach_the_same_acceptance(drafts):
    v, t = drafts["vllm"]["acceptance_length"], drafts["transformers"]["acceptance_length"]
    assert v >= 1.5, drafts  # a trained draft, not a random one
    assert abs(v - t) <= 0.05, f"vllm {v:.3f}, transformers {t:.3f} (k={K}): {drafts}"
