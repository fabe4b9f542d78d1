"""Drafts trained from either hidden-state backend are accepted alike by real vLLM.

The session's vLLM-backend run (conftest.vllm_backend_run: `hidden.backend: vllm` up to
draft/checkpoint) gives one draft; a working directory here takes its prompts and traces (copied) and
runs with `hidden.backend: transformers`. Both drafts are trained with the same seed and settings, then
served one after the other with the toy target (vLLM on CPU, float32) on the held-out prompts; their
mean acceptance lengths, read from vLLM's counters, must agree within 0.05. One vLLM start of its own
(the transformers draft's measurement) beyond the shared run's three (traces, extraction, its draft's
measurement, shared with tests/test_stream.py)."""
import json
import time

import pytest

from conftest import K, TRAIN, VLLM_BACKEND_RUN, copy_traces, eagle3, measure_draft, run_snakemake, write_config

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def drafts(vllm_backend_run, vllm_backend_acceptance, tmp_path_factory):
    wd_v, cfg = vllm_backend_run
    assert cfg["train"] == TRAIN
    t0 = time.monotonic()
    wd_t = tmp_path_factory.mktemp("transformers")
    write_config(wd_t, **{**VLLM_BACKEND_RUN, "server": {"port": cfg["server"]["port"]},
                          "hidden": {"backend": "transformers", "dtype": "float32"}})
    copy_traces(wd_v, wd_t)  # the same traces: only the hidden states differ
    out = run_snakemake(wd_t, "draft/checkpoint", timeout=1200)
    assert "generate_traces" not in out.stdout + out.stderr, "the copied traces were used as they are"
    runs = {"vllm": vllm_backend_acceptance,
            "transformers": measure_draft("transformers", wd_t, cfg, eagle3(wd_t / "draft/checkpoint"))}
    runs["seconds"] = round(time.monotonic() - t0, 1)
    (wd_t / "backends_acceptance.json").write_text(json.dumps(runs, indent=1))
    print("\nacceptance by backend:", json.dumps({k: v["acceptance_length"] for k, v in runs.items() if k != "seconds"}),
          f"({runs['seconds']} s)")
    return runs


def test_drafts_from_both_backends_reach_the_same_acceptance(drafts):
    v, t = drafts["vllm"]["acceptance_length"], drafts["transformers"]["acceptance_length"]
    assert v >= 1.5, drafts  # a trained draft, not a random one
    assert abs(v - t) <= 0.05, f"vllm {v:.3f}, transformers {t:.3f} (k={K}): {drafts}"
