"""One dataset row -> the messages of its prompt (and its tools, for a conversation), and its id.

Which column holds the question (a column of turns, or of plain text) and which the id is the
``dataset.columns`` setting (``find_columns``); each key left null is guessed from the column names
(COLUMNS; the id: a hash of the kept messages). Only the question is kept: the first user turn, and with
keep_system the system turns before it. A row of turns with more than one user turn, or with tool calls
(up to dataset.max_turns assistant turns), is a conversation (``conversation``): the user and tool turns
and an empty assistant slot for each answer (eaglenest.data.conversations regenerates it).
A row that gives no prompt raises RowError, its reason one of prompts.REASONS.
"""

from __future__ import annotations

import ast
import hashlib
import json
from typing import NamedTuple

from ..errors import PromptsError, RowError

# Columns that hold the question, in detection order: (column, kind).
COLUMNS = (
    ("conversations", "turns"),  # ShareGPT / open-perfectblend: [{"from", "value"}]
    ("conversation", "turns"),   # lmsys-chat style: same turns under a singular name
    ("messages", "turns"),       # OpenAI style: [{"role", "content"}]
    ("turns", "turns"),          # MT-Bench: the user's turns as plain strings
    ("prompt", "text"),
    ("question", "text"),
    ("instruction", "text"),     # Alpaca: an `input` column, when filled, is appended
    ("problem", "text"),         # MATH-500 and other competition-math sets
)
SYSTEM_COLUMNS = ("system", "system_prompt")  # keep_system for the plain text formats

# Role names seen in the wild, mapped to ours. Turns after the question only need a known role.
ROLES = {
    "user": "user", "human": "user",
    "system": "system", "developer": "system",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
    # ShareGPT's function calling (glaive, LLaMA-Factory): the assistant's call, its value {"name", "arguments"}
    # (or a list of them) as JSON; the result follows as an "observation" turn.
    "function_call": "assistant",
}


# ---------------------------------------------------------------------------------------------
# Which columns


class Columns(NamedTuple):
    """Where a dataset's rows hold what this stage reads."""

    column: str            # the column read: the question (kind text) or the whole conversation (kind turns)
    kind: str              # "turns": a list of turns (OpenAI messages or ShareGPT); "text": a plain string
    id: str | None = None  # the column of the rows' ids; None: a hash of the kept messages


# dataset.columns' keys that name the question's column, and the kind of column each names.
MAPPED_KINDS = {"question": "text", "conversation": "turns"}


def detect_format(columns) -> str | None:
    """The column that holds the question, or None when no known column is there."""
    columns = set(columns)
    return next((name for name, _ in COLUMNS if name in columns), None)


def find_columns(columns: list[str], mapping: dict | None, where: str, *, key: str = "dataset.columns",
                 sample=()) -> Columns:
    """The Columns of a dataset with these ``columns``: what ``mapping`` (dataset.columns, at ``key``) names,
    else the guesses (detect_format). PromptsError, its message headed by ``where`` (the dataset), when a
    mapped column is not there, question and conversation are both mapped, or no column holds a question;
    ``sample`` (a few rows) lets that message suggest a column of text."""
    mapping = {k: v for k, v in (mapping or {}).items() if v is not None}
    mapped = [k for k in MAPPED_KINDS if k in mapping]
    if len(mapped) > 1:
        raise PromptsError(f"{key}: question ({mapping['question']!r}) and conversation ({mapping['conversation']!r}) "
                           f"are both set; set one: question for a column of plain-text questions, conversation for "
                           f"a column of turns")
    for name, column in mapping.items():
        if column not in columns:
            raise PromptsError(f"{where}: {key}.{name} is {column!r}, which is not one of its columns {list(columns)}; "
                               f"set {key}.{name} to one of them (or null, to guess)")
    if mapped:
        return Columns(mapping[mapped[0]], MAPPED_KINDS[mapped[0]], mapping.get("id"))
    fmt = detect_format(columns)
    if fmt is None:
        hint = " (a .json file must hold an array of objects, or one object a line)" if list(columns) == ["data"] else ""
        raise PromptsError(
            f"{where}: no question column; found columns {list(columns)}{hint}. Set {key}.question: "
            f"{_text_column(columns, sample)} (the column of plain-text questions) or {key}.conversation "
            f"(a column of [{{role, content}}] or [{{from, value}}] turns); guessed without them: "
            f"{', '.join(name for name, _ in COLUMNS)}")
    return Columns(fmt, dict(COLUMNS)[fmt], mapping.get("id"))


def _text_column(columns, sample) -> str:
    """The column to suggest for dataset.columns.question: the first whose sampled values are text."""
    texts = [c for c in columns if any(isinstance(r, dict) and isinstance(r.get(c), str) and r[c].strip() for r in sample)]
    return next(iter(texts), "text" if "text" in columns else "<column>")


# ---------------------------------------------------------------------------------------------
# One row -> messages


def extract_messages(row: dict, keep_system: bool = False, *, fmt: str | None = None, kind: str | None = None) -> list[dict]:
    """The question of one row as [{"role": "system"|"user", "content": str}], user last.

    fmt is the question's column for the whole dataset (find_columns'), kind its kind ("turns" or
    "text"; None: COLUMNS' kind of fmt); without fmt the row's own keys decide. Raises RowError (reason
    in REASONS, never "duplicate"/"too_long") for a bad row.
    """
    if not isinstance(row, dict):
        raise RowError("malformed", f"row is a {type(row).__name__}, not an object")
    fmt = fmt or detect_format(row)
    if fmt is None:
        raise RowError("malformed", f"none of the columns {sorted(row)} holds a question")
    kind = kind or dict(COLUMNS)[fmt]
    if kind == "turns":
        return _from_turns(row.get(fmt), fmt, keep_system)
    return _from_text(row, fmt, keep_system)


def row_id(row: dict, column: str) -> str:
    """A row's id from its id column (dataset.columns.id): a string or an integer, as text."""
    value = row.get(column)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RowError("empty", f"id column {column!r} is empty")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowError("malformed", f"id column {column!r} holds a {type(value).__name__}, not a string or an integer")
    return str(value)


def _from_turns(turns, column: str, keep_system: bool) -> list[dict]:
    if isinstance(turns, str):
        turns = _parse_list(turns)  # a CSV cell can only hold the turns as text
    if not isinstance(turns, list):
        raise RowError("malformed", f"{column} is a {type(turns).__name__}, not a list of turns")
    system, question = [], None
    for i, turn in enumerate(turns):
        if isinstance(turn, str) and column == "turns":
            turn = {"role": "user", "content": turn}  # MT-Bench's turns: what the user says, in order
        if not isinstance(turn, dict):
            raise RowError("malformed", f"{column}[{i}] is a {type(turn).__name__}, not an object")
        # ShareGPT spells a turn {from, value}, OpenAI {role, content}; accept either in either column.
        role_key, text_key = ("from", "value") if "from" in turn else ("role", "content")
        if role_key not in turn:
            raise RowError("malformed", f"{column}[{i}] has neither 'from' nor 'role' (keys {sorted(turn)})")
        raw_role = turn[role_key]
        role = ROLES.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise RowError("malformed", f"{column}[{i}] has unknown role {raw_role!r}")
        if question is not None:
            continue  # after the question only the structure is checked
        if role in ("assistant", "tool"):
            raise RowError("malformed", f"{column}[{i}] is a {raw_role!r} turn before any user turn")
        if text_key not in turn:
            raise RowError("malformed", f"{column}[{i}] has no {text_key!r} (keys {sorted(turn)})")
        text = turn[text_key]
        if not isinstance(text, str):
            raise RowError("non_string", f"{column}[{i}].{text_key} is a {type(text).__name__}, not a string")
        if role == "system":
            if text.strip():  # a blank system prompt is the same as none
                system.append({"role": "system", "content": text})
        elif not text.strip():
            raise RowError("empty", f"{column}[{i}] is a blank user turn")
        else:
            question = {"role": "user", "content": text}
    if question is None:
        raise RowError("empty", f"{column} has no user turn")
    return (system if keep_system else []) + [question]


def _parse_list(text: str):
    """Turns written into a text cell: JSON, or the Python repr that pandas' to_csv writes."""
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return text


def conversation(row: dict, column: str, keep_system: bool, max_turns: int) -> tuple[list[dict], list | None, int]:
    """(messages, tools, user turns dropped) of a row of turns (``column``) as a conversation to regenerate:
    its system (with keep_system), user and tool turns, with an assistant slot for each answer, at most
    ``max_turns``: {"role": "assistant"}, plus the data's "tool_calls" where it called tools (the target's
    calls are checked against them). A user turn or tool result the data left unanswered gets a slot too.
    ``tools``: the row's "tools" column (an OpenAI tools list), or None. RowError for a turn that does not fit
    a conversation (a tool result after no assistant turn, two assistant turns in a row)."""
    turns = row.get(column)
    if isinstance(turns, str):
        turns = _parse_list(turns)
    tools = _tools(row)
    messages: list[dict] = []
    slots = dropped = 0
    started = False  # past the first user turn
    for i, turn in enumerate(turns):
        role, text, turn = _turn(turn, column, i)
        if not started and role != "user":
            if role == "system" and keep_system and isinstance(text, str) and text.strip():
                messages.append({"role": "system", "content": text})
            continue  # _from_turns has checked what comes before the question
        started = True
        last = messages[-1]["role"] if messages else None
        if slots == max_turns:
            dropped += role == "user"
            continue
        if role == "user":
            if not isinstance(text, str) or not text.strip():
                dropped += 1  # a blank or odd user turn ends what can be asked
                slots = max_turns
                continue
            if last in ("user", "tool"):
                messages.append({"role": "assistant"})  # the data answered nothing here: the target does
                slots += 1
                if slots == max_turns:
                    dropped += 1
                    continue
            messages.append({"role": "user", "content": text})
        elif role == "assistant":
            if last == "assistant":
                raise RowError("malformed", f"{column}[{i}] is a second assistant turn in a row")
            slot = {"role": "assistant"}
            if turn.get("tool_calls"):
                slot["tool_calls"] = _without_nulls(turn["tool_calls"])
            messages.append(slot)
            slots += 1
        elif role == "tool":
            if last not in ("assistant", "tool"):
                raise RowError("malformed", f"{column}[{i}] is a tool result after a {last} turn, not after an assistant's call")
            if not isinstance(text, str):
                raise RowError("non_string", f"{column}[{i}] is a tool result of a {type(text).__name__}, not a string")
            result = {"role": "tool", "content": text}
            result.update({k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)})
            messages.append(result)
        elif keep_system and isinstance(text, str) and text.strip():
            messages.append({"role": "system", "content": text})
    while messages and messages[-1]["role"] == "tool" and slots == max_turns:
        messages.pop()  # the results of the last call kept: nothing is asked after them
    if messages and messages[-1]["role"] in ("user", "tool", "system"):
        if slots < max_turns:
            messages.append({"role": "assistant"})
        else:
            dropped += messages.pop()["role"] == "user"
    return messages, tools, dropped


def asks_turns(messages: list[dict], tools) -> bool:
    """Whether ``conversation``'s messages ask more than a single question would (several slots, tool calls
    or tools): then they are the record's; else the question alone is (conversations.is_conversation reads
    the record)."""
    return bool(tools) or sum(m["role"] == "assistant" for m in messages) > 1 \
        or any("tool_calls" in m for m in messages)


def _turn(turn, column: str, i: int) -> tuple[str, object, dict]:
    """(role, text, the turn as an object) of a turn _from_turns has checked the structure of; a ShareGPT
    function_call turn is an assistant turn with its calls as OpenAI ``tool_calls``."""
    if isinstance(turn, str):
        return "user", turn, {"role": "user", "content": turn}
    role_key, text_key = ("from", "value") if "from" in turn else ("role", "content")
    if turn[role_key].strip().lower() == "function_call":
        return "assistant", None, {"tool_calls": _sharegpt_calls(turn.get(text_key), column, i)}
    return ROLES[turn[role_key].strip().lower()], turn.get(text_key), turn


def _sharegpt_calls(value, column: str, i: int) -> list[dict]:
    """OpenAI ``tool_calls`` of a ShareGPT function_call turn's value: {"name", "arguments"} or a list of them,
    as JSON text or as objects. RowError where it is neither."""
    calls = _parse_list(value) if isinstance(value, str) else value
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise RowError("malformed", f"{column}[{i}] is a function_call turn whose value is not a call "
                                    f'{{"name", "arguments"}} (or a list of them) in JSON: {str(value)[:80]!r}')
    return [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(
        c.get("arguments"), str) else json.dumps(c.get("arguments") or {})}} for c in calls]


def _tools(row: dict):
    """The row's OpenAI tools list (a "tools" column, or its JSON text), or None. A bare function ({"name",
    "description", "parameters"}, as ShareGPT function-calling sets write them) is wrapped as OpenAI's tool."""
    tools = row.get("tools")
    if isinstance(tools, str):
        tools = _parse_list(tools)
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RowError("malformed", f"tools is a {type(tools).__name__}, not a list of tool objects")
    tools = [{"type": "function", "function": t} if "function" not in t and "name" in t else t for t in tools]
    return _without_nulls(tools)


def _without_nulls(value):
    """Tools and tool calls without null members: a table (parquet, datasets' Arrow) gives every object of a
    column all the keys any has, the missing ones null, and a JSON schema has no null members."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _from_text(row: dict, column: str, keep_system: bool) -> list[dict]:
    text = row.get(column)
    if text is None:  # how CSV and parquet spell an empty cell
        raise RowError("empty", f"{column} is empty")
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        text = text[0]  # the turns of a multi-turn benchmark (MT-Bench's prompt column): the first is the question
    if not isinstance(text, str):
        raise RowError("non_string", f"{column} is a {type(text).__name__}, not a string")
    if not text.strip():
        raise RowError("empty", f"{column} is blank")
    extra = row.get("input") if column == "instruction" else None
    if isinstance(extra, str) and extra.strip():
        text = f"{text}\n\n{extra}"
    messages = [{"role": "user", "content": text}]
    if keep_system:
        system = next((row[c] for c in SYSTEM_COLUMNS if isinstance(row.get(c), str)), "")
        if system.strip():
            messages.insert(0, {"role": "system", "content": system})
    return messages


def prompt_id(messages: list[dict], tools: list | None = None) -> str:
    """16 hex digits of sha256 over the canonical JSON of the kept messages (and the tools, when there are)."""
    kept = {"messages": messages, "tools": tools} if tools else messages
    canonical = json.dumps(kept, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
