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


def user_turn(tokenizer) -> tuple[str, list[int]]:
    """(prefix, stop ids): the chat template's text before a user's first message (system turns the template
    adds included), and the token that ends a user's message there (``<|im_end|>`` in ChatML, ``<|eot_id|>``
    in Llama 3, the assistant's marker where the template has no end-of-turn token)."""
    if not tokenizer.chat_template:
        raise TracesError("dataset.generate: the target's tokenizer has no chat template, so there is no user "
                          "turn to sample; set dataset.path to a dataset instead")
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
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
    ``{"id", "source", "messages"}``, prepare_prompts' format); return the statistics. ``settings``: the
    sampling, the client's concurrency, timeout and retries (None: the schema's defaults)."""
    s = settings or QuestionSettings.defaults()
    questions, max_tokens, temperature, top_p, min_chars, seed = \
        s.questions, s.max_tokens, s.temperature, s.top_p, s.min_chars, s.seed
    concurrency, request_timeout, retry = s.concurrency, s.request_timeout, RetryPolicy.from_settings(s.retry())
    output = Path(output)
    partial = output.with_name(output.name + ".partial")
    prefix, stop_ids = user_turn(tokenizer)
    prompt_ids = tokenizer.encode(prefix, add_special_tokens=False)
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
            "top_p": top_p, "n": 1, "stop_token_ids": stop_ids}
    answers = _read_partial(partial)
    excluded = {fold(t) for t in exclude}
    budget = ATTEMPTS_PER_QUESTION * questions

    def kept():
        seen, rows, drops = set(), [], {"cut": 0, "short": 0, "duplicate": 0, "in_eval_set": 0}
        for i in sorted(answers):
            text, finish = answers[i]["text"].strip(), answers[i]["finish_reason"]
            key = fold(text)
            reason = ("cut" if finish != "stop" else "short" if len(text) < min_chars else
                      "in_eval_set" if key in excluded else "duplicate" if key in seen else None)
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
        while (missing := questions - len(kept()[0])) > 0 and next_i < budget:
            todo = range(next_i, min(budget, next_i + missing))
            next_i = todo.stop
            bar.total = max(bar.total, len(answers) + len(todo))
            asyncio.run(_ask(todo, url, body, seed, answers, sink, concurrency, request_timeout, retry, api_key,
                             on_answer=lambda: bar.update(1)))
    bar.close()
    rows, drops = kept()
    rows = rows[:questions]
    write_atomic(output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.unlink(partial)
    stats = {"questions": len(rows), "asked_for": questions, "requests": len(answers), "dropped": drops,
             "prefix_tokens": len(prompt_ids), "max_tokens": max_tokens, "temperature": temperature}
    write_atomic(output.with_name(output.stem + ".stats.json"), stats)
    dropped = ", ".join(f"{n} {r}" for r, n in drops.items() if n)
    say(f"questions: {len(rows)} of {questions} written to {output} from {len(answers)} requests"
        f"{f' ({dropped} dropped)' if dropped else ''}")
    if len(rows) < questions:
        say(f"questions: only {len(rows)} distinct questions after {budget} requests: the target repeats itself; "
            f"raise dataset.generate.temperature or lower dataset.generate.questions")
    if not rows:
        raise TracesError(f"dataset.generate: the target at {url} wrote no usable question in {len(answers)} "
                          f"requests ({dropped}); check its chat template and dataset.generate.max_tokens")
    return stats


def _read_partial(path: Path) -> dict:
    answers = {}
    if path.exists():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    a = json.loads(line)
                    answers[int(a["i"])] = a
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash: that request is sent again
    return answers


async def _ask(indices, url, body, seed, answers, sink, concurrency, request_timeout, retry, api_key, on_answer):
    endpoint = url.rstrip("/") + "/v1/completions"

    async with open_session(api_key, concurrency, request_timeout) as session:
        async def one(i):
            for attempt in range(1, retry.max_retries + 2):
                status, text, retry_after = None, "", None
                try:
                    async with session.post(endpoint, json={**body, "seed": seed * 1_000_003 + i}) as r:
                        status, text, retry_after = r.status, await r.text(), r.headers.get("Retry-After")
                except CONNECTION_ERRORS as e:
                    text = describe_client_error(e, request_timeout)
                if status == 200:
                    choice = json.loads(text)["choices"][0]
                    answers[i] = {"i": i, "text": choice["text"], "finish_reason": choice["finish_reason"]}
                    sink.write(json.dumps(answers[i], ensure_ascii=False) + "\n")
                    sink.flush()
                    on_answer()
                    return
                if status is not None and status not in RETRY_STATUSES or attempt > retry.max_retries:
                    raise TracesError(f"dataset.generate: request {i} to {endpoint} failed"
                                      f"{f' with HTTP {status}{auth_hint(status, api_key)}' if status else ''}: "
                                      f"{text[:300]}")
                await asyncio.sleep(retry.delay(attempt, retry_after))

        await run_workers(list(indices), one, concurrency)
