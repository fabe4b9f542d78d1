"""The training sequences of trace records: the token ids the target's states are computed over, and the
spans of them that are scored: the assistant's own tokens, never a system, user or tool token.

A single-answer record (no ``turns``) gives one sequence, its prompt then its completion, the completion
scored. A conversation record (``turns``, see ``data.traces``: each turn's ``prompt_token_ids`` are the
server's, for the whole conversation so far) gives one sequence per chain of turns. Turn i+1 continues
turn i's chain when its prompt starts with turn i's prompt + completion, token for token: the chat
template re-rendered the earlier answer exactly as the target wrote it. A chain's sequence is its last
turn's prompt + completion, and the completion of every turn in it is scored. Where the template renders
an earlier answer otherwise (many drop the reasoning of past turns), turn i+1 starts a new chain. So every
assistant token is scored exactly once, in its own turn's chain, and only assistant tokens are.

``read_training_sequences`` reads them from trace files; a record that gives none is refused with its
file and line.
"""

from __future__ import annotations

import json

from ..errors import TraceRecordError

TOKEN_KEYS = ("prompt_token_ids", "completion_token_ids")


def answer_turns(record) -> list[tuple[list[int], list[int], bool]]:
    """``(prompt_token_ids, completion_token_ids, truncated)`` of each answer of ``record`` in order: its
    ``turns``, else the record itself. ``TraceRecordError`` says what is wrong."""
    if not isinstance(record, dict):
        raise TraceRecordError(f"a JSON {type(record).__name__}, not an object")
    turns = record.get("turns")
    if turns is None:
        return [_answer(record, "")]
    if not isinstance(turns, list) or not turns:
        raise TraceRecordError(f"'turns' is {json.dumps(turns)[:80]}, not a list of at least one turn")
    return [_answer(turn, f"turns[{i}].") for i, turn in enumerate(turns)]


def _answer(d, where):
    if not isinstance(d, dict):
        raise TraceRecordError(f"{where.rstrip('.')} is a JSON {type(d).__name__}, not an object")
    for key in TOKEN_KEYS:
        ids = d.get(key)
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            got = "missing" if key not in d else f"{json.dumps(ids)[:80]}"
            raise TraceRecordError(f"{where}{key} is {got}, not a list of token ids")
    return d["prompt_token_ids"], d["completion_token_ids"], bool(d.get("truncated"))


def untruncated(turns):
    """The answers before the first truncated one (``hidden.use_truncated`` / ``draft.use_truncated`` false)."""
    for i, (_, _, truncated) in enumerate(turns):
        if truncated:
            return turns[:i]
    return turns


def chains(turns) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """The sequences of ``turns`` (``answer_turns``), chained by the prefix property (module doc):
    ``[(input_ids, [(start, end) of each turn's completion in them]), ...]``."""
    out = []
    for prompt, completion, _ in turns:
        span = (len(prompt), len(prompt) + len(completion))
        if out and _continues(out[-1][0], prompt):
            out[-1] = (prompt + completion, out[-1][1] + [span])
        else:
            out.append((prompt + completion, [span]))
    return out


def _continues(previous, prompt):
    return len(prompt) >= len(previous) and prompt[: len(previous)] == previous


def training_sequences(record, use_truncated=True) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """The training sequences of one trace record: ``[(input_ids, spans)]``, ``spans`` the ``(start, end)``
    of every assistant answer inside ``input_ids`` (module doc). A record without ``turns`` gives
    ``[(prompt + completion, [(len(prompt), len(prompt) + len(completion))])]``. ``use_truncated`` false:
    answers from the first truncated one on are left out."""
    turns = answer_turns(record)
    return chains(turns if use_truncated else untruncated(turns))


def read_training_sequences(trace_paths, use_truncated=True, counts=None):
    """Yield ``(sequence id, input_ids, spans)`` of every training sequence with a scored token in the trace
    files ``trace_paths``, in file order. The id is the record's ``id`` (a conversation's: with the turns
    its chain holds, from 1).

    ``counts`` (a dict, optional) is updated with ``records``, ``answers`` (turns of conversations, one a
    single-answer record), ``skipped_truncated`` (answers left out as truncated) and ``skipped_empty``
    (sequences with nothing to score), so callers can report what was left out."""
    counts = counts if counts is not None else {}
    for key in ("records", "answers", "skipped_truncated", "skipped_empty"):
        counts.setdefault(key, 0)
    for path in trace_paths:
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                    turns = answer_turns(record)
                except (json.JSONDecodeError, TraceRecordError) as e:
                    raise TraceRecordError(
                        f"{where}: not a trace record with prompt_token_ids and completion_token_ids "
                        f"({type(e).__name__}: {e}); fix or remove that line, or delete the file to "
                        "generate its traces again") from None
                counts["records"] += 1
                counts["answers"] += len(turns)
                kept = turns if use_truncated else untruncated(turns)
                counts["skipped_truncated"] += len(turns) - len(kept)
                rid, first = record.get("id", where), 1
                for ids, spans in chains(kept):
                    sid = f"{rid} turns {first}-{first + len(spans) - 1}" if "turns" in record else rid
                    first += len(spans)
                    if all(start == end for start, end in spans):
                        counts["skipped_empty"] += 1
                        continue
                    yield sid, ids, spans
