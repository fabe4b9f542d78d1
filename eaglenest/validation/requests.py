"""Validation's requests, sent through the traces' request side (``serving.chat.answer_prompts``): the settings each carries,
the timed passes over a prompt set, and the one-request-at-a-time speed."""

from __future__ import annotations

import time

from ..errors import TracesError, ValidationError
from ..serving.chat import answer_prompts
from ..settings import GenerationSettings, ValidateSettings

# What decides a request's tokens beside the prompt: validation's own, whatever generation.extra_body says.
SAMPLING_KEYS = ("temperature", "top_p", "seed", "max_tokens")


def request_settings(settings: ValidateSettings, *, temperature: float = 0.0, chat_template_kwargs=None) -> GenerationSettings:
    """The generation settings of validation's requests: generation's (template arguments, extra body, timeout,
    retries) at ``temperature`` (greedy by default), validation's max_tokens, top_p and seed (``request_max_tokens``,
    ``request_top_p``, validate.seed; None: none), whatever generation says, and a set's ``chat_template_kwargs``
    where given."""
    g = settings.generation
    extra = {key: v for key, v in (g.extra_body or {}).items() if key not in SAMPLING_KEYS}
    return g.replace(max_tokens=settings.request_max_tokens, temperature=float(temperature), top_p=settings.request_top_p,
                     seed=settings.seed, extra_body=extra or None,
                     chat_template_kwargs=g.chat_template_kwargs if chat_template_kwargs is None else chat_template_kwargs)


def sent_settings(settings: GenerationSettings) -> dict:
    """What the requests of a cell carried that decides its tokens (recorded per cell in the report)."""
    return {key: getattr(settings, key) for key in SAMPLING_KEYS}


def run_requests(url, model, prompts, settings: GenerationSettings, *, concurrency=8, api_key=None, min_seconds=0.0) -> dict:
    """Send every prompt with ``settings`` (``request_settings``; ``concurrency`` in flight), and the whole set
    again until ``min_seconds`` have passed (a short window makes tokens/s noise); returns throughput, latency,
    the number of passes and the first pass's answers (trace records)."""
    settings = settings.replace(concurrency=concurrency)
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
