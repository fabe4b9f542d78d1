"""The validation report's page: one self-contained HTML file of the report dict (``render_html``).

It has inline SVG plots, no scripts, no links. Plots are drawn as plain SVG (``plots``: no plotting
dependency): ``line_chart`` for training curves, ``bar_chart`` for grouped bars (per-position
acceptance, throughput); the matrix's tables and chart come from ``matrix``.
"""

from __future__ import annotations

import json
import math

from .matrix import PER_DRAFTED_STEP, drafted_said, matrix_html
from .plots import bar_chart, esc, line_chart
from .second_turns import second_turns_html


def ratio(a, b):
    """``a / b``, None where either is missing (or ``b`` is 0)."""
    return a / b if a is not None and b else None


def one_request_tps(run: dict):
    """Output tokens/s of a run with one request at a time (None where it was not measured)."""
    return (run.get("one_request") or {}).get("output_tokens_per_s")


CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1180px;margin:24px auto;padding:0 16px;color:#222}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
.verdict{padding:12px 16px;border-radius:6px;margin:14px 0}
.ok{background:#e8f5e9;border:1px solid #81c784} .bad{background:#fdecea;border:1px solid #e57373}
.note{background:#fff8e1;border:1px solid #ffd54f}
table{border-collapse:collapse;margin:8px 0;font-size:14px} td,th{border:1px solid #ddd;padding:4px 10px;text-align:right}
th{background:#f5f5f5} td:first-child,th:first-child{text-align:left}
.plots{display:flex;flex-wrap:wrap;gap:12px} .plot{border:1px solid #eee;background:#fff}
pre{background:#f7f7f7;padding:10px;overflow-x:auto;font-size:12px} .muted{color:#666;font-size:13px}
"""


def _num(v, digits=3):
    if v is None:
        return "–"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "–"
        return f"{v:.{digits}f}"
    return esc(v)


def _table(header, rows):
    """A table of cells already formatted as HTML (escaped text, numbers through ``_num``), through a DataFrame."""
    import pandas as pd

    return pd.DataFrame(rows, columns=[esc(h) for h in header]).to_html(index=False, escape=False, border=0)


def _plots(report, train_curves):
    k = report["num_speculative_tokens"]
    plots = []
    if train_curves and train_curves.get("step"):
        steps = train_curves["step"]
        losses = [("loss (weighted)", steps, train_curves["loss"])]
        losses += [(f"loss step {j}", steps, train_curves[f"loss_{j}"]) for j in range(train_curves["ttt_length"])]
        plots.append(line_chart(losses, title="Training loss", xlabel="optimizer step", ylabel="cross-entropy", logy=True))
        accs = [(f"acc step {j}", steps, train_curves[f"acc_{j}"]) for j in range(train_curves["ttt_length"])]
        plots.append(line_chart(accs, title="Training top-1 accuracy per TTT step", xlabel="optimizer step",
                                ylabel="accuracy", ylim=(0.0, 1.0)))
    cats = [f"pos {i + 1}" for i in range(k)]
    series = []
    for key, label in (("eagle3", "EAGLE-3 in vLLM"), ("offline", "offline prediction"), ("ngram", "n-gram in vLLM")):
        per = (report.get(key) or {}).get("per_position")
        if per:
            series.append((label, list(per) + [None] * (k - len(per))))
    if series:
        plots.append(bar_chart(cats, series, title="Per-position acceptance rate (per drafted step)",
                               xlabel="draft position", ylabel="accepted / drafts", ylim=(0, 1.0)))
    runs = [("baseline", "target alone"), ("eagle3", "EAGLE-3"), ("ngram", "n-gram")]
    ones = [one_request_tps(report.get(key) or {}) for key, _ in runs]
    tps = [(report.get(key) or {}).get("output_tokens_per_s") for key, _ in runs]
    concurrency = (report.get("settings") or {}).get("concurrency")
    if any(v is not None for v in ones + tps):
        plots.append(bar_chart([label for _, label in runs],
                               [("one request at a time", ones), (f"{concurrency} in flight", tps)],
                               title="Throughput in vLLM", xlabel="run", ylabel="output tokens / s", fmt="{:.1f}"))
    return plots


def _curve_html(curve: dict | None, ngram: float | None) -> list[str]:
    """The learning curve: vLLM's tokens per target step of the drafts kept along training and of the final
    one (``ngram``: n-gram's tokens per target step, drawn flat)."""
    if not curve:
        return []
    rows, gain = curve["points"], curve["last_gain"]
    steps = [r["step"] for r in rows]
    series = [("EAGLE-3 in vLLM", steps, [r.get("tokens_per_step") for r in rows])]
    if ngram is not None:
        series.append(("n-gram in vLLM", [steps[0], steps[-1]], [ngram, ngram]))
    verdict = "" if gain is None else (
        f"The last {rows[-1]['step'] - rows[-2]['step']} steps added {gain:+.3f} tokens per target step: "
        + ("more training still pays." if gain >= 0.05 else "the draft has about stopped learning from this data."
           if gain > -0.05 else "it went down: the draft overfits this data."))
    return ["<h2>Acceptance along training</h2>", f"<p>{esc(verdict)}</p>",
            _table(["draft", "step", "tokens trained", "tokens per target step", PER_DRAFTED_STEP, "per position"],
                   [["final" if r.get("final") else f"kept at step {r['step']}", _num(r["step"]), f'{r["tokens"]:,}',
                     _num(r.get("tokens_per_step"), 3), _num(r.get("acceptance_length"), 3),
                     ", ".join(_num(p, 3) for p in r.get("per_position") or []) or "–"]
                    for r in rows]),
            line_chart(series, title="Tokens per target step along training (held-out set, T=0)",
                       xlabel="optimizer step", ylabel="tokens per target step"),
            '<p class="muted">Each kept draft is served by its own vLLM start (rule curve_point, train.snapshots) and '
            'sent the held-out prompts at T=0; the final draft\'s point is its headline run above.</p>']


def _execution_note(*runs) -> str:
    """"; every server eager" (or compiled) where all runs executed the same way, else nothing (a
    finding says they differ)."""
    modes = {r.get("execution") for r in runs}
    return f"; every server {modes.pop()}" if len(modes) == 1 and None not in modes else ""


def _head_html(report: dict) -> list[str]:
    """The page's head, its title and the line of what was validated."""
    settings = report.get("settings") or {}
    return [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>EAGLE-3 draft validation: {esc(report.get('target'))}</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>EAGLE-3 draft validation</h1>",
        f'<div class="muted">target <b>{esc(report.get("target"))}</b> · draft {esc(report.get("draft"))} · '
        f'k = {report["num_speculative_tokens"]} · draft vocabulary {esc(settings.get("draft_vocab_size"))} of '
        f'{esc(settings.get("vocab_size"))} · '
        f'{report.get("prompts")} held-out prompts · max_tokens {report.get("max_tokens")} · '
        f'{esc(report.get("created", ""))}</div>',
    ]


def _verdict_html(report: dict) -> list[str]:
    """The headline (acceptance and speed-up) and a box per warning."""
    e, o, n, b = (report.get(key) or {} for key in ("eagle3", "offline", "ngram", "baseline"))
    warnings = report.get("warnings") or []
    concurrency = (report.get("settings") or {}).get("concurrency")
    headline = (f"Tokens per target step in vLLM <b>{_num(e.get('tokens_per_step'), 2)}</b> "
                f"(offline prediction {_num(o.get('tokens_per_step'), 2)}, n-gram {_num(n.get('tokens_per_step'), 2)}, "
                f"the target alone 1; {esc(PER_DRAFTED_STEP)}: EAGLE-3 {esc(drafted_said(e))}, "
                f"n-gram {esc(drafted_said(n))}); "
                f"speed-up over the target alone with one request at a time <b>{_num(report.get('speedup'), 2)}×</b> "
                f"(n-gram {_num(report.get('ngram_speedup'), 2)}×; {_num(report.get('speedup_concurrent'), 2)}× with "
                f"{esc(concurrency)} requests in flight{_execution_note(b, e, n)}).")
    if o.get("skipped"):
        headline += f" No offline prediction: {esc(o['skipped'])}."
    parts = []
    if any(w["kind"] == "disagreement" for w in warnings):
        parts.append(f'<div class="verdict bad"><b>vLLM and the offline prediction disagree.</b> {headline}</div>')
    else:
        parts.append(f'<div class="verdict ok">{headline}</div>')
    for w in warnings:
        causes = "".join(f"<li>{esc(c)}</li>" for c in w.get("causes", []))
        cls = "bad" if w["kind"] in ("disagreement", "not_lossless") else "note"
        parts.append(f'<div class="verdict {cls}">{esc(w["message"])}' + (f"<ul>{causes}</ul>" if causes else "") + "</div>")
    return parts


def _summary_rows(report: dict) -> list[list[str]]:
    """The summary table's rows: each vLLM run, the offline prediction, the prediction from training accuracy."""
    e, o, n, b = (report.get(key) or {} for key in ("eagle3", "offline", "ngram", "baseline"))
    drafts = [(f"EAGLE-3 draft, {f} format", r) for f, r in (report.get("formats") or {"vllm": e}).items()]
    base_one = one_request_tps(b)
    rows = []
    for label, r in [("target alone", b), *drafts, ("n-gram", n)]:
        one = r.get("one_request") or {}
        rows.append([esc(label), _num(r.get("tokens_per_step"), 3), _num(r.get("drafted_share"), 2),
                     _num(r.get("acceptance_length"), 3), _num(r.get("acceptance_rate"), 3),
                     ", ".join(_num(p, 3) for p in r.get("per_position") or []) or "–",
                     _num(one.get("output_tokens_per_s"), 1), _num(one.get("ms_per_token"), 2),
                     _num(ratio(one.get("output_tokens_per_s"), base_one), 2),
                     _num(r.get("output_tokens_per_s"), 1), _num(r.get("mean_latency_s"), 3),
                     _num(ratio(r.get("output_tokens_per_s"), b.get("output_tokens_per_s")), 2),
                     f'{_num(one.get("passes"))} + {_num(r.get("passes"))}',
                     _num((one.get("completion_tokens") or 0) + (r.get("completion_tokens") or 0)),
                     _num((one.get("wall_s") or 0.0) + (r.get("wall_s") or 0.0), 1)])
    rows.append(["offline prediction", _num(o.get("tokens_per_step"), 3), _num(o.get("drafted_share"), 2),
                 _num(o.get("acceptance_length"), 3), _num(o.get("acceptance_rate"), 3),
                 ", ".join(_num(p, 3) for p in o.get("per_position") or []) or "–", "–", "–", "–", "–", "–", "–",
                 "1", _num(o.get("completion_tokens")), _num(o.get("seconds"), 1)])
    t = report.get("train") or {}
    if t.get("predicted_acceptance_length") is not None:
        rows.append(["from training accuracy", "–", "–", _num(t.get("predicted_acceptance_length"), 3), "–",
                     ", ".join(_num(p, 3) for p in t.get("predicted_per_position") or []),
                     *["–"] * 9])
    return rows


def _summary_html(report: dict) -> list[str]:
    """The summary table, how its figures are made, and whether the exported formats agree."""
    concurrency = (report.get("settings") or {}).get("concurrency")
    parts = ["<h2>Summary</h2>"]
    parts.append(_table(["run", "tokens per target step", "share of steps drafted", PER_DRAFTED_STEP,
                         "acceptance rate", "per position",
                         "1 request: output tok/s", "1 request: ms/token", "1 request: speed-up",
                         f"{esc(concurrency)} in flight: output tok/s", f"{esc(concurrency)} in flight: mean latency s",
                         f"{esc(concurrency)} in flight: speed-up", "passes (1 + n)", "completion tokens", "wall s"],
                        _summary_rows(report)))
    parts.append(f'<p class="muted">Tokens per target step = (completion tokens − requests) / decode steps, '
                 f'decode steps = completion tokens − requests − accepted tokens (each request\'s first token comes '
                 f'from its prefill, every later target step yields 1 + its accepted tokens), never fewer than the '
                 f'drafts: every step counted, whether it drafted or not; the target alone makes 1. vLLM\'s acceptance '
                 f'length = 1 + accepted / drafts (the bonus token included) counts only the steps that made a draft '
                 f'(share of steps drafted): n-gram drafts where its lookup finds a match, so its figure is per drafted '
                 f'step and does not compare with EAGLE-3\'s, which drafts on every step. '
                 f'Rates from differences of vLLM\'s /metrics counters around each run\'s timed requests, over all of '
                 f'them (every pass of both phases). Each run '
                 f'is one server start: the prompts sent one request at a time, then validate.concurrency in flight, '
                 f'each phase sending the set again until its window lasts validate.min_seconds ("passes"). ms/token: '
                 f'a request\'s latency over its output tokens (prefill included). Speed-up = output tok/s over the '
                 f'target alone\'s. vLLM / offline tokens per target step: {_num(report.get("agreement"), 3)}.</p>')
    agree = report.get("formats_agree")
    if agree:
        verdict = "agree" if agree["agree"] else "<b>disagree</b>"
        parts.append(f'<p>The exported formats {verdict} in vLLM: tokens per target step differ by '
                     f'{_num(agree["difference"], 4)} (tolerance {agree["tolerance"]}).</p>')
    for f, r in (report.get("formats") or {"vllm": report.get("eagle3") or {}}).items():
        if r.get("served_as"):
            parts.append(f'<p class="muted">{esc(f)} format served as: {esc(r["served_as"])}</p>')
    return parts


def _drafts_html(rows: list[dict]) -> list[str]:
    """The drafts side by side (``side_by_side``'s rows)."""
    if not rows:
        return []
    body = [[esc(r["draft"]), esc(r["kind"] or "–"), esc(r["method"] or "–") + (" (parallel)" if r["parallel_drafting"] else ""),
             _num(r["tokens_per_step"], 3), ", ".join(_num(p, 3) for p in r["per_position"] or []) or "–",
             _num(r["acceptance_length"], 3), _num(r["drafted_share"], 2), _num(r["one_request_tokens_per_s"], 1),
             _num(r["speedup"], 2), esc(r["lossless"]), _num(r["identical_to_target"], 2)] for r in rows]
    return ["<h2>Drafts side by side</h2>",
            _table(["draft", "kind", "served as", "tokens per target step", "per position", PER_DRAFTED_STEP,
                    "share of steps drafted", "1 request: output tok/s", "1 request: speed-up", "lossless",
                    "answers identical to the target's"], body),
            '<p class="muted">Held-out prompts at T=0, each draft one vLLM start at validate.num_speculative_tokens '
            '(validate.drafts: headline prompts only, not the matrix). Lossless: the check of the outputs\' '
            'log-probabilities under the target against the target alone\'s.</p>']


def render_html(report: dict, train_curves: dict | None = None) -> str:
    """The whole report page. ``train_curves``: columns of train_metrics.csv (see read_train_metrics)."""
    parts = _head_html(report)
    if report.get("matrix"):
        parts.append(matrix_html(report["matrix"]))
        parts.append("<h2>Held-out set at T=0: vLLM against the offline prediction</h2>")
    parts += _verdict_html(report)
    parts += _summary_html(report)
    parts += _drafts_html(report.get("drafts") or [])
    parts += second_turns_html(report.get("second_turns") or [])
    parts += _curve_html(report.get("curve"), (report.get("ngram") or {}).get("tokens_per_step"))
    parts.append("<h2>Plots</h2>")
    parts.append('<div class="plots">' + "\n".join(_plots(report, train_curves)) + "</div>")

    parts.append("<h2>Checks</h2>")
    checks = report.get("checks") or {}
    parts.append(_table(["check", "value"], [[esc(key), esc(json.dumps(v))] for key, v in checks.items()]))
    parts.append("<h2>Settings and raw numbers</h2>")
    raw = json.dumps({key: v for key, v in report.items()}, indent=1)
    parts.append(f"<details><summary>validation.json</summary><pre>{esc(raw)}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
