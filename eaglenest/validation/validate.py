"""Validation of an exported draft: the three vLLM runs, the offline prediction, the report.

``validate_draft`` writes ``validation.json`` and a self-contained ``validation.html`` from:

- vLLM runs over the held-out prompts, one server at a time (each stopped before the next
  starts, so GPUs are free between them): the target alone, the target with the EAGLE-3 draft in
  each exported format (the speculators one started as its users start it, ``vllm_format.how_to_serve``),
  the target with vLLM's n-gram speculation, and each of validate.drafts (another run's draft of any kind,
  served as its config.json says; the held-out prompts at T=0 only). Same greedy settings for all, sent by the traces client
  (``traces.answer_prompts``). Per run, on one server start: output tokens/s and per-token latency
  with one request at a time (``one_request``), then output tokens/s and mean latency with
  ``validate.concurrency`` in flight (completion tokens / wall time of the timed requests, each phase
  resending the prompt set until its window lasts ``min_seconds``); for the speculative runs the
  acceptance from the DIFFERENCE of vLLM's /metrics counters read before and after both phases
  (``vllm_format.spec_counters``, ``vllm_format.acceptance``);
  then, where a set's rows have a second user turn, that turn after the target alone's own T=0 answer
  (``second_turns``; the target alone's run builds those prompts, the others reuse them);
- the offline prediction (``predict.offline_acceptance``) the vLLM number is checked against;
- the training curves, the cross-checks and the findings (``report``), whether the formats agree;
- then the acceptance figures go into each draft's model card (``card.write_validation``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

from ..config import defaults, matrix_temperatures
from ..serving.chat import GENERATION_DEFAULTS, answer_prompts
from ..draft.dflash_format import config_from_json, speculative_tokens
from ..draft.vllm_format import flat_config, how_to_serve, kind_of
from ..errors import ServerError, TracesError, ValidationError
from ..serving.lifecycle import wait_ready
from ..serving.local import LocalPaths, start_local, stop_local
from ..serving.probe import get_text
from ..serving.settings import ServerConfig
from ..settings import ValidateSettings
from ..states.target import load_target
from ..vllm_facts import (SPECULATIVE_CONFIG_FLAGS, acceptance, kv_cache_facts, per_step, served_dtype, spec_counters,
                          speculative_config, supported_version_note, vllm_version)
from .card import write_validation
from .evalsets import load_set, read_prompts, resolve_sets
from .lossless import score_check, sequence_scores, served_scores
from .matrix import build_matrix, matrix_markdown
from .predict import offline_acceptance
from .second_turns import has_second_turns, second_turns_markdown, second_turns_said, second_turns_section, turn_two_cells
from .report import (build_report, cross_checks, export_differences, learning_curve, read_train_metrics, side_by_side,
                     train_summary, write_report)

DEFAULTS = defaults("validate")  # the schema's `validate:` section (the only place defaults are written)
OFFLINE_SKIPPED = ("validate.offline.engine resolves to none (hidden.backend {backend}): the offline prediction needs the "
                   "whole target in transformers; the lossless check scores the outputs with the target-alone vLLM "
                   "server's prompt_logprobs instead. Set validate.offline.engine: transformers where the target fits")


# ----------------------------------------------------------------------------- /metrics


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


# ----------------------------------------------------------------------------- requests


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


# ----------------------------------------------------------------------------- one vLLM run


@contextlib.contextmanager
def _sigterm_stops_servers():
    """Turn SIGTERM (Snakemake cancelling a job) into KeyboardInterrupt so `finally` stops the server."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _reap(pid: int) -> None:
    """Collect the exit status of a server this process started, so no zombie is left behind."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


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


def measure_run(name, server: ServerConfig, spec: dict | None, prompts, settings, *, log_dir, concurrency=8,
                warmup_requests=2, min_seconds=0.0, workflow_pid=None, log=print, k=None, one_request_runs=1,
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
    with _sigterm_stops_servers():
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
                _reap(record["pid"])
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
        + f", {_steps_said(result, k)}")
    for c in result.get("cells", []):
        log(f"{name}: {c['set']} at T={c['temperature']:g}: {c['prompts']} prompts, {c['output_tokens']} output tokens, "
            f"{c['one_request']['output_tokens_per_s']:.1f} tok/s one request at a time, {_steps_said(c, k)}")
    return result


def _steps_said(figures: dict, k) -> str:
    """A run's or cell's tokens per target step, with vLLM's per-draft figure where it speculated."""
    said = f"{_fmt(figures.get('tokens_per_step'))} tokens per target step"
    if k:
        said += (f" (drafted on {_fmt(figures.get('drafted_share'), '.0%')} of steps; vLLM's acceptance length "
                 f"per drafted step {_fmt(figures.get('acceptance_length'))})")
    return said


def _fmt(v, spec=".3f") -> str:
    return "–" if v is None else format(v, spec)


# ----------------------------------------------------------------------------- the whole validation


def resolve_settings(validate: dict | None, generation: dict) -> dict:
    """The ``validate:`` config with defaults: ``max_tokens`` falling back to generation.max_tokens,
    ``temperatures`` to 0 and generation.temperature (each once, 0 first), ``top_p`` to generation.top_p."""
    s = {**DEFAULTS, **(validate or {})}
    s["ngram"] = {**DEFAULTS["ngram"], **(s.get("ngram") or {})}
    s["offline"] = {**DEFAULTS["offline"], **(s.get("offline") or {})}
    gen = {**GENERATION_DEFAULTS, **{k: v for k, v in generation.items() if v is not None}}
    if s["max_tokens"] is None:
        s["max_tokens"] = gen["max_tokens"]
    s["temperatures"] = matrix_temperatures(s["temperatures"], gen["temperature"])
    if s["top_p"] is None:
        s["top_p"] = gen["top_p"]
    return s


def draft_vocabulary(draft_dir) -> dict:
    """The draft's and the target's vocabulary sizes, from the exported config.json (either format)."""
    config = flat_config(json.loads((Path(draft_dir) / "config.json").read_text()))
    return {"draft_vocab_size": config.get("draft_vocab_size"), "vocab_size": config.get("vocab_size")}


def identical_share(run: dict, baseline: dict) -> float | None:
    """The share of a run's held-out T=0 answers (its headline cell's) that are the target alone's token for
    token; None where either has none."""
    def answers(r):
        return next((c["answers"] for c in r.get("cells", []) if c.get("headline")), r.get("answers"))

    pairs = [(a["completion_token_ids"], b["completion_token_ids"]) for a, b in zip(answers(run) or [], answers(baseline) or [])]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def answer_sequences(cell: dict) -> list[tuple]:
    """A cell's outputs as ``(prompt_ids, completion_ids)``, what the lossless scores are computed over."""
    return [(a["prompt_token_ids"] or [], a["completion_token_ids"]) for a in cell["answers"]]


def score_cells(runs: dict, model, *, alpha: float, tolerance: float, log=print) -> None:
    """Every cell's outputs scored under the target (``lossless.sequence_scores`` with the transformers
    ``model``, unless the cell holds ``scores`` already: ``lossless.served_scores``), and each
    speculative run checked against the target alone at each temperature, over every set at once
    (``lossless.score_check``); adds ``score`` (the cell's own mean) and ``lossless_check`` (the run's
    check at that temperature) to the cells, drops their answers."""
    by_cell = {name: {(c["set"], c["temperature"]): c for c in r.get("cells", [])} for name, r in runs.items()}
    for name, cells in by_cell.items():
        for c in cells.values():
            if "scores" not in c:
                c["scores"] = sequence_scores(model, answer_sequences(c))
            c["score"] = _mean(c["scores"])
    reference = by_cell.get("baseline", {})
    for name, cells in by_cell.items():
        for t in dict.fromkeys(t for _, t in cells):
            keys = [key for key in cells if key[1] == t and key in reference]
            check = score_check([(cells[key]["scores"], reference[key]["scores"]) for key in keys],
                                alpha=alpha, tolerance=tolerance) if name != "baseline" else None
            for key in keys:
                cells[key]["lossless_check"] = check
            if check:
                log(f"validate_draft: {name} T={t:g}: mean log-prob/token {check['score']:.3f} vs target alone "
                    f"{check['reference_score']:.3f} over {check['sets']} set(s), {check['n']} outputs "
                    f"(permutation p {check['p']:.2g}): " + ("lossless within the bound" if check["lossless"] else "NOT LOSSLESS"))
    for cells in by_cell.values():
        for c in cells.values():
            c.setdefault("lossless_check", None)
            c.pop("scores")
            c.pop("answers")


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _matrix_cells(s: dict, sets: list[dict], prompts, generation: dict, cache_dir, log) -> list[dict]:
    """The matrix's cells: every evaluation set (``sets``, ``resolve_sets``'s) at every temperature, the
    held-out set at T=0 flagged ``headline``; each set's prompt counts are added to its entry of ``sets``."""
    cells = []
    for spec in sets:
        rows = prompts if spec["name"] == "heldout" else load_set(spec, cache_dir)
        some = rows[:s["matrix_prompts"]] if s["matrix_prompts"] else rows  # one request at a time costs their tokens
        log(f"validate_draft: evaluation set '{spec['name']}' ({spec['path']}): {len(rows)} prompts, {len(some)} a cell")
        spec["prompts"], spec["cell_prompts"] = len(rows), len(some)
        for t in s["temperatures"]:
            headline = spec["name"] == "heldout" and t == 0
            cells.append({"set": spec["name"], "temperature": t, "prompts": rows if headline else some, "headline": headline,
                          "settings": request_settings(s["max_tokens"], generation, temperature=t, top_p=s["top_p"],
                                                       seed=s["seed"], chat_template_kwargs=spec["chat_template_kwargs"])})
    return cells


def _run_plan(drafts: dict, extra: list[dict], srv: ServerConfig, s: dict, k: int, log) -> tuple[dict, dict, dict]:
    """The vLLM runs in order -> (``{name: (--model, speculative config, served as)}``, ``{export format:
    its run's name}``, ``{extra draft's name: {"run", "kind", "path"}}``): the target alone, each exported
    format of the draft, each of ``extra`` (validate.drafts, served as its config.json says), n-gram."""
    formats, extras = {}, {}
    plan = {"baseline": (srv.model, speculative_config("baseline", k), None)}
    version = vllm_version(srv.python)  # how a speculators draft can be started differs by release
    if supported_version_note(version):
        log(f"validate_draft: {supported_version_note(version)}")
    for i, (fmt, path) in enumerate(drafts.items()):
        formats[fmt] = name = "eagle3" if i == 0 else f"eagle3_{fmt}"
        plan[name] = how_to_serve(fmt, path, k, srv.model, version)
    for d in extra:
        config = json.loads((Path(d["path"]) / "config.json").read_text())
        run = f"draft_{d['name']}"
        extras[d["name"]] = {"run": run, "kind": kind_of(config), "path": str(Path(d["path"]).resolve())}
        plan[run] = how_to_serve("vllm", d["path"], k, srv.model, version)
        trained_k = speculative_tokens(config_from_json(config)[0]) if extras[d["name"]]["kind"] == "dflash" else k
        if trained_k != k:  # vLLM serves a DFlash draft at any k: its block is k + 1 slots
            log(f"validate_draft: DFlash draft '{d['name']}' was trained for k={trained_k} (its block less the anchor); "
                f"served at validate.num_speculative_tokens {k}")
            extras[d["name"]]["note"] = f"trained for k={trained_k}, served at k={k}"
    plan["ngram"] = (srv.model, speculative_config("ngram", k, ngram=s["ngram"]), None)
    return plan, formats, extras


def _offline_engine(offline: dict, hidden_backend: str) -> str:
    """What computes the offline prediction and the lossless scores: "transformers" or "none" (the
    target-alone vLLM server scores the outputs instead)."""
    if offline["engine"] != "auto":
        return offline["engine"]
    return "transformers" if hidden_backend == "transformers" else "none"


def _measure_runs(plan: dict, srv: ServerConfig, s: dict, k: int, prompts, settings, cells, *, engine, log_dir,
                  workflow_pid, log, headline_only=()) -> dict:
    """Every run of ``plan`` measured in vLLM, one server at a time (``measure_run``) -> ``{name: result}``.
    With ``engine`` "none" the target alone runs last and scores every run's outputs before it stops. The runs
    in ``headline_only`` (validate.drafts') measure the headline cell alone, not the matrix."""
    runs, before_stop = {}, {}
    turn_two = _second_turns(plan, srv, s, k, cells, engine=engine, log=log, skip=headline_only)
    if engine == "none":
        # No transformers copy of the target: the target-alone server scores every run's outputs, so it runs last.
        plan = {name: plan[name] for name in plan if name != "baseline"} | {"baseline": plan["baseline"]}

        def score_on_server(url, api_key, result):
            scored = [c for r in (*runs.values(), result) for c in r.get("cells", [])]
            log(f"validate_draft: scoring {sum(len(c['answers']) for c in scored)} outputs with the target alone's "
                f"prompt_logprobs (validate.offline.engine none)")
            for c in scored:
                c["scores"] = served_scores(url, srv.model_id, answer_sequences(c), api_key=api_key,
                                            concurrency=s["concurrency"])

        before_stop["baseline"] = score_on_server
    for name in turn_two:
        before_stop[name] = turn_two[name]
    for name, (model, spec, served_as) in plan.items():
        log(f"validate_draft: run '{name}' ({len(prompts)} prompts, k={k}, --model {model})")
        # The served name stays the target's when --model is a speculators draft directory.
        run_srv = dataclasses.replace(srv, model=model, served_model_name=srv.model_id)
        try:
            runs[name] = measure_run(name, run_srv, spec, prompts, settings, log_dir=log_dir, concurrency=s["concurrency"],
                                     warmup_requests=s["warmup_requests"], min_seconds=s["min_seconds"],
                                     workflow_pid=workflow_pid, log=log, k=None if name in ("baseline", "ngram") else k,
                                     cells=[c for c in cells if c["headline"]] if name in headline_only else cells,
                                     before_stop=before_stop.get(name))
        except ServerError as e:
            raise ValidationError(f"validation run '{name}' could not start vLLM: {e}") from e
        if served_as:
            runs[name]["served_as"] = served_as
    return runs


def _second_turns(plan: dict, srv: ServerConfig, s: dict, k: int, cells, *, engine, log, skip=()) -> dict:
    """``{run name: before_stop hook}`` that asks the sets' second turns on that run's server after its matrix
    (``second_turns``): the target alone's hook builds the turn-2 prompts from its own T=0 answers first. Empty
    where no set has a second turn, validate.second_turns is off, or the target alone runs last (engine none)."""
    sets = sorted({c["set"] for c in cells if c["temperature"] == 0 and has_second_turns(c["prompts"])})
    if not sets or not s["second_turns"]:
        return {}
    if engine == "none":
        log(f"validate_draft: no second turns of {', '.join(sets)}: the target alone runs last to score the outputs "
            f"(validate.offline.engine none), so its turn-1 answers come too late for the drafts' runs")
        return {}
    made = []  # the turn-2 cells, built on the target alone's server (the first to start)

    def hook(name):
        def ask(url, api_key, result):
            if not made:
                made.extend(turn_two_cells(cells, result["cells"]))
            spec = plan[name][1]
            run_k = (spec or {}).get("num_speculative_tokens") or (None if name == "baseline" else k)
            result["second_turns"] = []
            for c in made:
                measured = measure_cell(url, srv.model_id, c, api_key=api_key, k=run_k)  # answers kept: never reported
                result["second_turns"].append({**measured, "turn": c["turn"]})
                log(f"{name}: {c['set']} turn {c['turn']} at T=0: {measured['prompts']} prompts, "
                    f"{measured['output_tokens']} output tokens, {_steps_said(measured, run_k)}")
        return ask

    log(f"validate_draft: second turns of {', '.join(sets)} after the target alone's own turn-1 answers, at T=0 "
        f"(validate.second_turns)")
    return {name: hook(name) for name in plan if name not in skip}


def _offline_prediction(target, draft_dir, runs: dict, prompts, s: dict, k: int, generation: dict, *, engine,
                        hidden_dtype, hidden_backend, log) -> tuple:
    """-> (the target in transformers or None, the offline prediction ``predict.offline_acceptance``, or
    why there is none)."""
    off = s["offline"]
    if engine != "transformers":
        offline = {"skipped": OFFLINE_SKIPPED.format(backend=hidden_backend)}
        log(f"validate_draft: no offline prediction: {offline['skipped']}")
        return None, offline
    offline_dtype = off["dtype"] or hidden_dtype
    log(f"validate_draft: offline prediction ({off['tokens']} sequences, {offline_dtype})")
    sequences = None
    if off["tokens"] == "served":
        sequences = [(a["prompt_token_ids"], a["completion_token_ids"]) for a in runs["baseline"]["answers"]]
    model = load_target(target, device=off["device"], dtype=offline_dtype)
    offline = offline_acceptance(target, draft_dir, k=k, sequences=sequences, prompts=prompts, max_tokens=s["max_tokens"],
                                 chat_template_kwargs=generation.get("chat_template_kwargs"), dtype=offline_dtype,
                                 device=off["device"], model=model)
    log(f"validate_draft: offline {_fmt(offline['tokens_per_step'])} tokens per target step (acceptance length per "
        f"drafted step {_fmt(offline['acceptance_length'])}; {offline['drafts']} drafts, {offline['seconds']} s)")
    return model, offline


def _report(drafts: dict, formats: dict, extras: dict, runs: dict, offline: dict, sets, s: dict, srv: ServerConfig, *,
            target, prompts, generation, checkpoint_path, metrics_path, curve_paths, identical: dict) -> tuple[dict, dict]:
    """-> (the report dict ``report.build_report`` makes of the runs, the training metrics' columns). The runs of
    ``extras`` (validate.drafts) are only in its drafts side by side (``report.side_by_side``)."""
    draft_dir, k = next(iter(drafts.values())), s["num_speculative_tokens"]
    everything, runs = runs, {name: r for name, r in runs.items() if name not in {e["run"] for e in extras.values()}}
    checks = cross_checks(target, prompts, runs, generation, offline)
    if checkpoint_path is not None:
        # Every exported format against the training checkpoint, each read back as vLLM reads it.
        checks["export_vs_training"] = [f"{fmt} format: {d}" if len(drafts) > 1 else d for fmt, path in drafts.items()
                                        for d in export_differences(path, checkpoint_path)]
    curves = read_train_metrics(metrics_path)
    matrix = build_matrix(runs, sets=sets, temperatures=s["temperatures"], top_p=s["top_p"], seed=s["seed"], k=k,
                          offline=offline, warn_below=s["warn_below"])
    curve = learning_curve([json.loads(Path(p).read_text()) for p in curve_paths], runs["eagle3"], curves, len(prompts))
    report = build_report(
        matrix=matrix, curve=curve, target=target, draft_dir=draft_dir, k=k, prompts=len(prompts), max_tokens=s["max_tokens"], runs=runs,
        offline=offline, train=train_summary(curves, k), checks=checks, warn_below=s["warn_below"], formats=formats,
        settings={"concurrency": s["concurrency"], "ngram": s["ngram"], "offline": s["offline"],
                  "warmup_requests": s["warmup_requests"], "min_seconds": s["min_seconds"],
                  "served_model": srv.model_id, "tensor_parallel_size": srv.tensor_parallel_size,
                  "max_model_len": srv.max_model_len, "server": f"{srv.host}:{srv.port or 'a free port per run'}",
                  **draft_vocabulary(draft_dir)},
    )
    main = {"run": "eagle3", "kind": kind_of(json.loads((Path(draft_dir) / "config.json").read_text())),
            "path": str(Path(draft_dir).resolve())}
    report["drafts"] = side_by_side({"this run": main, **extras}, everything, identical)
    return report, curves


def _log_summary(report: dict, offline: dict, concurrency, json_path, html_path, log) -> None:
    """The validation in one line: tokens per target step (the comparison), vLLM's per-drafted-step figure beside."""
    per_format = ", ".join(f"{f} format {_fmt(r.get('tokens_per_step'))}" for f, r in report["formats"].items())
    versus = (f"{_fmt(offline['tokens_per_step'])} offline" if offline.get("tokens_per_step") is not None
              else "no offline prediction")
    e, n = report["eagle3"], report["ngram"]
    log(f"validate_draft: EAGLE-3 tokens per target step ({per_format}) in vLLM vs {versus}, "
        f"n-gram {_fmt(n.get('tokens_per_step'))} (vLLM's acceptance length per drafted step: EAGLE-3 "
        f"{_fmt(e.get('acceptance_length'))}, n-gram {_fmt(n.get('acceptance_length'))} drafting on "
        f"{_fmt(n.get('drafted_share'), '.0%')} of steps); speed-up ×{report['speedup']:.2f} (n-gram "
        f"×{_fmt(report.get('ngram_speedup'), '.2f')}) one request at a time, ×{report['speedup_concurrent']:.2f} at "
        f"{concurrency} in flight; {len(report['warnings'])} warning(s); {report['seconds']} s -> {json_path}, {html_path}")
    for row in report.get("drafts") or []:
        log(f"validate_draft: side by side: {row['draft']} ({row['kind']}): {_fmt(row['tokens_per_step'])} tokens per "
            f"target step, per position {[round(p, 3) for p in row['per_position'] or []]}, vLLM's per drafted step "
            f"{_fmt(row['acceptance_length'])}, speed-up ×{_fmt(row['speedup'], '.2f')} one request, lossless "
            f"{row['lossless']}")
    if report.get("curve"):
        log("validate_draft: tokens per target step along training: " + ", ".join(
            f"step {p['step']} {_fmt(p.get('tokens_per_step'))}" for p in report["curve"]["points"]))


def validate_draft(drafts, heldout_path, metrics_path, json_path, html_path, settings: ValidateSettings | None = None,
                   *, checkpoint_path=None, log_dir="logs/validate", workflow_pid=None, log=print, csv_path=None,
                   curve_paths=()) -> dict:
    """The whole validation (module docstring); returns the report dict it wrote. ``settings``: the
    stage's (the servers, the requests, the target; None: the schema's defaults). ``drafts``:
    ``{format: directory}`` of the exported drafts (or one directory in vLLM's format); each is
    measured in vLLM and gets the figures in its model card. ``checkpoint_path`` (the training
    checkpoint) adds the export-against-training check; ``hidden_backend``: where validate.offline.engine is
    auto, transformers computes the offline prediction and the scores only if it held the target already; ``curve_paths``: the learning curve's points
    (``curve.measure_point``), drawn with the final draft's acceptance."""
    settings = settings or ValidateSettings.defaults()
    server, generation, validate, target = settings.server, settings.generation, settings.validate, settings.target
    hidden_dtype, hidden_backend, cache_dir = settings.hidden_dtype, settings.hidden_backend, settings.cache_dir
    if not isinstance(drafts, dict):
        drafts = {"vllm": drafts}
    draft_dir = next(iter(drafts.values()))  # the offline prediction and the export check read this one
    t0 = time.time()
    s = resolve_settings(validate, generation)
    k = s["num_speculative_tokens"]
    prompts = read_prompts(heldout_path)
    srv = ServerConfig.from_dict(server)
    if s.get("port"):
        srv = dataclasses.replace(srv, port=s["port"])
    target = target or srv.model
    headline = request_settings(s["max_tokens"], generation, top_p=s["top_p"], seed=s["seed"])  # the headline's: T=0
    # The matrix: every set at every temperature, each measured on every server start.
    sets = resolve_sets(s["datasets"], heldout_path)
    cells = _matrix_cells(s, sets, prompts, generation, cache_dir, log)
    plan, formats, extras = _run_plan(drafts, settings.other_drafts, srv, s, k, log)
    engine = _offline_engine(s["offline"], hidden_backend)
    runs = _measure_runs(plan, srv, s, k, prompts, headline, cells, engine=engine, log_dir=log_dir,
                         workflow_pid=workflow_pid, log=log, headline_only={e["run"] for e in extras.values()})
    # Whether each run's T=0 held-out answers are the target alone's token for token (before the scores drop them).
    identical = {name: identical_share(r, runs["baseline"]) for name, r in runs.items()}
    second = second_turns_section(runs)
    for r in runs.values():
        r.pop("second_turns", None)
    model, offline = _offline_prediction(target, draft_dir, runs, prompts, s, k, generation, engine=engine,
                                         hidden_dtype=hidden_dtype, hidden_backend=hidden_backend, log=log)
    score_cells(runs, model, alpha=s["lossless_alpha"], tolerance=s["lossless_tolerance"], log=log)
    del model

    report, curves = _report(drafts, formats, extras, runs, offline, sets, s, srv, target=target, prompts=prompts,
                             generation=generation, checkpoint_path=checkpoint_path, metrics_path=metrics_path,
                             curve_paths=curve_paths, identical=identical)
    report["second_turns"] = second
    report["seconds"] = round(time.time() - t0, 1)
    write_report(report, json_path, html_path, curves, csv_path=csv_path)
    matrix_lines = matrix_markdown(report["matrix"]) if report.get("matrix") else []
    for fmt, path in drafts.items():
        write_validation(path, report, fmt, matrix_lines + second_turns_markdown(second))
    _log_summary(report, offline, s["concurrency"], json_path, html_path, log)
    for line in second_turns_said(second):
        log(f"validate_draft: {line}")
    return report
