"""Drafts trained from either hidden-state backend are accepted alike by real vLLM.

The session's vLLM-backend run (conftest.vllm_backend_run: `hidden.backend: vllm` up to
draft/checkpoint) gives one draft; the session's transformers-backend run (conftest.transformers_backend_run)
takes its prompts and traces and gives the other. Both drafts are trained with the same seed and
settings, then served one after the other with the toy target (vLLM on CPU, float32) on the held-out
prompts; their mean acceptance lengths, read from vLLM's counters, must agree within 0.05. Two vLLM
starts of its own (one measurement per draft) beyond the shared run's two (traces, extraction)."""
import json
import time

import pytest

from conftest import K, TRAIN, eagle3, measure_draft

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def drafts(vllm_backend_run, transformers_backend_run):
    (wd_v, cfg), (wd_t, _) = vllm_backend_run, transformers_backend_run
    assert cfg["train"] == TRAIN
    t0 = time.monotonic()
    runs = {"vllm": measure_draft("vllm_backend", wd_v, cfg, eagle3(wd_v / "draft/checkpoint")),
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
