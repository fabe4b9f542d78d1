"""Drafts trained from either hidden-state backend reach the same acceptance.

The session's vLLM-backend run (conftest.vllm_backend_run: `hidden.backend: vllm` up to
draft/checkpoint) gives one draft; the session's transformers-backend run (conftest.transformers_backend_run)
takes its prompts and traces and gives the other. Both drafts are trained with the same seed and
settings. Each is scored by the offline prediction (validation.predict: vLLM's greedy chain speculation
simulated with the transformers target, float32) over the same greedy sequences, the traces' own token
ids; the mean acceptance lengths must agree within 0.05. That prediction equals vLLM's own counters on
the embedded default (test_default_workflow asserts the report's agreement), so no vLLM start is spent
here: the two measurements in vLLM this test made before cost about 100 s."""
import json

import pytest

from tests.support.config import TRAIN
from tests.support.measure import K
from tests.support.workflow import read_lines

pytestmark = pytest.mark.vllm  # the session vLLM-backend run starts vLLM


@pytest.fixture(scope="module")
def drafts(vllm_backend_run, transformers_backend_run):
    from eaglenest.states.target import load_target
    from eaglenest.validation.predict import offline_acceptance

    (wd_v, cfg), (wd_t, _) = vllm_backend_run, transformers_backend_run
    assert cfg["train"] == TRAIN
    target = cfg["server"]["model"]
    sequences = [(t["prompt_token_ids"], t["completion_token_ids"]) for t in read_lines(wd_v / "traces/shard_0.jsonl")][:40]
    model = load_target(target, device="cpu", dtype="float32")
    runs = {name: offline_acceptance(target, wd / "draft/checkpoint", k=K, sequences=sequences, dtype="float32",
                                     device="cpu", model=model, progress=False)
            for name, wd in (("vllm", wd_v), ("transformers", wd_t))}
    (wd_t / "backends_acceptance.json").write_text(json.dumps(runs, indent=1))
    print("\nacceptance by backend:", json.dumps({k: v["acceptance_length"] for k, v in runs.items()}))
    return runs


def test_drafts_from_both_backends_reach_the_same_acceptance(drafts):
    v, t = drafts["vllm"]["acceptance_length"], drafts["transformers"]["acceptance_length"]
    assert drafts["vllm"]["target_agreement"] > 0.99, drafts  # the traces are this target's greedy answers
    assert v >= 1.5, drafts  # a trained draft, not a random one
    assert abs(v - t) <= 0.05, f"vllm {v:.3f}, transformers {t:.3f} (k={K}): {drafts}"
