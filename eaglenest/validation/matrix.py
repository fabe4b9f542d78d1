"""The validation matrix: every method × evaluation set × temperature, as one table.

``build_matrix`` turns the vLLM runs' cells (``runs.measure_cell``, scored by ``validate.score_cells``)
into ``validation.json``'s ``matrix`` (docs/validation.md describes it); ``cells_frame`` makes the
same cells a pandas DataFrame, one row per cell, which is both ``reports/validation.csv`` and the
source of the report's matrix tables. ``matrix_findings`` names the cells to worry about: an engine
that is not lossless there, EAGLE-3 below n-gram, or below ``warn_below`` of its T=0 held-out figure.
Methods are compared by tokens per target step (``vllm_facts.per_step``); vLLM's acceptance length
counts drafted steps only (n-gram drafts on some steps), so it is shown beside it, never compared.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from .plots import bar_chart, esc

BASELINE, NGRAM = "baseline", "ngram"
CELL_KEYS = ("set", "temperature")
# The CSV's columns, in order (per_position_1..k follow acceptance_rate).
COLUMNS = ("method", "set", "temperature", "top_p", "seed", "max_tokens", "prompts", "output_tokens",
           "tokens_per_step", "drafted_share", "decode_steps",
           "acceptance_length", "acceptance_rate", "drafts", "draft_tokens", "accepted",
           "output_tokens_per_s", "ms_per_token", "speedup", "score", "score_difference", "lossless_p",
           "lossless", "vllm_version")


def matrix_temperatures(temperatures, generation_temperature) -> list[float]:
    """validate.temperatures as validation measures them: null is 0 and generation.temperature, each once;
    T=0 always (the headline and the offline check), sorted."""
    temps = temperatures if temperatures is not None else [0.0, generation_temperature]
    return sorted({float(t) for t in temps} | {0.0})


def _cell_row(method: str, cell: dict, base: dict | None, version) -> dict:
    one = cell.get("one_request") or {}
    base_tps = ((base or {}).get("one_request") or {}).get("output_tokens_per_s")
    check = cell.get("lossless_check")
    sent = cell.get("request_settings") or {}
    return {
        "method": method, "set": cell["set"], "temperature": cell["temperature"],
        "top_p": sent.get("top_p"), "seed": sent.get("seed"), "max_tokens": sent.get("max_tokens"),
        "prompts": cell.get("prompts"), "output_tokens": cell.get("output_tokens"),
        "tokens_per_step": cell.get("tokens_per_step"), "drafted_share": cell.get("drafted_share"),
        "decode_steps": cell.get("decode_steps"),
        "acceptance_length": cell.get("acceptance_length"), "acceptance_rate": cell.get("acceptance_rate"),
        "per_position": cell.get("per_position"),
        "drafts": cell.get("drafts"), "draft_tokens": cell.get("draft_tokens"), "accepted": cell.get("accepted"),
        "output_tokens_per_s": one.get("output_tokens_per_s"), "ms_per_token": one.get("ms_per_token"),
        "speedup": one["output_tokens_per_s"] / base_tps if base_tps and one.get("output_tokens_per_s") else None,
        "score": cell.get("score"),
        "score_difference": _difference(cell.get("score"), (base or {}).get("score")) if check else None,
        "lossless_p": check["p"] if check else None,
        "lossless": check["lossless"] if check else None,
        "lossless_check": check, "request_settings": sent, "vllm_version": version,
    }


def _difference(score, reference) -> float | None:
    return score - reference if score is not None and reference is not None else None


def build_matrix(runs: dict, *, sets: list[dict], temperatures, top_p, seed, k, warn_below: float, offline=None) -> dict:
    """``validation.json``'s ``matrix``: the sets, the temperatures, one row per run × set × temperature
    (``cells``), and the offline prediction (held-out set, T=0) beside them."""
    base = {(c["set"], c["temperature"]): c for c in runs.get(BASELINE, {}).get("cells", [])}
    cells = []
    for method, run in runs.items():
        for c in run.get("cells", []):
            cells.append(_cell_row(method, c, base.get((c["set"], c["temperature"])), run.get("vllm_version")))
    return {
        "sets": [{key: s.get(key) for key in ("name", "path", "split", "subset", "limit", "prompts",
                                              "cell_prompts", "chat_template_kwargs")} for s in sets],
        "temperatures": list(temperatures), "top_p": top_p, "seed": seed, "num_speculative_tokens": k,
        "offline": {"set": "heldout", "temperature": 0.0, "tokens_per_step": (offline or {}).get("tokens_per_step"),
                    "acceptance_length": (offline or {}).get("acceptance_length")},
        "warn_below": warn_below,
        "cells": cells,
    }


def cells_frame(matrix: dict) -> pd.DataFrame:
    """The matrix's cells, one row per method × set × temperature (the CSV's rows)."""
    rows = matrix.get("cells") or []
    k = matrix.get("num_speculative_tokens") or max((len(r.get("per_position") or []) for r in rows), default=0)
    df = pd.DataFrame([{key: r.get(key) for key in COLUMNS} for r in rows], columns=list(COLUMNS))
    at = df.columns.get_loc("acceptance_rate") + 1
    for i in range(k):
        df.insert(at + i, f"per_position_{i + 1}",
                  [(r.get("per_position") or [None] * k)[i] if i < len(r.get("per_position") or []) else None for r in rows])
    return df


def write_csv(matrix: dict, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    cells_frame(matrix).to_csv(tmp, index=False)
    os.replace(tmp, path)


def _cell(matrix: dict, method: str, set_name: str, t: float) -> dict | None:
    return next((c for c in matrix.get("cells") or [] if c["method"] == method and c["set"] == set_name
                 and c["temperature"] == t), None)


def headline_cell(matrix: dict, method: str = "eagle3") -> dict | None:
    return _cell(matrix, method, "heldout", 0.0)


def _run_shown(method: str, cells: list[dict]) -> str:
    """One run's failed check: its pooled scores and p, and each set's difference."""
    check = cells[0]["lossless_check"]
    by_set = ", ".join(f"{c['set']} {c['score_difference']:+.3f}" for c in cells if c.get("score_difference") is not None)
    return (f"{method} (mean log-prob/token {check['score']:.3f} vs the target alone's {check['reference_score']:.3f} "
            f"over {check['n']} outputs, permutation p {check['p']:.2g}; by set: {by_set})")


def matrix_findings(matrix: dict, warn_below: float) -> list[dict]:
    """Findings over the matrix: cells where the engine is not lossless (one finding per temperature,
    naming the engine version and the runs), then cells where EAGLE-3 falls below n-gram or below
    ``warn_below`` of its held-out T=0 figure (lossless cells only), by tokens per target step."""
    out, cells = [], matrix.get("cells") or []
    for t in matrix.get("temperatures") or []:
        bad = [c for c in cells if c["temperature"] == t and c.get("lossless") is False]
        if bad:
            version = next((c["vllm_version"] for c in bad if c.get("vllm_version")), "?")
            runs = {}
            for c in bad:
                runs.setdefault(c["method"], []).append(c)
            shown = "; ".join(_run_shown(method, run) for method, run in runs.items())
            out.append({"kind": "not_lossless", "temperature": t, "cells": [[c["method"], c["set"]] for c in bad],
                        "message": f"vLLM {version} is not lossless at temperature {t:g} under speculation: {shown}. "
                                   "Their outputs are not the target's distribution, so the acceptance measured there is "
                                   "the engine's fault, not the draft's, and the matrix does not show it as the draft's."})
    head = headline_cell(matrix)
    for c in cells:
        if not c["method"].startswith("eagle3") or c.get("lossless") is False or c.get("tokens_per_step") is None:
            continue
        where = f"{c['method']} on {c['set']} at T={c['temperature']:g}"
        ngram = _cell(matrix, NGRAM, c["set"], c["temperature"])
        if ngram and c is not head and ngram.get("lossless") is not False and ngram.get("tokens_per_step") is not None \
                and c["tokens_per_step"] < ngram["tokens_per_step"]:
            out.append({"kind": "matrix_ngram", "cell": [c["method"], c["set"], c["temperature"]],
                        "message": f"{where}: EAGLE-3 makes {c['tokens_per_step']:.3f} tokens per target step, below "
                                   f"n-gram's {ngram['tokens_per_step']:.3f} ({per_drafted_step(c, ngram)})."})
        ref = (head or {}).get("tokens_per_step")
        if ref and c is not head and c["tokens_per_step"] < warn_below * ref:
            out.append({"kind": "matrix_drop", "cell": [c["method"], c["set"], c["temperature"]],
                        "message": f"{where}: {c['tokens_per_step']:.3f} tokens per target step is "
                                   f"{c['tokens_per_step'] / ref:.0%} of the held-out T=0 figure {ref:.3f} "
                                   f"(below {warn_below:.0%}): the draft serves this set or temperature less well."})
    return out


def per_drafted_step(eagle: dict, ngram: dict) -> str:
    """vLLM's own acceptance lengths of an EAGLE-3 and an n-gram figure, said as what they are: per drafted
    step, with the share of steps that drafted (what makes them incomparable)."""
    return f"vLLM's acceptance length per drafted step: EAGLE-3 {drafted_said(eagle)}, n-gram {drafted_said(ngram)}"


def drafted_said(r: dict) -> str:
    """One run's vLLM acceptance length with the share of its steps that drafted: "2.250 (drafted on 20% of steps)"."""
    share = r.get("drafted_share")
    return _f3(r.get("acceptance_length")) + ("" if share is None else f" (drafted on {share:.0%} of steps)")


def _f3(v) -> str:
    return "–" if v is None else f"{v:.3f}"


NOT_LOSSLESS = "engine not lossless"
# How the report labels vLLM's 1 + accepted / drafts wherever it shows it.
PER_DRAFTED_STEP = "acceptance length per drafted step (vLLM's figure)"


def _shown(c: dict | None) -> str:
    if c is None or c.get("tokens_per_step") is None:
        return "–"
    return NOT_LOSSLESS if c.get("lossless") is False else f"{c['tokens_per_step']:.2f}"


def _pair(e: dict | None, n: dict | None) -> str:
    """EAGLE-3's figure with n-gram's in brackets; one "engine not lossless" where both fail."""
    if (e or {}).get("lossless") is False and (n or {}).get("lossless") is False:
        return NOT_LOSSLESS
    return f"{_shown(e)} (n-gram{':' if _shown(n) == NOT_LOSSLESS else ''} {_shown(n)})"


def acceptance_table(matrix: dict) -> pd.DataFrame:
    """Sets × temperatures: EAGLE-3's tokens per target step (n-gram's in brackets), the offline prediction's
    beside the T=0 column; a cell where the engine is not lossless says so instead of a number."""
    rows = []
    for s in matrix.get("sets") or []:
        row = {"set": s["name"], "prompts": s.get("prompts")}
        for t in matrix.get("temperatures") or []:
            e, n = _cell(matrix, "eagle3", s["name"], t), _cell(matrix, NGRAM, s["name"], t)
            row[f"T={t:g}"] = _pair(e, n)
            if t == 0:
                off = matrix.get("offline") or {}
                row["offline (T=0)"] = (f"{off['tokens_per_step']:.2f}" if s["name"] == off.get("set")
                                        and off.get("tokens_per_step") is not None else "–")
        rows.append(row)
    return pd.DataFrame(rows)


def cells_table(matrix: dict) -> pd.DataFrame:
    """Every cell with its tokens per target step, vLLM's acceptance length per drafted step beside it (so
    labelled), its speed-up, output tokens and the losslessness check, for the report."""
    df = cells_frame(matrix)
    if df.empty:
        return df
    df = df[["method", "set", "temperature", "tokens_per_step", "drafted_share", "acceptance_length", "speedup",
             "output_tokens", "output_tokens_per_s", "score", "score_difference", "lossless_p", "lossless"]].copy()
    df["tokens_per_step"] = [("not lossless: " if ok is False else "") + (f"{v:.3f}" if pd.notna(v) else "–")
                             for v, ok in zip(df["tokens_per_step"], df["lossless"])]
    df["lossless"] = df["lossless"].map({True: "yes", False: "NO"}).fillna("(reference)")
    return df.rename(columns={"tokens_per_step": "tokens per target step", "drafted_share": "share of steps drafted",
                              "acceptance_length": PER_DRAFTED_STEP})


def frame_html(df: pd.DataFrame) -> str:
    """A DataFrame as the report's plain table (numbers to 3 places, missing as –)."""
    return df.to_html(index=False, na_rep="–", float_format=lambda v: f"{v:.3f}", border=0, escape=True)


def acceptance_chart(matrix: dict) -> str:
    """Tokens per target step by set and temperature, EAGLE-3 and n-gram side by side (cells where the
    engine is not lossless drawn as no bar)."""
    cats, eagle, ngram = [], [], []
    for s in matrix.get("sets") or []:
        for t in matrix.get("temperatures") or []:
            cats.append(f"{s['name']} T={t:g}")
            for series, method in ((eagle, "eagle3"), (ngram, NGRAM)):
                c = _cell(matrix, method, s["name"], t)
                series.append(None if c is None or c.get("lossless") is False else c.get("tokens_per_step"))
    k = matrix.get("num_speculative_tokens") or 3
    return bar_chart(cats, [("EAGLE-3", eagle), ("n-gram", ngram)], title="Tokens per target step by set and temperature",
                     xlabel="evaluation set, temperature (no bar: engine not lossless there)",
                     ylabel="tokens per target step", ylim=(0, k + 1), width=max(560, 90 * len(cats) + 212))


def matrix_html(matrix: dict) -> str:
    temps = ", ".join(f"{t:g}" for t in matrix.get("temperatures") or [])
    return "\n".join([
        "<h2>Tokens per target step by evaluation set and temperature</h2>",
        frame_html(acceptance_table(matrix)),
        f'<p class="muted">EAGLE-3\'s tokens per target step in vLLM (n-gram\'s in brackets) at temperatures {esc(temps)}, '
        f'top_p {esc(matrix.get("top_p"))}, seed {esc(matrix.get("seed"))}, the same settings for the target alone. '
        "The offline prediction is computed at T=0 only (greedy chains), on the held-out set: it sits beside the "
        "T=0 column. At T&gt;0 every output is scored under the target (mean log-prob per token) and compared with "
        "the target alone's: a cell beyond the bound reads \"engine not lossless\" (its figures are in the table "
        "below, not as the draft's). Tokens per target step = (completion tokens − requests) / decode steps, every "
        "step counted; vLLM's acceptance length (1 + accepted / drafts) counts only the steps that drafted, which "
        "n-gram does on some steps only: it is in the table below, labelled per drafted step.</p>",
        f'<div class="plots">{acceptance_chart(matrix)}</div>',
        "<details><summary>Every cell (one request at a time; speed-up against the target alone at the same "
        "settings)</summary>",
        frame_html(cells_table(matrix)),
        "</details>",
    ])


def matrix_markdown(matrix: dict) -> list[str]:
    """The acceptance table as Markdown lines, for the model cards."""
    df = acceptance_table(matrix)
    if df.empty:
        return []
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join("–" if pd.isna(v) else str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return ["Tokens per target step by evaluation set and temperature (EAGLE-3, n-gram in brackets; offline at T=0 "
            "only; every decode step counted, not only those that drafted):",
            "", *lines, ""]
