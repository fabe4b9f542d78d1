"""Send a rule script's output to its Snakemake log, as its first act (STYLE.md)."""

from __future__ import annotations

import sys
from pathlib import Path


def to_log(path: str | Path) -> None:
    """Point stdout and stderr (progress bars included) at `path`, line-buffered."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a", buffering=1)
    sys.stdout = sys.stderr = handle
