"""Validation of an exported draft: its vLLM runs, the offline prediction, the report.

``validate_draft`` writes ``validation.json`` and a self-contained ``validation.html`` from:

- vLLM runs over the held-out prompts, one server at a time (each stopped before the next
  starts, so GPUs are free between them): the target alone, the target with the EAGLE-3 draft in
  each exported format (the speculators one started as its users start it, ``vllm_format.how_to_serve``),
  each of validate.drafts (another run's draft of any kind, served as its config.json says; the held-out
  prompts at T=0 only), and the target with vLLM's n-gram speculation. Same greedy settings for all, sent
  by the traces client (``requests``). Per run, on one server start (``runs.measure_run``): output tokens/s
  and per-token latency with one request at a time, then output tokens/s and mean latency with
  ``validate.concurrency`` in flight (completion tokens / wall time of the timed requests, each phase
  resending the prompt set until its window lasts ``min_seconds``); for the speculative runs the
  acceptance from the DIFFERENCE of vLLM's /metrics counters read before and after both phases
  (``metrics``); then the matrix's cells (every evaluation set at every temperature, ``matrix``) and,
  where a set's rows have a second user turn, that turn after the target alone's own T=0 answer
  (``second_turns``; the target alone's run builds those prompts, the others reuse them);
- the offline prediction (``predict.offline_acceptance``) the vLLM number is checked against, and the
  lossless check of every cell's outputs under the target (``lossless``);
- the training curves, the cross-checks and the findings (``report``), whether the formats agree;
- then the acceptance figures go into each draft's model card (``card.write_validation``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from ..draft.dflash_format import config_from_json, speculative_tokens
from ..draft.vllm_format import flat_config, how_to_serve, kind_of
from ..errors import ServerError, ValidationError
from ..serving.settings import ServerConfig
from ..settings import ValidateSettings
from ..states.target import load_target
from ..vllm_facts import speculative_config, supported_version_note, vllm_version
from .card import write_validation
from .evalsets import load_set, read_prompts, resolve_sets
from .lossless import score_check, sequence_scores, served_scores
from .matrix import build_matrix, matrix_markdown, matrix_temperatures
from .predict import offline_acceptance
from .report import (build_report, cross_checks, export_differences, learning_curve, read_train_metrics, side_by_side,
                     train_summary, write_report)
from .requests import request_settings
from .runs import fmt, measure_cell, measure_run, steps_said, validation_server
from .second_turns import has_second_turns, second_turns_markdown, second_turns_said, second_turns_section, turn_two_cells

OFFLINE_SKIPPED = ("validate.offline.engine resolves to none (hidden.backend {backend}): the offline prediction needs the "
                   "whole target in transformers; the lossless check scores the outputs with the target-alone vLLM "
                   "server's prompt_logprobs instead. Set validate.offline.engine: transformers where the target fits")


def validate_draft(drafts, heldout_path, metrics_path, json_path, html_path, settings: ValidateSettings | None = None,
                   *, server: ServerConfig | None = None, checkpoint_path=None, log_dir="logs/validate", workflow_pid=None,
                   log=print, csv_path=None, curve_paths=()) -> dict:
    """The whole validation (module docstring); returns the report dict it wrote. ``settings``: the
    stage's (the runs, the requests, the target; None: the schema's defaults); ``server``: the generation
    server's settings, which every run's server starts from (None: the schema's defaults). ``drafts``:
    ``{format: directory}`` of the exported drafts (or one directory in vLLM's format); each is
    measured in vLLM and gets the figures in its model card. ``checkpoint_path`` (the training
    checkpoint) adds the export-against-training check; ``curve_paths``: the learning curve's points
    (``curve.measure_point``), drawn with the final draft's acceptance."""
    settings = settings or ValidateSettings.defaults()
    if not isinstance(drafts, dict):
        drafts = {"vllm": drafts}
    draft_dir = next(iter(drafts.values()))  # the offline prediction and the export check read this one
    t0 = time.time()
    prompts = read_prompts(heldout_path)
    srv = validation_server(settings, server or ServerConfig.defaults())
    headline = request_settings(settings)  # the headline's: T=0
    # The matrix: every set at every temperature, each measured on every server start.
    temperatures = matrix_temperatures(settings.temperatures, settings.generation.temperature)
    sets = resolve_sets(settings.datasets, heldout_path)
    cells = _matrix_cells(settings, temperatures, sets, prompts, log)
    plan, formats, extras = _run_plan(drafts, settings, srv, log)
    engine = _offline_engine(settings)
    runs = _measure_runs(plan, srv, settings, prompts, headline, cells, engine=engine, log_dir=log_dir,
                         workflow_pid=workflow_pid, log=log, headline_only={e["run"] for e in extras.values()})
    # Whether each run's T=0 held-out answers are the target alone's token for token (before the scores drop them).
    identical = {name: identical_share(r, runs["baseline"]) for name, r in runs.items()}
    second = second_turns_section(runs)
    for r in runs.values():
        r.pop("second_turns", None)
    model, offline = _offline_prediction(settings, draft_dir, runs, prompts, engine=engine, log=log)
    score_cells(runs, model, alpha=settings.lossless_alpha, tolerance=settings.lossless_tolerance, log=log)
    del model

    report, curves = _report(drafts, formats, extras, runs, offline, sets, temperatures, settings, srv, prompts=prompts,
                             checkpoint_path=checkpoint_path, metrics_path=metrics_path, curve_paths=curve_paths,
                             identical=identical)
    report["second_turns"] = second
    report["seconds"] = round(time.time() - t0, 1)
    write_report(report, json_path, html_path, curves, csv_path=csv_path)
    matrix_lines = matrix_markdown(report["matrix"]) if report.get("matrix") else []
    for form, path in drafts.items():
        write_validation(path, report, form, matrix_lines + second_turns_markdown(second))
    _log_summary(report, offline, settings.concurrency, json_path, html_path, log)
    for line in second_turns_said(second):
        log(f"validate_draft: {line}")
    return report


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


def _matrix_cells(settings: ValidateSettings, temperatures: list[float], sets: list[dict], prompts, log) -> list[dict]:
    """The matrix's cells: every evaluation set (``sets``, ``resolve_sets``'s) at every temperature, the
    held-out set at T=0 flagged ``headline``; each set's prompt counts are added to its entry of ``sets``."""
    cells, limit = [], settings.matrix_prompts
    for spec in sets:
        rows = prompts if spec["name"] == "heldout" else load_set(spec, settings.cache_dir)
        some = rows[:limit] if limit else rows  # one request at a time costs their tokens
        log(f"validate_draft: evaluation set '{spec['name']}' ({spec['path']}): {len(rows)} prompts, {len(some)} a cell")
        spec["prompts"], spec["cell_prompts"] = len(rows), len(some)
        for t in temperatures:
            headline = spec["name"] == "heldout" and t == 0
            cells.append({"set": spec["name"], "temperature": t, "prompts": rows if headline else some, "headline": headline,
                          "settings": request_settings(settings, temperature=t,
                                                       chat_template_kwargs=spec["chat_template_kwargs"])})
    return cells


def _run_plan(drafts: dict, settings: ValidateSettings, srv: ServerConfig, log) -> tuple[dict, dict, dict]:
    """The vLLM runs in order -> (``{name: (--model, speculative config, served as)}``, ``{export format:
    its run's name}``, ``{extra draft's name: {"run", "kind", "path"}}``): the target alone, each exported
    format of the draft, each of validate.drafts (``other_drafts``, served as its config.json says), n-gram."""
    formats, extras, k = {}, {}, settings.num_speculative_tokens
    plan = {"baseline": (srv.model, speculative_config("baseline", k), None)}
    version = vllm_version(srv.python)  # how a speculators draft can be started differs by release
    if supported_version_note(version):
        log(f"validate_draft: {supported_version_note(version)}")
    for i, (form, path) in enumerate(drafts.items()):
        formats[form] = name = "eagle3" if i == 0 else f"eagle3_{form}"
        plan[name] = how_to_serve(form, path, k, srv.model, version)
    for d in settings.other_drafts:
        config = json.loads((Path(d["path"]) / "config.json").read_text())
        run = f"draft_{d['name']}"
        extras[d["name"]] = {"run": run, "kind": kind_of(config), "path": str(Path(d["path"]).resolve())}
        plan[run] = how_to_serve("vllm", d["path"], k, srv.model, version)
        trained_k = speculative_tokens(config_from_json(config)[0]) if extras[d["name"]]["kind"] == "dflash" else k
        if trained_k != k:  # vLLM serves a DFlash draft at any k: its block is k + 1 slots
            log(f"validate_draft: DFlash draft '{d['name']}' was trained for k={trained_k} (its block less the anchor); "
                f"served at validate.num_speculative_tokens {k}")
            extras[d["name"]]["note"] = f"trained for k={trained_k}, served at k={k}"
    plan["ngram"] = (srv.model, speculative_config("ngram", k, ngram=settings.ngram), None)
    return plan, formats, extras


def _offline_engine(settings: ValidateSettings) -> str:
    """What computes the offline prediction and the lossless scores: "transformers" or "none" (the
    target-alone vLLM server scores the outputs instead); validate.offline.engine auto: transformers where
    hidden.backend held the target in it already."""
    if settings.offline["engine"] != "auto":
        return settings.offline["engine"]
    return "transformers" if settings.hidden_backend == "transformers" else "none"


def _measure_runs(plan: dict, srv: ServerConfig, settings: ValidateSettings, prompts, headline: dict, cells, *,
                  engine, log_dir, workflow_pid, log, headline_only=()) -> dict:
    """Every run of ``plan`` measured in vLLM, one server at a time (``measure_run``) -> ``{name: result}``.
    With ``engine`` "none" the target alone runs last and scores every run's outputs before it stops. The runs
    in ``headline_only`` (validate.drafts') measure the headline cell alone, not the matrix. ``headline``: the
    request settings of the held-out set at T=0."""
    runs, before_stop, k = {}, {}, settings.num_speculative_tokens
    turn_two = _second_turns(plan, srv, settings, cells, engine=engine, log=log, skip=headline_only)
    if engine == "none":
        # No transformers copy of the target: the target-alone server scores every run's outputs, so it runs last.
        plan = {name: plan[name] for name in plan if name != "baseline"} | {"baseline": plan["baseline"]}

        def score_on_server(url, api_key, result):
            scored = [c for r in (*runs.values(), result) for c in r.get("cells", [])]
            log(f"validate_draft: scoring {sum(len(c['answers']) for c in scored)} outputs with the target alone's "
                f"prompt_logprobs (validate.offline.engine none)")
            for c in scored:
                c["scores"] = served_scores(url, srv.model_id, answer_sequences(c), api_key=api_key,
                                            concurrency=settings.concurrency)

        before_stop["baseline"] = score_on_server
    for name in turn_two:
        before_stop[name] = turn_two[name]
    for name, (model, spec, served_as) in plan.items():
        log(f"validate_draft: run '{name}' ({len(prompts)} prompts, k={k}, --model {model})")
        # The served name stays the target's when --model is a speculators draft directory.
        run_srv = dataclasses.replace(srv, model=model, served_model_name=srv.model_id)
        try:
            runs[name] = measure_run(name, run_srv, spec, prompts, headline, log_dir=log_dir,
                                     concurrency=settings.concurrency, warmup_requests=settings.warmup_requests,
                                     min_seconds=settings.min_seconds,
                                     workflow_pid=workflow_pid, log=log, k=None if name in ("baseline", "ngram") else k,
                                     cells=[c for c in cells if c["headline"]] if name in headline_only else cells,
                                     before_stop=before_stop.get(name))
        except ServerError as e:
            raise ValidationError(f"validation run '{name}' could not start vLLM: {e}") from e
        if served_as:
            runs[name]["served_as"] = served_as
    return runs


def _second_turns(plan: dict, srv: ServerConfig, settings: ValidateSettings, cells, *, engine, log, skip=()) -> dict:
    """``{run name: before_stop hook}`` that asks the sets' second turns on that run's server after its matrix
    (``second_turns``): the target alone's hook builds the turn-2 prompts from its own T=0 answers first. Empty
    where no set has a second turn, validate.second_turns is off, or the target alone runs last (engine none)."""
    sets = sorted({c["set"] for c in cells if c["temperature"] == 0 and has_second_turns(c["prompts"])})
    if not sets or not settings.second_turns:
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
            run_k = (spec or {}).get("num_speculative_tokens") or (None if name == "baseline" else settings.num_speculative_tokens)
            result["second_turns"] = []
            for c in made:
                measured = measure_cell(url, srv.model_id, c, api_key=api_key, k=run_k)  # answers kept: never reported
                result["second_turns"].append({**measured, "turn": c["turn"]})
                log(f"{name}: {c['set']} turn {c['turn']} at T=0: {measured['prompts']} prompts, "
                    f"{measured['output_tokens']} output tokens, {steps_said(measured, run_k)}")
        return ask

    log(f"validate_draft: second turns of {', '.join(sets)} after the target alone's own turn-1 answers, at T=0 "
        f"(validate.second_turns)")
    return {name: hook(name) for name in plan if name not in skip}


def _offline_prediction(settings: ValidateSettings, draft_dir, runs: dict, prompts, *, engine, log) -> tuple:
    """-> (the target in transformers or None, the offline prediction ``predict.offline_acceptance``, or
    why there is none)."""
    off, target, k = settings.offline, settings.target, settings.num_speculative_tokens
    if engine != "transformers":
        offline = {"skipped": OFFLINE_SKIPPED.format(backend=settings.hidden_backend)}
        log(f"validate_draft: no offline prediction: {offline['skipped']}")
        return None, offline
    offline_dtype = off["dtype"] or settings.hidden_dtype
    log(f"validate_draft: offline prediction ({off['tokens']} sequences, {offline_dtype})")
    sequences = None
    if off["tokens"] == "served":
        sequences = [(a["prompt_token_ids"], a["completion_token_ids"]) for a in runs["baseline"]["answers"]]
    model = load_target(target, device=off["device"], dtype=offline_dtype)
    offline = offline_acceptance(target, draft_dir, k=k, sequences=sequences, prompts=prompts,
                                 max_tokens=settings.request_max_tokens,
                                 chat_template_kwargs=settings.generation.chat_template_kwargs, dtype=offline_dtype,
                                 device=off["device"], model=model)
    log(f"validate_draft: offline {fmt(offline['tokens_per_step'])} tokens per target step (acceptance length per "
        f"drafted step {fmt(offline['acceptance_length'])}; {offline['drafts']} drafts, {offline['seconds']} s)")
    return model, offline


def _report(drafts: dict, formats: dict, extras: dict, runs: dict, offline: dict, sets, temperatures,
            settings: ValidateSettings, srv: ServerConfig, *, prompts, checkpoint_path, metrics_path, curve_paths,
            identical: dict) -> tuple[dict, dict]:
    """-> (the report dict ``report.build_report`` makes of the runs, the training metrics' columns). The runs of
    ``extras`` (validate.drafts) are only in its drafts side by side (``report.side_by_side``)."""
    draft_dir, k, target = next(iter(drafts.values())), settings.num_speculative_tokens, settings.target
    everything, runs = runs, {name: r for name, r in runs.items() if name not in {e["run"] for e in extras.values()}}
    checks = cross_checks(target, prompts, runs, settings.generation, offline)
    if checkpoint_path is not None:
        # Every exported format against the training checkpoint, each read back as vLLM reads it.
        checks["export_vs_training"] = [f"{form} format: {d}" if len(drafts) > 1 else d for form, path in drafts.items()
                                        for d in export_differences(path, checkpoint_path)]
    curves = read_train_metrics(metrics_path)
    matrix = build_matrix(runs, sets=sets, temperatures=temperatures, top_p=settings.request_top_p, seed=settings.seed, k=k,
                          offline=offline, warn_below=settings.warn_below)
    curve = learning_curve([json.loads(Path(p).read_text()) for p in curve_paths], runs["eagle3"], curves, len(prompts))
    report = build_report(
        matrix=matrix, curve=curve, target=target, draft_dir=draft_dir, k=k, prompts=len(prompts), max_tokens=settings.request_max_tokens,
        runs=runs, offline=offline, train=train_summary(curves, k), checks=checks, warn_below=settings.warn_below, formats=formats,
        settings={"concurrency": settings.concurrency, "ngram": settings.ngram, "offline": settings.offline,
                  "warmup_requests": settings.warmup_requests, "min_seconds": settings.min_seconds,
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
    per_format = ", ".join(f"{f} format {fmt(r.get('tokens_per_step'))}" for f, r in report["formats"].items())
    versus = (f"{fmt(offline['tokens_per_step'])} offline" if offline.get("tokens_per_step") is not None
              else "no offline prediction")
    e, n = report["eagle3"], report["ngram"]
    log(f"validate_draft: EAGLE-3 tokens per target step ({per_format}) in vLLM vs {versus}, "
        f"n-gram {fmt(n.get('tokens_per_step'))} (vLLM's acceptance length per drafted step: EAGLE-3 "
        f"{fmt(e.get('acceptance_length'))}, n-gram {fmt(n.get('acceptance_length'))} drafting on "
        f"{fmt(n.get('drafted_share'), '.0%')} of steps); speed-up ×{report['speedup']:.2f} (n-gram "
        f"×{fmt(report.get('ngram_speedup'), '.2f')}) one request at a time, ×{report['speedup_concurrent']:.2f} at "
        f"{concurrency} in flight; {len(report['warnings'])} warning(s); {report['seconds']} s -> {json_path}, {html_path}")
    for row in report.get("drafts") or []:
        log(f"validate_draft: side by side: {row['draft']} ({row['kind']}): {fmt(row['tokens_per_step'])} tokens per "
            f"target step, per position {[round(p, 3) for p in row['per_position'] or []]}, vLLM's per drafted step "
            f"{fmt(row['acceptance_length'])}, speed-up ×{fmt(row['speedup'], '.2f')} one request, lossless "
            f"{row['lossless']}")
    if report.get("curve"):
        log("validate_draft: tokens per target step along training: " + ", ".join(
            f"step {p['step']} {fmt(p.get('tokens_per_step'))}" for p in report["curve"]["points"]))


