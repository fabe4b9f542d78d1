"""Validation's requests, sent through the traces' request side (``serving.chat.answer_prompts``): the settings each carries,
the timed passes over a prompt set, and the one-request-at-a-time speed."""

from __future__ import annotations

import time

from ..serving.chat import GENERATION_DEFAULTS, answer_prompts
from ..errors import TracesError, ValidationError


def request_settings(max_tokens: int, generation: dict | None = None, *, temperature: float = 0.0,
                     top_p: float | None = None, seed: int | None = None, chat_template_kwargs=None) -> dict:
    """The ``generation`` settings of the traces client for validation: the config's (template
    arguments, extra body, timeouts, retries), at ``temperature`` (greedy by default) and ``max_tokens``
    long whatever they say; ``top_p``, ``seed`` and a set's ``chat_template_kwargs`` where given."""
    g = {key: v for key, v in (generation or {}).items() if key in GENERATION_DEFAULTS}
    sampling = ("temperature", "max_tokens", "top_p", "seed")
    extra = {key: v for key, v in (g.get("extra_body") or {}).items() if key not in sampling}
    out = {**g, "max_tokens": max_tokens, "temperature": float(temperature), "extra_body": extra or None}
    for key, v in (("top_p", top_p), ("seed", seed), ("chat_template_kwargs", chat_template_kwargs)):
        if v is not None:
            out[key] = v
    return out


def sent_settings(settings: dict) -> dict:
    """What the requests of a cell carried that decides its tokens (recorded per cell in the report)."""
    g = {**GENERATION_DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}
    return {key: g.get(key) for key in ("temperature", "top_p", "seed", "max_tokens")}


def run_requests(url, model, prompts, settings, *, concurrency=8, api_key=None, min_seconds=0.0) -> dict:
    """Send every prompt (``concurrency`` in flight), and the whole set again until ``min_seconds``
    have passed (a short window makes tokens/s noise); returns throughput, latency, the number of
    passes and the first pass's answers (trace records)."""
    settings = {**settings, "concurrency": concurrency}
    t0 = time.monotonic()
    answers, passes, tokens, latencies = None, 0, 0, []
    while passes == 0 or time.monotonic() - t0 < min_seconds:
        try:
            got = answer_prompts(prompts, url=url, model=model, generation=settings, api_key=api_key, name="validate")
        except TracesError as e:
            raise ValidationError(f"validation requests to {url} failed: {e}") from e
        answers = answers or got
        passes += 1
        tokens += sum(len(a["completion_token_ids"]) for a in got)
        latencies += [a["latency_s"] for a in got]
    wall = time.monotonic() - t0
    return {
        "requests": len(latencies),
        "passes": passes,
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "mean_latency_s": sum(latencies) / max(len(latencies), 1),
        "answers": answers,
    }


def one_request_speed(runs: list[dict]) -> dict:
    """The figures of ``run_requests`` results sent one request at a time: output tokens/s and the
    per-token latency (a request's latency over its output tokens, prefill included, pooled), of the
    median run by tokens/s; with several runs, every run's tokens/s too."""
    run = sorted(runs, key=lambda r: r["output_tokens_per_s"] or 0.0)[len(runs) // 2]
    out = {"requests": run["requests"], "passes": run["passes"], "completion_tokens": run["completion_tokens"],
           "wall_s": run["wall_s"], "output_tokens_per_s": run["output_tokens_per_s"],
           "ms_per_token": 1000 * run["mean_latency_s"] * run["requests"] / max(run["completion_tokens"], 1),
           "mean_latency_s": run["mean_latency_s"]}
    if len(runs) > 1:
        out["runs_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in runs]
    return out
