"""One vLLM run of the validation: a server started for it (the target, with or without a speculative config),
the held-out prompts one request at a time and ``validate.concurrency`` in flight with vLLM's counters read
around them, the matrix's cells on the same server start (``measure_cell``), and the server stopped, always."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from ..errors import ValidationError
from ..serving.lifecycle import wait_ready
from ..serving.local import LocalPaths, start_local, stop_local
from ..serving.settings import ServerConfig
from ..settings import ValidateSettings
from ..vllm_facts import SPECULATIVE_CONFIG_FLAGS, kv_cache_facts, served_dtype
from .metrics import COUNTED_KEYS, counted_figures, counter_delta, settled_counters
from .requests import one_request_speed, run_requests, sent_settings
from .signals import reap, sigterm_stops_servers


def validation_server(settings: ValidateSettings, server: ServerConfig) -> ServerConfig:
    """The server every validation run starts from: the generation server's (``server``), on validate.port where set."""
    return server.replace(port=settings.port) if settings.port else server


def measure_cell(url, model, cell: dict, *, api_key=None, k=None, first=None) -> dict:
    """One cell of the matrix on a running server: the set's prompts one request at a time at the
    cell's settings, with the counters read around them. ``first``: the headline phases' figures
    (held-out set, T=0), reused rather than measured again."""
    if first is None:
        before = settled_counters(url, api_key, wait_s=2.0) if k else None
        run = run_requests(url, model, cell["prompts"], cell["settings"], concurrency=1, api_key=api_key)
        after = settled_counters(url, api_key, wait_s=2.0) if k else None
        out = {"one_request": one_request_speed([run]), "answers": run["answers"],
               **counted_figures(counter_delta(before, after) if k else None, [run], k)}
    else:
        out = {key: first[key] for key in ("one_request", "answers", *COUNTED_KEYS) if key in first}
    out.update({"set": cell["set"], "temperature": cell["temperature"], "prompts": len(cell["prompts"]),
                "request_settings": sent_settings(cell["settings"]),
                "output_tokens": sum(len(a["completion_token_ids"]) for a in out["answers"])})
    return out


def measure_run(name, server: ServerConfig, spec: dict | None, prompts, settings, *, log_dir, concurrency: int,
                warmup_requests: int, min_seconds: float, workflow_pid=None, log=print, k=None, one_request_runs=1,
                cells=(), before_stop=None) -> dict:
    """Start vLLM (``server.model``, with ``spec`` as its --speculative-config), send the prompts, read
    the counters around the timed requests, and stop the server (its whole process group) always.
    ``k``: the speculative tokens of a run whose model directory carries them (a speculators draft
    served as the model) rather than ``spec``. ``one_request_runs``: timed one-request phases (the
    median one is reported; benchmarks/bench_speedup.py takes three; 0: none, acceptance only). ``cells``: the matrix's cells
    (``{"set", "temperature", "prompts", "settings"}``), each measured on the same server start after
    the headline phases (``measure_cell``); the one flagged ``headline`` reuses their figures.
    ``before_stop(url, api_key, result)``: more work for the server once the cells are measured."""
    if any(str(a).startswith(SPECULATIVE_CONFIG_FLAGS) for a in server.extra_args):
        raise ValidationError("server.extra_args holds a --speculative-config: validation sets its own "
                              "per run; remove it from server.extra_args")
    k = (spec or {}).get("num_speculative_tokens") or k
    extra = list(server.extra_args) + (["--speculative-config", json.dumps(spec)] if spec else [])
    cfg = dataclasses.replace(server, mode="local", extra_args=extra, keep_server=False, replicas=1)  # one server
    paths = LocalPaths(Path(log_dir) / name)
    stop_local(paths, log=log)  # a server left by a killed earlier validation
    api_key = cfg.api_key(create=True)  # the run's own key where server.host is not loopback
    t0 = time.monotonic()
    record = None
    with sigterm_stops_servers():
        try:
            # start_local leaves out the job's thread-count variables (server.THREAD_ENV)
            record = start_local(cfg, paths, workflow_pid=workflow_pid, log=log)
            ready = wait_ready(cfg, paths, log=log)
            url = ready["urls"][0]
            if warmup_requests:
                run_requests(url, cfg.model_id, prompts[:warmup_requests], settings, concurrency=concurrency,
                             api_key=api_key)
            before = settled_counters(url, api_key, wait_s=2.0)
            load = os.getloadavg()[0]
            # Both speeds on this one server start (a start costs a minute on a small machine): one
            # request at a time, where users feel speculative decoding, then the configured concurrency.
            singles = [run_requests(url, cfg.model_id, prompts, settings, concurrency=1, api_key=api_key,
                                    min_seconds=min_seconds) for _ in range(one_request_runs)]
            result = run_requests(url, cfg.model_id, prompts, settings, concurrency=concurrency,
                                  api_key=api_key, min_seconds=min_seconds)
            after = settled_counters(url, api_key)
            if singles:
                result["one_request"] = one_request_speed(singles)
            # The counters cover every timed request: each one-request phase and the concurrent one, all passes.
            result.update(counted_figures(counter_delta(before, after) if k else None, [*singles, result], k))
            result["cells"] = [measure_cell(url, cfg.model_id, c, api_key=api_key, k=k,
                                            first=result if c.get("headline") else None) for c in cells]
            # Other processes on the machine skew tokens/s: the 1-minute load around the timed requests.
            result["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]
            if before_stop is not None:
                before_stop(url, api_key, result)
        finally:
            stop_local(paths, log=log)
            if record:
                reap(record["pid"])
    facts = kv_cache_facts(paths.log)
    result.update({"seconds_to_ready": ready["seconds_to_ready"], "vllm_version": ready.get("version"),
                   "served_dtype": served_dtype(paths.log), "seconds": round(time.monotonic() - t0, 1),
                   "execution": {True: "eager", False: "compiled"}.get(facts.get("eager")),
                   "kv_cache_gib": facts.get("kv_cache_gib"), "max_concurrency": facts.get("max_concurrency"),
                   "speculative_config": spec})
    if k and result["drafts"] == 0:
        raise ValidationError(f"{name}: vLLM counted no speculative drafts over {len(prompts)} requests "
                              f"(counters {after}); speculation did not run: see {paths.log}")
    one = result.get("one_request")
    log(f"{name}: " + (f"one request at a time {one['output_tokens_per_s']:.1f} tok/s ({one['ms_per_token']:.2f} ms/token); "
                       if one else "") + f"{concurrency} in flight {result['completion_tokens']} tokens ({result['passes']} pass(es)) in "
        f"{result['wall_s']:.1f} s ({result['output_tokens_per_s']:.1f} tok/s, mean latency {result['mean_latency_s']:.2f} s)"
        + f", {steps_said(result, k)}")
    for c in result.get("cells", []):
        log(f"{name}: {c['set']} at T={c['temperature']:g}: {c['prompts']} prompts, {c['output_tokens']} output tokens, "
            f"{c['one_request']['output_tokens_per_s']:.1f} tok/s one request at a time, {steps_said(c, k)}")
    return result


def steps_said(figures: dict, k) -> str:
    """A run's or cell's tokens per target step, with vLLM's per-draft figure where it speculated."""
    said = f"{fmt(figures.get('tokens_per_step'))} tokens per target step"
    if k:
        said += (f" (drafted on {fmt(figures.get('drafted_share'), '.0%')} of steps; vLLM's acceptance length "
                 f"per drafted step {fmt(figures.get('acceptance_length'))})")
    return said


def fmt(v, spec=".3f") -> str:
    return "–" if v is None else format(v, spec)
