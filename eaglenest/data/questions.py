"""Training questions the target writes itself (Magpie), for users with no dataset that matches their traffic.

The prompt is the chat template's text up to where a user's words would start (the user prefix: for
SmolLM2 its default system turn and ``<|im_start|>user\\n``), sent as token ids to the trace server's
completions endpoint and sampled, stopping at the token the template puts after a user's words. The model
writes what a user would ask and ends the turn; that text is a question. Request ``i`` samples with seed ``seed * 1_000_003 + i``, so a rerun asks the same.

Kept: questions the model ended itself (finish_reason ``stop``), at least ``min_chars`` long, not seen
before (after whitespace folding), and not one of the ``exclude`` texts (the evaluation sets' questions).
Each answer is appended to ``<output>.partial`` as it arrives, so a crash loses at most the requests in
flight; a rerun sends only the requests not yet answered. ``ATTEMPTS_PER_QUESTION`` bounds the requests
when the model repeats itself.

Conversations (``turns`` above 1): once the distinct first questions are written, each conversation goes on
turn by turn. The target answers the conversation so far (the chat endpoint, at generation's sampling: the
answer the traces stage would give), then the next user turn is sampled the same Magpie way, from the
template's text up to where the user's next words would start after that conversation. A follow-up the model
did not end itself, shorter than ``min_chars`` or an evaluation set's is dropped and counted, and its
conversation ends there. A row is then OpenAI ``messages`` of user turns with the answers between them, the
last turn a user's (prepare_prompts keeps the user turns; the traces stage answers them again). Each answer
and follow-up goes to the same ``.partial`` file, so a rerun asks only what is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from ..errors import TracesError
from ..settings import QuestionSettings
from ..serving.client import CONNECTION_ERRORS, RETRY_STATUSES, RetryPolicy, auth_hint, describe_client_error, \
    open_session, run_workers
from ..util import progress_bar, say, write_atomic

ATTEMPTS_PER_QUESTION = 3  # requests sent at most per question asked for
SENTINEL = "\u2063EAGLENEST-QUESTION\u2063"  # stands for the user's words while the template is rendered


def user_turn(tokenizer, history: list[dict] = ()) -> tuple[str, list[int]]:
    """(prefix, stop ids): the chat template's text before a user's message (system turns the template adds
    included) after the conversation ``history`` (none: the first message), and the token that ends a user's
    message there (``<|im_end|>`` in ChatML, ``<|eot_id|>`` in Llama 3, the assistant's marker where the
    template has no end-of-turn token)."""
    if not tokenizer.chat_template:
        raise TracesError("dataset.generate: the target's tokenizer has no chat template, so there is no user "
                          "turn to sample; set dataset.path to a dataset instead")
    text = tokenizer.apply_chat_template([*history, {"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=True)
    if SENTINEL not in text:
        raise TracesError("dataset.generate: the target's chat template drops the user's words; set dataset.path")
    prefix, suffix = text.split(SENTINEL, 1)
    stop = tokenizer.encode(suffix.lstrip(), add_special_tokens=False)[:1]
    return prefix, stop


def fold(text: str) -> str:
    """A question's identity for de-duplication and exclusion: words, lower case, single spaces."""
    return " ".join(text.lower().split())


def write_questions(output, settings: QuestionSettings | None = None, *, url, model, tokenizer, exclude=(),
                    api_key=None, progress=True) -> dict:
    """Write ``settings.questions`` distinct questions by the target at ``url`` to ``output`` (JSON lines of
    ``{"id", "source", "messages"}``, prepare_prompts' format), each the start of a conversation of up to
    ``settings.turns`` user turns; return the statistics. ``settings``: the sampling, the client's concurrency,
    timeout and retries (None: the schema's defaults)."""
    s = settings or QuestionSettings.defaults()
    questions, max_tokens, temperature, top_p, min_chars, seed = \
        s.questions, s.max_tokens, s.temperature, s.top_p, s.min_chars, s.seed
    client = _Client(url, api_key, s.concurrency, s.request_timeout, RetryPolicy.from_settings(s))
    output = Path(output)
    partial = output.with_name(output.name + ".partial")
    prefix, stop_ids = user_turn(tokenizer)
    prompt_ids = tokenizer.encode(prefix, add_special_tokens=False)
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
            "top_p": top_p, "n": 1, "stop_token_ids": stop_ids}
    answers, later = _read_partial(partial)
    excluded = {fold(t) for t in exclude}
    budget = ATTEMPTS_PER_QUESTION * questions

    def kept():
        seen, rows, drops = set(), [], {"cut": 0, "short": 0, "duplicate": 0, "in_eval_set": 0}
        for i in sorted(answers):
            text, finish = answers[i]["text"].strip(), answers[i]["finish_reason"]
            key = fold(text)
            reason = _drop_reason(text, finish, min_chars, excluded) or ("duplicate" if key in seen else None)
            if reason:
                drops[reason] += 1
                continue
            seen.add(key)
            rows.append({"id": f"q{i}", "source": "target", "messages": [{"role": "user", "content": text}]})
        return rows, drops

    if answers:
        say(f"questions: {len(answers)} answers from an earlier attempt in {partial}")
    next_i = max(answers, default=-1) + 1
    bar = progress_bar(total=max(questions, len(answers)), desc="questions", unit="request", initial=len(answers),
                       disable=not progress)
    with open(partial, "a", encoding="utf-8") as sink:
        def keep(i, reply):
            choice = reply["choices"][0]
            answers[i] = {"i": i, "text": choice["text"], "finish_reason": choice["finish_reason"]}
            _append(sink, answers[i])
            bar.update(1)

        while (missing := questions - len(kept()[0])) > 0 and next_i < budget:
            todo = range(next_i, min(budget, next_i + missing))
            next_i = todo.stop
            bar.total = max(bar.total, len(answers) + len(todo))
            client.send("/v1/completions", [(i, {**body, "seed": seed * 1_000_003 + i}) for i in todo], keep)
        bar.close()
        rows, drops = kept()
        rows = rows[:questions]
        if s.turns > 1:
            follow = _follow_up(rows, later, sink, s, client, model=model, tokenizer=tokenizer, excluded=excluded,
                                progress=progress)
    write_atomic(output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.unlink(partial)
    stats = {"questions": len(rows), "asked_for": questions, "requests": len(answers), "dropped": drops,
             "prefix_tokens": len(prompt_ids), "max_tokens": max_tokens, "temperature": temperature}
    if s.turns > 1:
        stats["follow_ups"] = follow
    write_atomic(output.with_name(output.stem + ".stats.json"), stats)
    dropped = ", ".join(f"{n} {r}" for r, n in drops.items() if n)
    say(f"questions: {len(rows)} of {questions} written to {output} from {len(answers)} requests"
        f"{f' ({dropped} dropped)' if dropped else ''}" + (f"; {_said(follow)}" if s.turns > 1 else ""))
    if len(rows) < questions:
        say(f"questions: only {len(rows)} distinct questions after {budget} requests: the target repeats itself; "
            f"raise dataset.generate.temperature or lower dataset.generate.questions")
    if not rows:
        raise TracesError(f"dataset.generate: the target at {url} wrote no usable question in {len(answers)} "
                          f"requests ({dropped}); check its chat template and dataset.generate.max_tokens")
    return stats


def _drop_reason(text: str, finish: str, min_chars: int, excluded: set) -> str | None:
    """Why a user turn the target wrote is not kept (None: kept): cut at max_tokens, too short, an evaluation set's."""
    return ("cut" if finish != "stop" else "short" if len(text) < min_chars else
            "in_eval_set" if fold(text) in excluded else None)


def _follow_up(rows: list[dict], later: dict, sink, s: QuestionSettings, client, *, model, tokenizer, excluded,
               progress) -> dict:
    """Extend each row's ``messages`` (in place) turn by turn up to ``s.turns`` user turns: the target's answer
    to the conversation so far, then a follow-up question sampled after it (module docstring). ``later``: the
    answers and follow-ups of an earlier attempt, ``{(i, turn, role): {"text", "finish_reason"}}``; what is
    sent is added to it and to ``sink``. Returns the follow-ups' statistics."""
    drops = {"cut": 0, "short": 0, "in_eval_set": 0}
    requests = 0
    by_i = {int(r["id"][1:]): r for r in rows}
    open_ = dict(by_i)  # the conversations still going on

    def seed_of(i, step):  # step 1, 2, ...: the answer to turn 1, the question of turn 2, ...; apart from turn 1's seeds
        return (s.seed * 1_000_003 + i) * 2 * s.turns + step

    def store(turn, role):
        def keep(i, reply):
            choice = reply["choices"][0]
            text = (choice["message"].get("content") or "") if role == "assistant" else choice["text"]
            later[(i, turn, role)] = {"text": text, "finish_reason": choice["finish_reason"]}
            _append(sink, {"i": i, "turn": turn, "role": role, **later[(i, turn, role)]})
            bar.update(1)
        return keep

    bar = progress_bar(total=2 * len(rows) * (s.turns - 1), desc="follow-ups", unit="request", disable=not progress)
    for turn in range(2, s.turns + 1):
        # The target answers turn - 1, as the traces stage would (chat endpoint, generation's sampling) ...
        asked = {i: {"model": model, "messages": r["messages"], "max_tokens": s.answer_max_tokens,
                     "temperature": s.answer_temperature, "top_p": s.answer_top_p, "seed": seed_of(i, 2 * turn - 3)}
                 for i, r in open_.items() if (i, turn - 1, "assistant") not in later}
        requests += len(asked)
        client.send("/v1/chat/completions", list(asked.items()), store(turn - 1, "assistant"))
        for i, r in open_.items():
            r["messages"].append({"role": "assistant", "content": later[(i, turn - 1, "assistant")]["text"]})
        # ... and writes what the user says next, from the template's user prefix after that conversation.
        asked = {}
        for i, r in open_.items():
            if (i, turn, "user") not in later:
                prefix, stop_ids = user_turn(tokenizer, r["messages"])
                asked[i] = {"model": model, "prompt": tokenizer.encode(prefix, add_special_tokens=False),
                            "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "n": 1,
                            "stop_token_ids": stop_ids, "seed": seed_of(i, 2 * turn - 2)}
        requests += len(asked)
        client.send("/v1/completions", list(asked.items()), store(turn, "user"))
        for i, r in list(open_.items()):
            asked_text = later[(i, turn, "user")]
            text = asked_text["text"].strip()
            reason = _drop_reason(text, asked_text["finish_reason"], s.min_chars, excluded)
            if reason:
                drops[reason] += 1
                r["messages"].pop()  # the conversation ends on its last user turn
                del open_[i]
            else:
                r["messages"].append({"role": "user", "content": text})
    bar.close()
    lengths = [sum(m["role"] == "user" for m in r["messages"]) for r in rows]
    return {"turns": s.turns, "requests": requests, "dropped": drops,
            "conversations": {str(n): lengths.count(n) for n in range(1, s.turns + 1)},
            "answer_max_tokens": s.answer_max_tokens, "answer_temperature": s.answer_temperature}


def _said(follow: dict) -> str:
    """The follow-ups in words, for the summary line."""
    dropped = ", ".join(f"{n} {r}" for r, n in follow["dropped"].items() if n)
    return ("conversations by user turns " + ", ".join(f"{n}: {c}" for n, c in follow["conversations"].items())
            + f" from {follow['requests']} more requests" + (f" ({dropped} follow-ups dropped)" if dropped else ""))


def _append(sink, record: dict) -> None:
    sink.write(json.dumps(record, ensure_ascii=False) + "\n")
    sink.flush()


def _read_partial(path: Path) -> tuple[dict, dict]:
    """(the first questions' answers by request ``i``, the conversations' later answers and follow-ups by
    ``(i, turn, role)``) an earlier attempt left in ``path``."""
    answers, later = {}, {}
    if path.exists():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    a = json.loads(line)
                    if "turn" in a:
                        later[(int(a["i"]), int(a["turn"]), a["role"])] = {"text": a["text"],
                                                                            "finish_reason": a["finish_reason"]}
                    else:
                        answers[int(a["i"])] = a
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash: that request is sent again
    return answers, later


class _Client:
    """The writer's requests to the trace server: each job's body POSTed with the stage's concurrency, timeout
    and retries; TracesError naming the request and the endpoint when one fails for good."""

    def __init__(self, url, api_key, concurrency, request_timeout, retry):
        self.url, self.api_key, self.concurrency, self.request_timeout, self.retry = \
            url.rstrip("/"), api_key, concurrency, request_timeout, retry

    def send(self, path: str, jobs: list[tuple], on_reply) -> None:
        """POST each ``(i, body)`` of ``jobs`` to ``path``; ``on_reply(i, parsed response)`` as each arrives."""
        if jobs:
            asyncio.run(self._send(self.url + path, jobs, on_reply))

    async def _send(self, endpoint, jobs, on_reply):
        retry, api_key, request_timeout = self.retry, self.api_key, self.request_timeout

        async with open_session(api_key, self.concurrency, request_timeout) as session:
            async def one(job):
                i, body = job
                for attempt in range(1, retry.max_retries + 2):
                    status, text, retry_after = None, "", None
                    try:
                        async with session.post(endpoint, json=body) as r:
                            status, text, retry_after = r.status, await r.text(), r.headers.get("Retry-After")
                    except CONNECTION_ERRORS as e:
                        text = describe_client_error(e, request_timeout)
                    if status == 200:
                        on_reply(i, json.loads(text))
                        return
                    if status is not None and status not in RETRY_STATUSES or attempt > retry.max_retries:
                        raise TracesError(f"dataset.generate: request {i} to {endpoint} failed"
                                          f"{f' with HTTP {status}{auth_hint(status, api_key)}' if status else ''}: "
                                          f"{text[:300]}")
                    await asyncio.sleep(retry.delay(attempt, retry_after))

            await run_workers(list(jobs), one, self.concurrency)
