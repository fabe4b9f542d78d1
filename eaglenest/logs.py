"""A rule script's first act: send its output to the rule's Snakemake log (docs/dag.md), and make a
user error one message there instead of a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import EaglenestError


def to_log(path: str | Path) -> None:
    """Point stdout and stderr (progress lines included) at `path`, line-buffered; from then on an
    uncaught EaglenestError ends the script with its message and exit status 1 (a bug still shows
    its traceback)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a", buffering=1)
    sys.stdout = sys.stderr = handle
    sys.excepthook = _user_errors_as_one_message


def _user_errors_as_one_message(kind, error, tb) -> None:
    if isinstance(error, EaglenestError):
        print(f"error: {error}", file=sys.stderr, flush=True)  # the interpreter then exits with 1
    else:
        sys.__excepthook__(kind, error, tb)
