"""vLLM's /metrics read around a run's requests: the speculative-decoding counters, their difference, and the
figures of the requests one difference covers (vLLM's acceptance, tokens per target step)."""

from __future__ import annotations

import time

from ..errors import ValidationError
from ..serving.probe import get_text
from ..vllm_facts import acceptance, per_step, spec_counters


def counter_delta(before: dict, after: dict) -> dict:
    """``after - before`` of two ``spec_counters`` readings (counters only grow while a server lives)."""
    delta = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    positions = set(before["accepted_per_pos"]) | set(after["accepted_per_pos"])
    delta["accepted_per_pos"] = {p: after["accepted_per_pos"].get(p, 0.0) - before["accepted_per_pos"].get(p, 0.0)
                                 for p in sorted(positions)}
    if min([delta["drafts"], delta["draft_tokens"], delta["accepted"], *delta["accepted_per_pos"].values()]) < 0:
        raise ValidationError(f"vLLM's speculative-decoding counters went down between two readings "
                              f"({before} -> {after}): the server restarted during the run")
    return delta


def read_metrics(url: str, api_key: str | None = None, timeout: float = 30.0) -> str:
    try:
        return get_text(f"{url}/metrics", api_key, timeout)
    except OSError as e:
        raise ValidationError(f"could not read {url}/metrics: {e}") from e


def settled_counters(url: str, api_key: str | None = None, wait_s: float = 5.0) -> dict:
    """The counters once two readings 0.5 s apart agree (stats reach the frontend with a small lag)."""
    last = spec_counters(read_metrics(url, api_key))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = spec_counters(read_metrics(url, api_key))
        if now == last:
            break
        last = now
    return last


# What a run's figures from the counters are, copied as they are onto the headline cell.
COUNTED_KEYS = ("acceptance_length", "acceptance_rate", "per_position", "drafts", "draft_tokens", "accepted",
                "tokens_per_step", "drafted_share", "decode_steps", "counted_requests", "counted_completion_tokens")


def counted_figures(delta: dict | None, runs: list[dict], k) -> dict:
    """The figures of the requests one counter difference covers: ``runs``, every ``run_requests`` result
    sent between its two readings (each with all its passes). vLLM's per-draft acceptance (``k``: None for
    the target alone, which has none) and the tokens per target step (``vllm_facts.per_step``) over the
    same requests, with those requests' count and completion tokens (``counted_*``)."""
    tokens, requests = sum(r["completion_tokens"] for r in runs), sum(r["requests"] for r in runs)
    out = acceptance(delta, k) if k else {}
    out.update(per_step(delta if k else {}, tokens, requests), counted_requests=requests,
               counted_completion_tokens=tokens)
    return out
