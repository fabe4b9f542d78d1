"""The evaluation sets of validation: the held-out split, and the named sets of ``validate.datasets``.

Each named set loads through the training dataset's loader (``prompts.prepare_prompts``: a hub name or
a local file, any row shape it reads), as one shard with nothing held out, so a set's prompts are
what training would have read from the same source: deduplicated, shuffled by (seed, id) and cut at
``limit``. A row is sent as its first user turn (and the system turns before it); where its conversation
goes on, the next user turn rides along as ``second_turn`` (``second_turns.first_turn``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..errors import ValidationError
from ..data.prompts import prepare_prompts
from ..settings import PromptSettings
from .second_turns import first_turn

HELDOUT = "heldout"  # the held-out split's name in the matrix; always the first set
SET_DEFAULTS = {"split": "train", "subset": None, "limit": None, "seed": 0, "chat_template_kwargs": None,
                "columns": None}


def resolve_sets(datasets: list[dict] | None, heldout_path) -> list[dict]:
    """The sets of the matrix: the held-out split first, then ``validate.datasets`` with their defaults."""
    sets = [{"name": HELDOUT, "path": str(heldout_path), **SET_DEFAULTS}]
    for spec in datasets or []:
        s = {**SET_DEFAULTS, **spec}
        if s["name"] in {x["name"] for x in sets}:
            raise ValidationError(f"validate.datasets: the name {s['name']!r} is used twice (or is the held-out "
                                  f"split's, {HELDOUT!r}); give every evaluation set its own name")
        sets.append(s)
    return sets


def read_prompts(path) -> list[dict]:
    """The prompt rows of a prepare_prompts file, each cut at its first user turn (``second_turns.first_turn``)."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("messages"), list):
                raise ValidationError(f"{path}:{lineno}: a prompt row needs 'messages' (a list of chat turns)")
            rows.append(first_turn(row))
    if not rows:
        raise ValidationError(f"{path} holds no prompts: set dataset.heldout above 0")
    return rows


def load_set(spec: dict, cache_dir=None) -> list[dict]:
    """The prompts of one set (``{"id", "source", "messages"}`` rows)."""
    if spec["name"] == HELDOUT:
        return read_prompts(spec["path"])
    with tempfile.TemporaryDirectory(prefix="eaglenest-evalset-") as tmp:
        settings = PromptSettings.defaults().replace(path=spec["path"], shards=1, split=spec["split"],
                                                     limit=spec["limit"], heldout=0, seed=spec["seed"],
                                                     cache_dir=cache_dir, columns=spec["columns"] or {},
                                                     max_turns=2)  # a second user turn: validation's turn 2
        prepare_prompts(tmp, settings, subset=spec["subset"], progress=False,
                        columns_key=f"validate.datasets ({spec['name']}).columns")
        rows = read_prompts(Path(tmp) / "shard_0.jsonl")
    return rows
