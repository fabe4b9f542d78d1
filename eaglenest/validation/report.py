"""The validation report: the findings built from the runs' numbers, written with its page.

``build_report`` turns the vLLM runs (the target alone, the draft in each exported format, n-gram, and
validate.drafts side by side), the offline prediction, the training curves and the cross-checks into
``validation.json``'s dict, with ``findings``: warnings in words, each pointing at its likely causes
and what the checks say about each. ``write_report`` writes it, its page (``page.render_html``) and
the matrix's CSV.

Every comparison of methods (and of vLLM with the offline prediction) is by tokens per target step
(``vllm_facts.per_step``): vLLM's acceptance length, 1 + accepted / drafts, counts only the steps that
made a draft, and n-gram drafts on some steps only. vLLM's figure is shown beside it, labelled per
drafted step (``matrix.PER_DRAFTED_STEP``).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import time
from pathlib import Path

import torch

from ..draft.vllm_format import (PARALLEL_KEYS, SWITCHES, config_value, draft_config_from_json, flat_config,
                                  state_dict_from_vllm)
from ..settings import GenerationSettings
from .matrix import PER_DRAFTED_STEP, matrix_findings, per_drafted_step, write_csv
from .page import one_request_tps, ratio, render_html


# ----------------------------------------------------------------------------- the findings

# vLLM's tokens per target step below this share of the offline prediction's is reported as a disagreement.
# Two formats of the same weights served by vLLM at greedy decoding: tokens per target step this close.
FORMATS_TOLERANCE = 0.01
# The usual reasons a draft does worse in vLLM than offline or than in training, each with the
# check (in report["checks"]) that speaks to it.
LIKELY_CAUSES = {
    "aux_layers": "auxiliary layer ids off by one: vLLM's id i is the state entering layer i (transformers' "
                  "output_hidden_states[i]); SpecForge counts layer outputs, one less",
    "norm_before_residual": "norm_before_residual differs between training and config.json (vLLM reads it from "
                            "config.json; absent means false)",
    "d2t": "d2t inverted, or written as target ids instead of offsets (vLLM: target_id = draft_id + d2t[draft_id])",
    "dtype": "the target served in a different dtype than the hidden states were extracted in",
    "template": "chat template or tokenization differences between the traces and serving",
    "data": "the draft trained on too little data (it fits its training set, not the held-out prompts)",
}


def read_train_metrics(path) -> dict:
    """Columns of train_metrics.csv as float lists, plus ``ttt_length`` (the number of acc_j columns)."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return {"step": [], "ttt_length": 0}
    cols = {key: [float(r[key]) if r[key] not in ("", None) else math.nan for r in rows] for key in rows[0]}
    cols["ttt_length"] = sum(1 for key in rows[0] if re.fullmatch(r"acc_\d+", key))
    return cols


def train_summary(curves: dict, k: int) -> dict:
    """Final training numbers (mean over the last tenth of the steps) and the acceptance they imply
    if the steps' top-1 hits were independent: P(first i accepted) = acc_0 · ... · acc_{i-1}."""
    n = len(curves.get("step", []))
    if not n:
        return {}
    tail = max(1, n // 10)
    mean = lambda key: sum(curves[key][-tail:]) / tail  # noqa: E731
    J = curves["ttt_length"]
    acc = [mean(f"acc_{j}") for j in range(J)]
    per_pos, p = [], 1.0
    for j in range(min(k, J)):
        p *= acc[j]
        per_pos.append(p)
    return {
        "steps": int(curves["step"][-1]), "final_loss": mean("loss"), "acc": acc,
        "predicted_per_position": per_pos,
        "predicted_acceptance_length": 1 + sum(per_pos) if len(per_pos) == k else None,
    }


def learning_curve(points: list[dict], final: dict, curves: dict, prompts: int) -> dict | None:
    """vLLM's acceptance along training: the drafts kept along it (``curve.measure_point``'s points) and the
    final draft (its headline run, ``final``, over ``prompts`` held-out prompts), by step, with ``tokens`` trained so far (``curves``: the columns
    of train_metrics.csv), and ``last_gain``: what the last part of training added (None: no points)."""
    if not points or not final.get("tokens_per_step") or not curves.get("step"):
        return None
    figures = ("tokens_per_step", "drafted_share", "acceptance_length", "acceptance_rate", "per_position")
    keep = ("step", "tokens", *figures, "prompts")
    rows = [{key: p.get(key) for key in keep} for p in sorted(points, key=lambda p: p["step"])]
    rows.append({"step": int(curves["step"][-1]), "tokens": int(sum(curves.get("tokens") or [])),
                 **{key: final.get(key) for key in figures}, "prompts": prompts, "final": True})
    last, before = rows[-1]["tokens_per_step"], rows[-2]["tokens_per_step"]
    return {"points": rows, "last_gain": last - before if before is not None else None}


def cross_checks(target, prompts, runs, generation: GenerationSettings, offline) -> dict:
    """Cross-checks that point at a cause when the numbers disagree (``runs``: the vLLM runs by name
    with their answers, ``generation``: the settings they were asked with, ``offline``: the prediction)."""
    base = runs["baseline"]["answers"]
    checks = {
        "served_dtype": runs["baseline"].get("served_dtype"),
        # Speeds compare like with like only when every run executed the same way (eager or compiled).
        "execution": {name: r.get("execution") for name, r in runs.items()},
        "offline_dtype": offline.get("dtype"),
        "offline_target_agreement": offline.get("target_agreement"),
        "eagle3_outputs_equal_baseline": _identical(runs["eagle3"]["answers"], base),
        "ngram_outputs_equal_baseline": _identical(runs["ngram"]["answers"], base),
        "finish_reasons": {r: sum(a["finish_reason"] == r for a in base) for r in {a["finish_reason"] for a in base}},
    }
    try:
        from transformers import AutoTokenizer

        from ..states.target import chat_prompt_ids

        tok = AutoTokenizer.from_pretrained(target)
        mismatches = sum(
            a["prompt_token_ids"] is not None
            and a["prompt_token_ids"] != chat_prompt_ids(tok, p["messages"], generation.chat_template_kwargs)
            for a, p in zip(base, prompts))
        checks["prompt_template_mismatches"] = mismatches
    except (OSError, ValueError) as e:  # a target without a loadable tokenizer here: say so, do not fail
        checks["prompt_template_mismatches"] = None
        checks["prompt_template_error"] = str(e)[:300]
    return checks


def _evidence(report: dict) -> dict:
    """What the checks say about each likely cause: ``{cause: note}``."""
    checks, notes = report.get("checks") or {}, {}
    diffs = checks.get("export_vs_training")
    if diffs is not None:
        for key, words in (("aux_layers", "aux"), ("norm_before_residual", "norm_before_residual"), ("d2t", "d2t")):
            found = [d for d in diffs if words in d]
            notes[key] = "FOUND: " + "; ".join(found) if found else "config.json and tensors match the training checkpoint"
    if checks.get("served_dtype"):
        same = checks["served_dtype"] == checks.get("offline_dtype")
        notes["dtype"] = ("" if same else "FOUND: ") + f"vLLM served {checks['served_dtype']}, offline ran {checks.get('offline_dtype')}"
    if checks.get("prompt_template_mismatches") is not None:
        n = checks["prompt_template_mismatches"]
        notes["template"] = (f"FOUND: {n} prompts tokenized differently by vLLM" if n
                             else "vLLM's prompt tokens equal apply_chat_template's for every prompt")
    t, o = report.get("train") or {}, report.get("offline") or {}
    if t.get("predicted_acceptance_length") and o.get("tokens_per_step"):
        notes["data"] = (f"training accuracy implies {t['predicted_acceptance_length']:.2f} tokens per step, held-out "
                         f"offline {o['tokens_per_step']:.2f} after {t.get('steps')} steps")
    return notes


def findings(report: dict, warn_below: float) -> list[dict]:
    """Warnings in words: the vLLM/offline disagreement first (with its likely causes and what the
    checks say about each), then notes. ``warn_below``: validate.warn_below."""
    out = []
    e, o, n, t = (report.get(key) or {} for key in ("eagle3", "offline", "ngram", "train"))
    checks = report.get("checks") or {}
    notes = _evidence(report)
    causes = [text + (f" [{notes[key]}]" if key in notes else "") for key, text in LIKELY_CAUSES.items()]
    vllm_al, off_al = e.get("tokens_per_step"), o.get("tokens_per_step")
    if vllm_al is not None and off_al is not None and vllm_al < warn_below * off_al:
        out.append({
            "kind": "disagreement",
            "message": f"In vLLM the draft makes {vllm_al:.3f} tokens per target step, {vllm_al / off_al:.0%} of the "
                       f"offline prediction's {off_al:.3f} (below {warn_below:.0%}; {PER_DRAFTED_STEP}: vLLM "
                       f"{_f3(e.get('acceptance_length'))}, offline {_f3(o.get('acceptance_length'))}): vLLM does not "
                       f"run the draft the way it was trained and evaluated. Likely causes:",
            "causes": causes,
        })
    # Training accuracy implies a length per draft; offline every step drafts, so per step is the same figure.
    train_al = t.get("predicted_acceptance_length")
    if train_al and off_al is not None and off_al < warn_below * train_al:
        out.append({
            "kind": "training_gap",
            "message": f"On the held-out prompts the draft makes {off_al:.3f} tokens per target step offline, "
                       f"{off_al / train_al:.0%} of the {train_al:.3f} its final training accuracy implies: the exported "
                       f"draft is not the trained one, or it fits its training data only. Likely causes:",
            "causes": [c for c, key in zip(causes, LIKELY_CAUSES) if key in ("aux_layers", "norm_before_residual", "d2t", "data")],
        })
    agree = report.get("formats_agree")
    if agree and not agree["agree"]:
        shown = ", ".join(f"{f} {v:.3f}" for f, v in agree["tokens_per_step"].items())
        out.append({"kind": "formats", "message": f"The exported formats of the same weights are accepted differently "
                    f"in vLLM ({shown} tokens per target step; they differ by {agree['difference']:.3f}, more than "
                    f"{agree['tolerance']}): one "
                    "format's config.json is read differently (norm_before_residual's default differs between them)."})
    if checks.get("export_vs_training"):
        out.append({"kind": "export", "message": "The exported draft differs from the training checkpoint: "
                    + "; ".join(checks["export_vs_training"])})
    if checks.get("prompt_template_mismatches"):
        out.append({"kind": "template", "message": f"{checks['prompt_template_mismatches']} of {report.get('prompts')} "
                    "prompts were tokenized differently by vLLM's chat template than by the tokenizer's "
                    "apply_chat_template: traces and serving may not see the same tokens."})
    if checks.get("served_dtype") and checks.get("offline_dtype") and checks["served_dtype"] != checks["offline_dtype"]:
        out.append({"kind": "dtype", "message": f"vLLM served the target in {checks['served_dtype']}, the offline "
                    f"evaluation ran it in {checks['offline_dtype']}."})
    modes = {m for m in (checks.get("execution") or {}).values() if m}
    if len(modes) > 1:
        shown = ", ".join(f"{name} {m}" for name, m in checks["execution"].items())
        out.append({"kind": "execution", "message": f"The vLLM runs did not execute the same way ({shown}): their "
                    "speeds are not comparable; give every run the same server.extra_args (--enforce-eager or none)."})
    if vllm_al is not None and n.get("tokens_per_step") is not None and vllm_al <= n["tokens_per_step"]:
        out.append({"kind": "ngram", "message": f"The EAGLE-3 draft ({vllm_al:.3f} tokens per target step) does not "
                    f"beat n-gram speculation ({n['tokens_per_step']:.3f}; {per_drafted_step(e, n)})."})
    loads = {key: max((report.get(key) or {}).get("load_average") or [0]) for key in ("baseline", "eagle3", "ngram")}
    cores = os.cpu_count() or 1
    if max(loads.values()) > 1.5 * cores:
        out.append({"kind": "load", "message": f"Other processes competed for the {cores} CPU cores during the runs "
                    f"(1-minute load up to {max(loads.values()):.1f}): the tokens/s and the speed-up are unreliable; "
                    "acceptance is not affected."})
    if report.get("matrix"):
        out += matrix_findings(report["matrix"], warn_below)
    if report.get("speedup") is not None and report["speedup"] < 1:
        out.append({"kind": "speed", "message": f"EAGLE-3 is slower than the target alone with one request at a "
                    f"time (×{report['speedup']:.2f} output tokens/s): the draft's cost outweighs the accepted "
                    "tokens; a target this cheap leaves a draft little to save."})
    return out


def export_differences(export_dir, checkpoint_path) -> list[str]:
    """How the exported draft (what vLLM loads) differs from the training checkpoint: config keys
    vLLM reads, d2t, and every weight (compared in the export's dtype). Empty when they agree."""
    from ..draft.checkpoint import load_checkpoint
    from ..draft.export import load_exported

    config, tensors = load_exported(export_dir)
    raw, config = config, flat_config(config)  # either format, as vLLM reads it
    saved, dcfg, info, _ = load_checkpoint(checkpoint_path)
    diffs = []
    ids = list(config.get("eagle_aux_hidden_state_layer_ids") or [])
    if ids != list(info.aux_layers):
        diffs.append(f"aux layer ids: config.json {ids or '(absent: vLLM default)'}, trained on {info.aux_layers}")
    for key in SWITCHES:  # switches vLLM reads, not sizes
        if bool(config_value(config, key)) != bool(getattr(dcfg, key)):
            shown = raw.get(key, f"(absent: {config_value(config, key)})")
            diffs.append(f"{key}: config.json {shown}, trained with {getattr(dcfg, key)}")
    read = draft_config_from_json(raw)
    for key in PARALLEL_KEYS:  # P-EAGLE: served with parallel drafting, and its mask token
        if getattr(read, key) != getattr(dcfg, key):
            diffs.append(f"{key}: config.json {getattr(read, key)}, trained with {getattr(dcfg, key)}")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "draft_vocab_size", "rms_norm_eps"):
        if config.get(key) != dcfg.to_dict()[key]:
            diffs.append(f"{key}: config.json {config.get(key)}, trained with {dcfg.to_dict()[key]}")
    tensors = state_dict_from_vllm(tensors, dcfg)  # vLLM format's names; absent d2t means the identity
    d2t = tensors["d2t"]
    if d2t.shape != saved["d2t"].shape or not torch.equal(d2t, saved["d2t"]):
        as_ids = d2t.shape == saved["d2t"].shape and torch.equal(d2t, saved["d2t"] + torch.arange(len(d2t)))
        diffs.append("d2t differs from training's" + (" (written as target ids, not offsets)" if as_ids else ""))
    for name, t in saved.items():
        if name in ("d2t", "t2d"):
            continue
        if name not in tensors:
            diffs.append(f"{name} missing from the export")
        elif tensors[name].shape != t.shape or not torch.equal(tensors[name], t.to(tensors[name].dtype)):
            diffs.append(f"{name} differs from training's")
    return diffs


def _f3(v) -> str:
    return "–" if v is None else f"{v:.3f}"


def _identical(answers_a, answers_b) -> float | None:
    pairs = [(a.get("completion_token_ids"), b.get("completion_token_ids")) for a, b in zip(answers_a, answers_b)]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def format_agreement(formats: dict) -> dict | None:
    """Whether the exported formats' tokens per target step in vLLM agree (within ``FORMATS_TOLERANCE``)."""
    lengths = {f: r.get("tokens_per_step") for f, r in formats.items()}
    if len(lengths) < 2 or None in lengths.values():
        return None
    spread = max(lengths.values()) - min(lengths.values())
    return {"tokens_per_step": lengths, "difference": spread, "tolerance": FORMATS_TOLERANCE,
            "agree": spread <= FORMATS_TOLERANCE}


def build_report(*, target, draft_dir, k, prompts, max_tokens, runs: dict, offline: dict, train: dict,
                 checks: dict, settings: dict, warn_below: float, formats: dict | None = None,
                 matrix: dict | None = None, curve: dict | None = None) -> dict:
    """The validation.json dict (answers dropped) with the speed-up, agreement and warnings.
    ``formats``: ``{export format: run name}`` of the EAGLE-3 runs (default: vLLM's format, "eagle3").
    ``matrix``: ``matrix.build_matrix``'s (every run × set × temperature); the runs' own cells are dropped."""
    strip = lambda r: {key: v for key, v in (r or {}).items() if key not in ("answers", "cells")}  # noqa: E731
    e, n, b = (strip(runs.get(key)) for key in ("eagle3", "ngram", "baseline"))
    per_format = {f: strip(runs.get(name)) for f, name in (formats or {"vllm": "eagle3"}).items()}
    report = {
        "target": str(target),
        "draft": str(Path(draft_dir).resolve()),
        "num_speculative_tokens": k,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "eagle3": e,
        "ngram": n,
        "baseline": b,
        "offline": offline,
        "train": train,
        # The headline: output tokens/s with one request at a time, where users feel speculative
        # decoding; the configured concurrency beside it, where it helps least.
        "speedup": ratio(one_request_tps(e), one_request_tps(b)),
        "ngram_speedup": ratio(one_request_tps(n), one_request_tps(b)),
        "speedup_concurrent": ratio(e.get("output_tokens_per_s"), b.get("output_tokens_per_s")),
        "ngram_speedup_concurrent": ratio(n.get("output_tokens_per_s"), b.get("output_tokens_per_s")),
        # vLLM's tokens per target step over the offline prediction's
        "agreement": ratio(e.get("tokens_per_step"), (offline or {}).get("tokens_per_step")),
        "formats": per_format,
        "formats_agree": format_agreement(per_format),
        "checks": checks,
        "settings": settings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if matrix is not None:
        report["matrix"] = matrix
    if curve is not None:
        report["curve"] = curve
    report["warnings"] = findings(report, warn_below)
    return report


def _lossless(run: dict) -> str:
    """pass / fail / not scored: the lossless check of a run's held-out T=0 cell (``validate.score_cells``)."""
    check = next((c.get("lossless_check") for c in run.get("cells", []) if c.get("set") == "heldout"
                  and c.get("temperature") == 0), None)
    return "not scored" if not check else "pass" if check["lossless"] else "fail"


def side_by_side(drafts: dict, runs: dict, identical: dict) -> list[dict]:
    """The drafts side by side, on the held-out prompts at T=0: one row per draft (``drafts``: ``{row name:
    {"run", "kind", "path"}}``, this run's first), then n-gram and the target alone as references. Each row:
    tokens per target step, vLLM's acceptance per drafted step and per position, the one-request speed-up
    over the target alone, the lossless check and the share of answers identical to the target alone's
    (``identical``: by run name)."""
    base = one_request_tps(runs["baseline"])
    reference = {"n-gram": {"run": "ngram", "kind": "ngram"}, "target alone": {"run": "baseline", "kind": None}}
    rows = []
    for name, d in {**drafts, **reference}.items():
        r = runs[d["run"]]
        spec = r.get("speculative_config") or {}
        rows.append({"draft": name, "kind": d["kind"], "path": d.get("path"), "run": d["run"],
                     "method": spec.get("method"), "parallel_drafting": bool(spec.get("parallel_drafting")),
                     "tokens_per_step": r.get("tokens_per_step"), "drafted_share": r.get("drafted_share"),
                     "acceptance_length": r.get("acceptance_length"), "per_position": r.get("per_position"),
                     "one_request_tokens_per_s": one_request_tps(r), "speedup": ratio(one_request_tps(r), base),
                     "lossless": "reference" if d["run"] == "baseline" else _lossless(r),
                     "identical_to_target": identical.get(d["run"]), **({"note": d["note"]} if d.get("note") else {})})
    return rows


def write_report(report: dict, json_path, html_path, train_curves=None, csv_path=None) -> None:
    """validation.json, its page, and (with a matrix) validation.csv: one row per cell of the matrix."""
    if csv_path is not None and report.get("matrix"):
        write_csv(report["matrix"], csv_path)
    for path, text in ((json_path, json.dumps(report, indent=2) + "\n"), (html_path, render_html(report, train_curves))):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(text)
        os.replace(tmp, path)
