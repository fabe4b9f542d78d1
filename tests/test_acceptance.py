"""The acceptance guard: a trained draft, served by real vLLM with the toy target, is accepted far more
often than an untrained draft of the same shape exported the same way.

The trained draft comes from the real workflow (`snakemake ... draft/checkpoint` on a small config);
both drafts are then served one after the other (vLLM on CPU, each server stopped before the next
starts) on the held-out prompts, and the acceptance is read from the differences of vLLM's /metrics
counters. Three vLLM starts in all (traces, trained, untrained): about five minutes on 2 cores.
"""
import json
import os
import socket
import time
from pathlib import Path

import pytest

from conftest import BASE_CONFIG, TOY_TARGET, run_snakemake, write_config
from eaglenest.export import export_untrained
from eaglenest.server import ServerConfig
from eaglenest.predict import offline_acceptance
from eaglenest.validate import measure_run, read_prompts, request_settings
from eaglenest.vllm_format import speculative_config

pytestmark = pytest.mark.vllm
K = 3
# Short but enough for the draft to learn much of the toy's arithmetic steps: about 1.5 minutes on 2 cores.
TRAIN = {"max_steps": 60, "lr": 3e-3, "warmup_steps": 5, "batch_tokens": 2048, "ttt_length": 3, "save_every": 1000}


def _free_port(lo=8200, hi=8300) -> int:
    for port in range(lo, hi):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                try:
                    s2 = socket.socket()
                    s2.bind(("127.0.0.1", port))
                    s2.close()
                    return port
                except OSError:
                    continue
    pytest.fail(f"no free port in {lo}-{hi - 1}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not (TOY_TARGET / "config.json").exists():
        pytest.fail(f"the toy target is missing: rebuild it with python -m eaglenest.toy --out {TOY_TARGET}")
    wd = tmp_path_factory.mktemp("acceptance")
    t0 = time.monotonic()
    # Hidden states (training) and the offline prediction in the dtype vLLM serves the target in.
    dtype = BASE_CONFIG["server"].get("dtype") or "bfloat16"
    # A small share of the machine's memory for vLLM's KV cache: the default 0.9 of the NUMA node is
    # refused on a machine shared with other work, and the toy needs little.
    cfg = write_config(wd, dataset={"limit": 300, "heldout": 24}, shards=1,
                       server={"port": _free_port(), "gpu_memory_utilization": 0.1},
                       generation={"concurrency": 64}, hidden={"dtype": dtype}, train=TRAIN)
    run_snakemake(wd, "draft/checkpoint", timeout=900)  # two vLLM starts: traces, then hidden states
    t_workflow = time.monotonic() - t0
    export_untrained(wd / "draft/vocab.safetensors", wd / "hidden/target_head.safetensors", wd / "untrained",
                     config={k: v for k, v in TRAIN.items()})
    prompts = read_prompts(wd / "data/prompts/heldout.jsonl")
    server = ServerConfig.from_dict(cfg["server"])
    settings = request_settings(cfg["generation"]["max_tokens"])
    runs = {}
    for name, draft in (("trained", wd / "draft/checkpoint"), ("untrained", wd / "untrained")):
        runs[name] = measure_run(name, server, speculative_config("eagle3", K, draft), prompts, settings,
                                 log_dir=wd / "logs/validate", concurrency=8, warmup_requests=1,
                                 workflow_pid=os.getpid())
    # The offline prediction on the very tokens vLLM served: it must agree with vLLM's counters.
    answers = runs["trained"]["answers"]
    runs["offline"] = offline_acceptance(TOY_TARGET, wd / "draft/checkpoint", k=K, dtype=dtype, device="cpu",
                                         sequences=[(a["prompt_token_ids"], a["completion_token_ids"]) for a in answers],
                                         progress=False)
    runs["seconds"] = {"workflow": round(t_workflow, 1), "total": round(time.monotonic() - t0, 1)}
    (wd / "acceptance.json").write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "answers"}
                                                    for k, v in runs.items()}, indent=1))
    return wd, runs


def test_trained_draft_is_accepted_far_more_than_an_untrained_one(served):
    wd, runs = served
    trained, untrained = runs["trained"]["acceptance_length"], runs["untrained"]["acceptance_length"]
    summary = f"trained {trained:.3f}, untrained {untrained:.3f} (k={K}); details in {wd / 'acceptance.json'}"
    assert untrained < 1.3, summary  # a random draft is almost never right
    assert trained >= 1.5, summary
    assert trained >= untrained + 0.5, summary


def test_offline_prediction_matches_vllm(served):
    """The offline simulation of vLLM's proposer predicts what vLLM's counters say, on the same tokens."""
    wd, runs = served
    vllm, offline = runs["trained"], runs["offline"]
    assert offline["target_agreement"] > 0.98, offline  # transformers' target chooses vLLM's tokens
    assert offline["acceptance_length"] == pytest.approx(vllm["acceptance_length"], rel=0.05), (offline, vllm)
    assert offline["drafts"] == pytest.approx(vllm["drafts"], rel=0.05)


def test_counters_are_consistent(served):
    _, runs = served
    for name in ("trained", "untrained"):
        r = runs[name]
        assert r["draft_tokens"] == K * r["drafts"] > 0, r
        assert 0 <= r["accepted"] <= r["draft_tokens"]
        assert r["acceptance_length"] == pytest.approx(1 + sum(r["per_position"]))
        assert r["per_position"] == sorted(r["per_position"], reverse=True)


def test_servers_are_gone(served):
    wd, _ = served
    for name in ("trained", "untrained"):
        assert not (Path(wd) / "logs/validate" / name / "vllm.pid.json").exists()
