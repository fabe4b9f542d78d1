"""Traces: one chat request per prompt to a vLLM server, kept token-exact and crash-safe (the requests
themselves: eaglenest.serving.chat).

`generate_shard` sends every prompt of a shard independently to one or more OpenAI-compatible
vLLM servers (replicas share the load: each request goes to the one with the fewest requests in
flight) and keeps the whole answer: reasoning, content and the exact prompt and completion token
ids (`return_token_ids`), so later stages never re-template or re-tokenize.

Crash safety. Each finished record is appended and flushed to a partial file outside the declared
output, `<partial_dir>/<shard>.<answers_key>.partial.jsonl`. The key hashes every setting
that changes the answers, so a settings change starts a fresh file instead of mixing answers.
A conversation's prompt (``conversations``) is answered turn by turn, each turn appended as it comes. A
rerun after a crash or `kill -9` drops a torn last line, skips the ids already finished and sends
the rest (failed requests included). The declared output appears only once the shard is complete,
in prompt order, through a temp file and an atomic rename; the partial file then becomes a hard
link to it, so a forced rerun of a finished shard (Snakemake reruns every consumer of a rebuilt
`server.ready`) resumes everything and sends nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from dataclasses import fields
from pathlib import Path

from ..errors import TracesError
from ..serving.chat import ChatRequests, answer_record
from ..settings import CONVERSATION_KEYS, GenerationSettings
from ..util import say, write_atomic
from .conversations import converse, is_conversation
from .prompts import read_prompt_shard
from .trace_file import PartialFile, json_line
from .trace_stats import TraceStats, stem, summary, write_stats_table

__all__ = ["TracesError", "answers_key", "generate_shard", "write_stats_table"]

# The settings that change the answers (GenerationSettings' fingerprint, less the model): they, and only
# they, name the partial file, as a change to one of them reruns the traces.
ANSWER_SETTINGS = tuple(k for k in GenerationSettings.defaults().fingerprint() if k not in ("model", *CONVERSATION_KEYS))
# Hashed as floats, so that 0 and 0.0 give one key.
_FLOATS = frozenset(f.name for f in fields(GenerationSettings) if f.type == "float")


def answers_key(settings: GenerationSettings, *, conversations: bool = False) -> str:
    """Short hash of everything that changes the answers: the model and ANSWER_SETTINGS; for a shard that holds
    conversations (``conversations``), their limits too: a single question's answer does not depend on them, so
    the shards of single-turn data keep the key they had before conversations. It names the partial file and
    is the stats' "fingerprint"."""
    key = {"model": settings.model}
    for k in ANSWER_SETTINGS:
        value = getattr(settings, k)
        key[k] = float(value) if k in _FLOATS else value
    if conversations:
        key.update({k: getattr(settings, k) for k in CONVERSATION_KEYS})
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def generate_shard(prompts_path, output_path, settings: GenerationSettings, *, urls, api_key=None,
                   partial_dir=None, errors_path=None, stats_path=None, progress=True):
    """Answer every prompt of `prompts_path` with `settings.model` and write `output_path` once the shard is
    complete.

    prompts_path: JSONL of {"id", "source", "messages": [{"role", "content"}, ...]}; a repeated
        id is sent once.
    output_path: JSONL, one record per answered prompt, in prompt order: id, source, messages,
        reasoning, content, finish_reason, truncated, prompt_token_ids, completion_token_ids,
        usage, latency_s, server, attempts. A conversation's record adds turns, ended, turns_dropped
        (conversations; its limits: settings.max_turns, settings.max_context_tokens).
    urls: base URLs of the replicas (http://host:port, with or without /v1).
    partial_dir: where the partial file lives (default: <output dir>/partial/).
    errors_path: this run's failed requests, {id, status, body, server, attempts} per line
        (default: <output>.errors.jsonl); written, possibly empty, at the end of every run.
    stats_path: the returned stats as JSON (default: <output>.stats.json).

    Raises TracesError when every server stops answering, a server lacks return_token_ids, or
    more than `settings.max_error_fraction` of the shard's requests fail; the finished records stay in the
    partial file for the rerun, which sends only what is missing.
    """
    prompts_path, output_path = Path(prompts_path), Path(output_path)
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise TracesError(f"{output_path}: no server URL given; pass at least one base URL")
    shard = stem(output_path)
    prompts = read_prompt_shard(prompts_path)
    key = answers_key(settings, conversations=any(map(is_conversation, prompts)))
    partial_dir = Path(partial_dir) if partial_dir is not None else output_path.parent / "partial"
    files = _ShardFiles(
        output=output_path,
        partial=partial_dir / f"{shard}.{key}.partial.jsonl",
        errors=Path(errors_path) if errors_path is not None else _sibling(output_path, ".errors.jsonl"),
        stats=Path(stats_path) if stats_path is not None else _sibling(output_path, ".stats.json"),
    )
    run = _ShardRun(shard=shard, prompts=prompts, files=files, urls=urls, settings=settings, key=key,
                    api_key=api_key, progress=progress)
    return asyncio.run(run.main())


@dataclasses.dataclass(frozen=True)
class _ShardFiles:
    """Where a shard's run writes (see ``generate_shard``)."""

    output: Path
    """The records in prompt order, written once the shard is complete."""
    partial: Path
    """The finished records, appended as they come: what a rerun resumes from."""
    errors: Path
    """This run's failed requests, one JSON object a line."""
    stats: Path
    """The run's stats as JSON."""


class _ShardRun(ChatRequests):
    """One run over a shard's prompts (the requests: ChatRequests): the partial file it resumes from and
    appends to, a conversation's turns, the stats, and the output once complete."""

    def __init__(self, *, shard, prompts, files: _ShardFiles, urls, settings, key, api_key, progress):
        self.stats = TraceStats()
        super().__init__(name=shard, urls=urls, settings=settings, api_key=api_key, total=len(prompts),
                         max_errors=int(settings.max_error_fraction * len(prompts)), progress=progress)
        self.shard = shard
        self.prompts = prompts
        self.files = files
        self.key = key
        self.partial = PartialFile(files.partial, shard)  # the finished records
        self.index = self.partial.index  # id -> (offset, length) of its line in the partial file
        self.turns = {}          # id -> the turn lines of a conversation not finished (conversations.converse)
        self.next_postfix = 0.0

    @property
    def retries(self):
        return self.stats.retries

    @retries.setter
    def retries(self, n):
        self.stats.retries = n

    async def main(self):
        t0 = time.monotonic()
        self.partial.open({p["id"] for p in self.prompts}, self.stats.count,
                          on_turn=lambda line: self.turns.setdefault(line["turn_of"], []).append(line))
        self.stats.resumed = len(self.index)
        failure = None
        try:
            todo = [p for p in self.prompts if p["id"] not in self.index]
            if todo:
                failure = await self.send_all(todo, done=len(self.index))
        finally:
            if self.pbar is not None:
                self._postfix(time.monotonic())
                self.pbar.close()
            self.partial.close()
        wall = time.monotonic() - t0
        if failure is None and len(self.errors) > self.max_errors:
            failure = (f"{self.shard}: {len(self.errors)} of {len(self.prompts)} requests failed "
                       f"(more than {self.settings.max_error_fraction:.0%}); first: {self.first_error()}; "
                       f"all of them are in {self.files.errors}; "
                       f"finished records are kept in {self.files.partial}; fix the cause and rerun")
        stats = self.stats.as_dict(shard=self.shard, requests=len(self.prompts), records=len(self.index),
                                   errors=len(self.errors), wall=wall, complete=failure is None, servers=self.servers,
                                   model=self.model, fingerprint=self.key)
        write_atomic(self.files.errors, b"".join(json_line(e) for e in self.errors))
        write_atomic(self.files.stats, stats)
        say(summary(self.shard, stats))
        if failure is not None:
            raise TracesError(failure)
        self.partial.write_output(self.prompts, self.files.output)
        self.partial.link_to(self.files.output)
        return stats

    async def request(self, prompt):
        if is_conversation(prompt):
            await converse(self, prompt, self.turns.get(prompt["id"], []))
        else:
            await super().request(prompt)

    def finish(self, prompt, answer, choice, reasoning, latency, server, attempt):
        record = answer_record(prompt, answer, choice, reasoning, latency, server, attempt)
        self.stats.answered(latency, len(record["completion_token_ids"]))
        self.keep(record)

    def keep(self, record):
        """A finished record (a conversation's once it ended): appended to the partial file, counted."""
        self.partial.append(record)
        self.first_success = True
        self.stats.count(record)
        if self.pbar is not None:
            self.pbar.update(1)
            now = time.monotonic()
            if now >= self.next_postfix:
                self._postfix(now)

    def _postfix(self, now):
        if not self.pbar.disable:
            self.next_postfix = now + 1.0
            rate = self.stats.new_completion_tokens / max(now - self.t_send, 1e-9)
            self.pbar.set_postfix_str(f"{rate:,.0f} tok/s, {len(self.errors)} errors, {self.stats.retries} retries",
                                      refresh=False)

    def kept(self):
        return f"finished records are kept in {self.files.partial}" if self.index else "nothing was finished"

    def answered_count(self):
        return self.stats.completed


def _sibling(output_path, suffix):
    return output_path.with_name(stem(output_path) + suffix)
