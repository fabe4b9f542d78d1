"""Conversations regenerated turn by turn: the target answers each assistant slot of a prompt record
(``messages.conversation``) given the conversation so far with its own earlier answers.

A conversation's prompt record holds the data's system, user and tool turns and an assistant slot for
each answer ({"role": "assistant"}, with the data's "tool_calls" where the data called tools). Turn k's
request carries the messages before slot k in which slots 0..k-1 hold the target's own answers (content,
reasoning as "reasoning_content", tool calls) and the data's tool results answer the target's calls (their
tool_call_id the target's); the record's "tools" go with every request.

A conversation ends (the record's "ended") when every slot is answered ("done"), at dataset.max_turns
("max_turns"), when a turn's answer is cut at max_tokens ("truncated"), when the data's tool results do
not fit the target's answer: it called no tool, or other functions, where the data has results, or called a
tool where the data goes on without one ("tool_mismatch"), or when the next turn does not fit the context:
the server refuses it as too long, or its prompt plus max_tokens passes dataset.max_context_tokens
("context"; that turn is not kept). The first turn is asked as a single question is: a refusal is an error.

Resuming: each answered turn is appended to the shard's partial file as a turn line ({"turn_of": id,
"turn": k, ...}) before the next is asked, and the record once the conversation ends; which turn comes
next, or why the conversation ends, is a function of the prompt and the turns so far (``ending``,
``request_messages``), so a rerun continues at the next turn: none asked twice, none lost.
"""
from __future__ import annotations

import re

ENDINGS = ("done", "max_turns", "context", "tool_mismatch", "truncated")
# The keys of a turn in a trace record (the contract's; a turn line adds latency_s, server, attempts).
TURN_KEYS = ("prompt_token_ids", "completion_token_ids", "reasoning", "content", "tool_calls", "finish_reason",
             "truncated", "usage")
# How vLLM says a prompt is longer than the model's context (an HTTP 400's body).
TOO_LONG = re.compile(r"context length|max_model_len|maximum model length|too long", re.IGNORECASE)


def is_conversation(prompt: dict) -> bool:
    """Whether a prompt record is a conversation's (messages.conversation) rather than a single question's."""
    return bool(prompt.get("tools")) or any(is_slot(m) for m in prompt["messages"])


def is_slot(message: dict) -> bool:
    """An assistant turn the target answers: one without content. An assistant turn with content is a fixed
    part of the conversation (validation's turn 2 carries the target alone's own first answer so)."""
    return message["role"] == "assistant" and "content" not in message


def slots(messages: list[dict]) -> list[int]:
    """The indexes of the assistant slots in a conversation's messages."""
    return [i for i, m in enumerate(messages) if is_slot(m)]


def assistant_message(turn: dict) -> dict:
    """The target's answer of one turn as the next requests carry it: content, reasoning_content (the name
    vLLM before 0.10 and SGLang read; vLLM 0.10+ takes it as "reasoning"), tool_calls."""
    message = {"role": "assistant", "content": turn["content"]}
    if turn["reasoning"]:
        message["reasoning_content"] = turn["reasoning"]
    if turn["tool_calls"]:
        message["tool_calls"] = turn["tool_calls"]
    return message


def regenerated(prompt: dict, turns: list[dict]) -> list[dict]:
    """The conversation with the target's ``turns`` in its first slots, up to (not including) the first slot
    not answered: the data's tool results answer the target's calls, by the data's call id, else in order."""
    out, answered, ids, calls, n_results = [], 0, {}, [], 0
    for m in prompt["messages"]:
        if is_slot(m):
            if answered == len(turns):
                break
            turn = turns[answered]
            answered += 1
            out.append(assistant_message(turn))
            calls = [c.get("id") for c in turn["tool_calls"] or []]
            ids = dict(zip((c.get("id") for c in m.get("tool_calls") or []), calls))
            n_results = 0
        elif m["role"] == "tool":
            target = ids.get(m.get("tool_call_id")) or (calls[n_results] if n_results < len(calls) else None)
            n_results += 1
            out.append({**m, "tool_call_id": target} if target else dict(m))
        else:
            out.append(m)
    return out


def request_messages(prompt: dict, turns: list[dict]) -> list[dict]:
    """The messages of the next turn's request (the conversation before slot len(turns))."""
    return regenerated(prompt, turns)


def _names(calls) -> list:
    return [(c.get("function") or {}).get("name") for c in calls or []]


def ending(prompt: dict, turns: list[dict], max_turns: int) -> str | None:
    """Why the conversation ends after ``turns`` (one of ENDINGS but "context"), or None: ask the next turn."""
    messages = prompt["messages"]
    where = slots(messages)
    k = len(turns)
    if k:
        last = turns[-1]
        if last["truncated"]:
            return "truncated"
        stop = where[k] if k < len(where) else len(messages)
        results = [m for m in messages[where[k - 1] + 1:stop] if m["role"] == "tool"]
        called, expected = _names(last["tool_calls"]), _names(messages[where[k - 1]].get("tool_calls"))
        if results:
            if not called or (called != expected if expected else len(called) < len(results)):
                return "tool_mismatch"
        elif called and k < len(where):
            return "tool_mismatch"  # the target called a tool where the data goes on without its result
    if k == len(where):
        return "done"
    if k >= max_turns:
        return "max_turns"
    return None


def turn_of(answer: dict, choice: dict, reasoning) -> dict:
    """One turn (TURN_KEYS) from a server's chat answer (``choice``: its first choice)."""
    message = choice["message"]
    finish_reason = choice.get("finish_reason")
    return {"prompt_token_ids": answer["prompt_token_ids"], "completion_token_ids": choice["token_ids"],
            "reasoning": reasoning, "content": message.get("content"), "tool_calls": message.get("tool_calls") or None,
            "finish_reason": finish_reason, "truncated": finish_reason == "length", "usage": answer.get("usage")}


def over_context(turn: dict, k: int, max_tokens: int, max_context_tokens: int | None) -> bool:
    """Whether turn ``k`` (from 0) passes max_context_tokens: its prompt plus max_tokens (the first turn never)."""
    return bool(k and max_context_tokens is not None
                and len(turn["prompt_token_ids"]) + max_tokens > max_context_tokens)


def record(prompt: dict, turns: list[dict], ended: str, lines: list[dict]) -> dict:
    """The trace record of a finished conversation: the last turn's fields at the top (a reader that knows
    no turns gets one token-exact sequence), the conversation as regenerated, every turn, why it ended and
    the data's user turns left unanswered. ``lines``: the turn lines (their latency, server, attempts)."""
    last = turns[-1]
    messages = regenerated(prompt, turns)
    answered = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    data_stop = slots(prompt["messages"])[len(turns) - 1]
    out = {"id": prompt["id"], "source": prompt.get("source"), "messages": messages[:answered + 1]}
    if prompt.get("tools"):
        out["tools"] = prompt["tools"]
    out.update({k: last[k] for k in ("reasoning", "content", "finish_reason", "truncated", "prompt_token_ids",
                                     "completion_token_ids", "usage")})
    out.update({
        "latency_s": round(sum(line["latency_s"] for line in lines), 4),
        "server": lines[-1]["server"],
        "attempts": sum(line["attempts"] for line in lines),
        "turns": turns,
        "ended": ended,
        "turns_dropped": sum(m["role"] == "user" for m in prompt["messages"][data_stop + 1:]),
    })
    return out


def turn_line(prompt_id: str, k: int, turn: dict, latency: float, server: str, attempts: int) -> dict:
    """What the partial file keeps of an answered turn (``PartialFile.append_turn``)."""
    return {"turn_of": prompt_id, "turn": k, **turn, "latency_s": round(latency, 4), "server": server,
            "attempts": attempts}


def turns_of(lines: list[dict]) -> tuple[list[dict], list[dict]]:
    """(turns, their lines) from a conversation's turn lines in the partial file: turn 0, 1, ... up to the
    first missing (a later line of a turn already read is ignored)."""
    by_turn = {}
    for line in lines:
        by_turn.setdefault(line["turn"], line)
    kept = []
    while len(kept) in by_turn:
        kept.append(by_turn[len(kept)])
    return [{k: line[k] for k in TURN_KEYS} for line in kept], kept


async def converse(run, prompt: dict, lines: list[dict]):
    """Answer a conversation's remaining turns on ``run`` (traces._ShardRun: its ``post``, ``parse``,
    partial file and stats; its settings' limits), from the turn lines resumed (``lines``); append the
    record once it ends."""
    turns, lines = turns_of(lines)
    settings = run.settings
    while True:
        ended = ending(prompt, turns, settings.max_turns)
        if ended is not None:
            break
        k = len(turns)
        got = await run.post(prompt["id"], run.body(request_messages(prompt, turns), prompt.get("tools")),
                             refused=(lambda status, body: k > 0 and status == 400 and TOO_LONG.search(body)))
        if got is None:
            return  # failed (counted in the errors) or stopping: the rerun resumes at this turn
        if got == "refused":
            ended = "context"
            break
        raw, server, latency, attempt = got
        parsed = run.parse(prompt["id"], raw, server, attempt)
        if parsed is None:
            return
        turn = turn_of(*parsed)
        if over_context(turn, k, settings.max_tokens, settings.max_context_tokens):
            ended = "context"
            break
        line = turn_line(prompt["id"], k, turn, latency, server.url, attempt)
        run.partial.append_turn(line)
        run.stats.answered(latency, len(turn["completion_token_ids"]))
        server.answered += 1
        run.first_success = True
        turns.append(turn)
        lines.append(line)
    if not turns:  # the first turn never fit: nothing to keep (the first turn's refusal is an error instead)
        return
    run.keep(record(prompt, turns, ended, lines))
