"""The validation section of a draft's model card: the report is made after the export, so
``validate_draft`` adds its acceptance figures (and the matrix) to each exported draft's README.md,
after ``VALIDATION_MARK``; a later validation replaces them. Methods are compared by tokens per target
step; vLLM's per-drafted-step acceptance length is shown beside it, so labelled."""

import os
from pathlib import Path

from .matrix import PER_DRAFTED_STEP

# Where validate_draft puts the acceptance figures in a card (everything after it is replaced).
VALIDATION_MARK = "<!-- eaglenest: validation -->"


def write_validation(draft_dir, report: dict, fmt: str, matrix_lines=()) -> None:
    """Put the validation report's acceptance figures into a draft's card (replacing earlier ones), followed by
    ``matrix_lines``: the matrix as Markdown, which validation renders (validation.matrix.matrix_markdown)."""
    path = Path(draft_dir) / "README.md"
    text = path.read_text().split(VALIDATION_MARK)[0].rstrip() + "\n"
    run = (report.get("formats") or {}).get(fmt) or report.get("eagle3") or {}
    off, base, ngram = (report.get(key) or {} for key in ("offline", "baseline", "ngram"))
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    one = ratio((run.get("one_request") or {}).get("output_tokens_per_s"),
                (base.get("one_request") or {}).get("output_tokens_per_s"))
    speed = ratio(run.get("output_tokens_per_s"), base.get("output_tokens_per_s"))
    concurrency = (report.get("settings") or {}).get("concurrency")
    f3 = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    fx = lambda v: "–" if v is None else f"×{v:.2f}"  # noqa: E731
    pct = lambda v: "–" if v is None else f"{v:.0%}"  # noqa: E731
    lines = [
        VALIDATION_MARK, "", "## Validation (eaglenest)", "",
        f"{report.get('prompts')} held-out prompts, greedy, k = {report.get('num_speculative_tokens')}, "
        f"max_tokens {report.get('max_tokens')}, {report.get('created', '')}.", "",
        "| | |", "|---|---|",
        f"| tokens per target step in vLLM (the target alone: 1) | {f3(run.get('tokens_per_step'))} |",
        f"| offline prediction, tokens per target step | {f3(off.get('tokens_per_step'))} |",
        f"| n-gram speculation in vLLM, tokens per target step | {f3(ngram.get('tokens_per_step'))} |",
        f"| {PER_DRAFTED_STEP}: this draft, n-gram | {f3(run.get('acceptance_length'))}, "
        f"{f3(ngram.get('acceptance_length'))} (n-gram drafted on {pct(ngram.get('drafted_share'))} of steps) |",
        f"| per-position acceptance (per drafted step) | {', '.join(f3(p) for p in run.get('per_position') or []) or '–'} |",
        f"| output tokens/s over the target alone, one request at a time | {fx(one)} |",
        f"| output tokens/s over the target alone, {concurrency or 'several'} requests in flight | {fx(speed)} |",
        "",
    ]
    lines += list(matrix_lines)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text + "\n" + "\n".join(lines))
    os.replace(tmp, path)
