"""Traces: one chat request per prompt to a vLLM server, kept token-exact and crash-safe.

`generate_shard` sends every prompt of a shard independently to one or more OpenAI-compatible
vLLM servers (replicas share the load: each request goes to the one with the fewest requests in
flight) and keeps the whole answer: reasoning, content and the exact prompt and completion token
ids (`return_token_ids`), so later stages never re-template or re-tokenize.

Crash safety. Each finished record is appended and flushed to a partial file outside the declared
output, `<partial_dir>/<shard>.<fingerprint>.partial.jsonl`. The fingerprint hashes every setting
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
from pathlib import Path

import requests

from ..config import defaults
from ..errors import ServerError, TracesError
from ..serving.client import (CONNECTION_ERRORS, CONNECTION_LOST, PROBE_TIMEOUT, RETRY_STATUSES, RetryPolicy,
                              auth_hint, describe_client_error, open_session, run_workers)
from ..serving.probe import describe_os_error, probe
from ..settings import CONVERSATION_KEYS, GenerationSettings
from ..util import progress_bar, say, write_atomic
from ..vllm_facts import reasoning_of
from .conversations import converse, is_conversation
from .prompts import read_prompt_shard
from .trace_file import PartialFile, json_line
from .trace_stats import TraceStats, stem, summary, write_stats_table

__all__ = ["TracesError", "answer_prompts", "check_server", "generate_shard", "fingerprint", "write_stats_table"]

# The `generation:` section of the config; its keys and defaults are the schema's (the only place).
GENERATION_DEFAULTS = defaults("generation")
# The settings that change the answers (GenerationSettings' fingerprint, less the model): they, and only
# they, name the partial file, as a change to one of them reruns the traces.
ANSWER_SETTINGS = tuple(k for k in GenerationSettings.defaults().fingerprint() if k not in ("model", *CONVERSATION_KEYS))
ERROR_BODY_CHARS = 2000


def fingerprint(model, generation=None, conversation=None):
    """Short hash of everything that changes the answers (model and ANSWER_SETTINGS; for a shard that holds
    conversations, ``conversation``'s limits too: a single question's answer does not depend on them, so the
    shards of single-turn data keep the fingerprint they had before conversations)."""
    g = _generation_settings(generation or {})
    key = {"model": model, **{k: g[k] for k in ANSWER_SETTINGS}}
    if conversation is not None:
        key.update({k: conversation[k] for k in CONVERSATION_KEYS})
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def generate_shard(prompts_path, output_path, *, urls, model, generation, api_key=None, conversation=None,
                   partial_dir=None, errors_path=None, stats_path=None, progress=True):
    """Answer every prompt of `prompts_path` and write `output_path` once the shard is complete.

    prompts_path: JSONL of {"id", "source", "messages": [{"role", "content"}, ...]}; a repeated
        id is sent once.
    output_path: JSONL, one record per answered prompt, in prompt order: id, source, messages,
        reasoning, content, finish_reason, truncated, prompt_token_ids, completion_token_ids,
        usage, latency_s, server, attempts.
    urls: base URLs of the replicas (http://host:port, with or without /v1).
    generation: the `generation:` config (GENERATION_DEFAULTS' keys), all optional.
    conversation: where a conversation ends, {max_turns, max_context_tokens} (GenerationSettings.conversation;
        None: the schema's defaults). A conversation's record adds turns, ended, turns_dropped (conversations).
    partial_dir: where the partial file lives (default: <output dir>/partial/).
    errors_path: this run's failed requests, {id, status, body, server, attempts} per line
        (default: <output>.errors.jsonl); written, possibly empty, at the end of every run.
    stats_path: the returned stats as JSON (default: <output>.stats.json).

    Raises TracesError when every server stops answering, a server lacks return_token_ids, or
    more than `generation.max_error_fraction` of the shard's requests fail; the finished records stay in the
    partial file for the rerun, which sends only what is missing.
    """
    prompts_path, output_path = Path(prompts_path), Path(output_path)
    gen = _generation_settings(generation)
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise TracesError(f"{output_path}: no server URL given; pass at least one base URL")
    shard = stem(output_path)
    prompts = read_prompt_shard(prompts_path)
    conversation = _conversation_settings(conversation)
    fp = _shard_fingerprint(model, gen, conversation, prompts)
    partial_dir = Path(partial_dir) if partial_dir is not None else output_path.parent / "partial"
    files = _ShardFiles(
        output=output_path,
        partial=partial_dir / f"{shard}.{fp}.partial.jsonl",
        errors=Path(errors_path) if errors_path is not None else _sibling(output_path, ".errors.jsonl"),
        stats=Path(stats_path) if stats_path is not None else _sibling(output_path, ".stats.json"),
    )
    run = _ShardRun(shard=shard, prompts=prompts, files=files,
                    servers=[_Server(u) for u in dict.fromkeys(_base_url(u) for u in urls)], model=model, gen=gen,
                    api_key=api_key, progress=progress, conversation=conversation)
    return asyncio.run(run.main())


def _shard_fingerprint(model, gen, conversation, prompts):
    """The fingerprint of a shard's partial file: the conversation limits count where it holds conversations."""
    return fingerprint(model, gen, conversation if any(map(is_conversation, prompts)) else None)


def answer_prompts(prompts, *, url, model, generation, api_key=None, name="answers", progress=False, conversation=None):
    """The trace records of ``prompts`` (dicts with "messages"), in order, from the server at ``url``:
    the client, request body and retry policy of ``generate_shard``, with its files in a temporary
    directory that is removed afterwards. Any failed request raises TracesError."""
    import tempfile

    gen = _generation_settings(generation)
    keyed = [{**p, "id": str(i)} for i, p in enumerate(prompts)]  # unique ids: every prompt is sent
    with tempfile.TemporaryDirectory(prefix="eaglenest-answers-") as tmp:
        tmp = Path(tmp)
        output_path = tmp / f"{name}.jsonl"
        files = _ShardFiles(output=output_path, partial=tmp / "partial.jsonl", errors=tmp / "errors.jsonl",
                            stats=tmp / "stats.json")
        run = _ShardRun(shard=name, prompts=keyed, files=files, servers=[_Server(_base_url(url))], model=model,
                        gen={**gen, "max_error_fraction": 0.0}, api_key=api_key, progress=progress,  # any failure fails
                        conversation=_conversation_settings(conversation))
        try:
            asyncio.run(run.main())
        except TracesError:
            if not run.errors:
                raise
            first = run.errors[0]
            what = f"HTTP {first['status']}{auth_hint(first['status'], api_key)}" if first["status"] else "no answer"
            raise TracesError(f"{name}: {len(run.errors)} of {len(prompts)} requests failed; first: {what} "
                              f"from {first['server']}: {first['body'][:300]}") from None
        with open(output_path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
    for record, prompt in zip(records, prompts):
        record["id"] = prompt.get("id", record["id"])
    return records


def check_server(url, api_key=None, model=None, timeout=5.0):
    """GET /v1/models (and /version) of a server: {ok, url, models, max_model_len, version}.

    Raises TracesError naming the URL when it does not answer, rejects the key or does not serve
    `model`.
    """
    base = _base_url(url)
    try:
        info = probe(base, api_key, timeout)
    except ServerError as e:  # the key was refused
        raise TracesError(str(e)) from None
    except requests.HTTPError as e:
        raise TracesError(f"server at {base}: GET /v1/models answered HTTP {e.response.status_code}; "
                          "is this an OpenAI-compatible server?") from None
    except ValueError:  # before OSError: requests' JSONDecodeError is both
        raise TracesError(f"server at {base}: GET /v1/models did not return JSON; "
                          "is this an OpenAI-compatible server?") from None
    except OSError as e:
        raise TracesError(f"server at {base} is not answering ({describe_os_error(e)}); start it, or check the URL") from None
    models = info["models"]
    if model is not None and model not in models:
        raise TracesError(_not_served(base, models, model))
    chosen = model if model is not None else (models[0] if models else None)
    return {"ok": True, "url": base, "models": models, "max_model_len": info["max_model_len"].get(chosen),
            "version": info["version"]}


# ---------------------------------------------------------------------------------------------


class _Server:
    """One replica: its endpoint, requests in flight and whether it is refusing connections."""

    __slots__ = ("url", "endpoint", "outstanding", "answered", "down_since", "probe_at", "failures",
                 "last_failure")

    def __init__(self, url):
        self.url = url
        self.endpoint = url + "/v1/chat/completions"
        self.outstanding = 0
        self.answered = 0
        self.down_since = None   # monotonic time of the first connection failure since an answer
        self.probe_at = 0.0      # while down: when the next request may try it again
        self.failures = 0        # connection failures since the last answer
        self.last_failure = None


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


def _request_body(model, gen) -> tuple[bytes, bytes]:
    """The request body without the messages, encoded once -> (head, tail) spliced around each prompt's messages."""
    body = {"model": model, "max_tokens": gen["max_tokens"], "temperature": gen["temperature"],
            "top_p": gen["top_p"], "seed": gen["seed"], "return_token_ids": True}
    if gen["chat_template_kwargs"] is not None:
        body["chat_template_kwargs"] = gen["chat_template_kwargs"]
    body.update(gen["extra_body"] or {})
    body["return_token_ids"] = True
    body.pop("messages", None)
    return b'{"messages":', b"," + json.dumps(body, separators=(",", ":")).encode()[1:]


class _ShardRun:
    """One run over a shard's prompts: ``gen`` (``_generation_settings``) says how to ask ``model`` on the
    ``servers`` (``_Server``) and how many failures the shard bears (``max_error_fraction``)."""

    def __init__(self, *, shard, prompts, files: _ShardFiles, servers, model, gen, api_key, progress, conversation):
        self.shard = shard
        self.prompts = prompts
        self.files = files
        self.servers = servers
        self.model = model
        self.gen = gen
        self.retry = RetryPolicy.from_settings(gen)
        self.api_key = api_key
        self.conversation = conversation  # {max_turns, max_context_tokens}
        self.fingerprint = _shard_fingerprint(model, gen, conversation, prompts)
        self.progress = progress
        self.max_errors = int(gen["max_error_fraction"] * len(prompts))
        self.body_head, self.body_tail = _request_body(model, gen)
        self.partial = PartialFile(files.partial, shard)  # the finished records
        self.index = self.partial.index  # id -> (offset, length) of its line in the partial file
        self.turns = {}          # id -> the turn lines of a conversation not finished (conversations.converse)
        self.errors = []         # this run's failed requests: {id, status, body, server, attempts}
        self.stats = TraceStats()
        self.stopping = False    # no new requests (error budget spent); in-flight ones finish
        self.first_success = False
        self.pbar = None
        self.next_postfix = 0.0

    # -- the run ----------------------------------------------------------------------------

    async def main(self):
        t0 = time.monotonic()
        self.partial.open({p["id"] for p in self.prompts}, self.stats.count,
                          on_turn=lambda line: self.turns.setdefault(line["turn_of"], []).append(line))
        self.stats.resumed = len(self.index)
        failure = None
        try:
            todo = [p for p in self.prompts if p["id"] not in self.index]
            if todo:
                failure = await self._send_all(todo)
        finally:
            if self.pbar is not None:
                self._postfix(time.monotonic())
                self.pbar.close()
            self.partial.close()
        wall = time.monotonic() - t0
        if failure is None and len(self.errors) > self.max_errors:
            first = self.errors[0]
            what = f"HTTP {first['status']}{auth_hint(first['status'], self.api_key)}" if first["status"] else "no answer"
            failure = (f"{self.shard}: {len(self.errors)} of {len(self.prompts)} requests failed "
                       f"(more than {self.gen['max_error_fraction']:.0%}); first: {what} from {first['server']}: "
                       f"{first['body'][:300]}; all of them are in {self.files.errors}; "
                       f"finished records are kept in {self.files.partial}; fix the cause and rerun")
        stats = self.stats.as_dict(shard=self.shard, requests=len(self.prompts), records=len(self.index),
                                   errors=len(self.errors), wall=wall, complete=failure is None, servers=self.servers,
                                   model=self.model, fingerprint=self.fingerprint)
        write_atomic(self.files.errors, b"".join(json_line(e) for e in self.errors))
        write_atomic(self.files.stats, stats)
        say(summary(self.shard, stats))
        if failure is not None:
            raise TracesError(failure)
        self.partial.write_output(self.prompts, self.files.output)
        self.partial.link_to(self.files.output)
        return stats

    async def _send_all(self, todo):
        """Run `concurrency` workers over `todo`; returns a failure message or None."""
        g = self.gen
        async with open_session(self.api_key, g["concurrency"], g["request_timeout"]) as session:
            self.session = session
            try:
                await self._preflight()
            except TracesError as e:
                return str(e)
            self.pbar = progress_bar(total=len(self.prompts), initial=len(self.index), desc=self.shard, unit="req",
                                     disable=not self.progress, smoothing=0.1)
            self.t_send = time.monotonic()

            async def send(prompt):
                await self._request(prompt)
                return not self.stopping

            try:
                await run_workers(todo, send, g["concurrency"])
            except TracesError as e:
                return str(e)
        return None

    async def _preflight(self):
        """Re-check every server before relying on it (a server.ready sentinel can outlive its
        server): one that refuses connections starts out marked down; none answering, a rejected
        key or a model that is not served fails the shard at once."""

        async def probe(server):
            try:
                async with self.session.get(server.url + "/v1/models", timeout=PROBE_TIMEOUT) as r:
                    raw = await r.read()
                    if r.status != 200:
                        return r.status, raw[:300].decode("utf-8", "replace")
                    return 200, [m.get("id") for m in json.loads(raw).get("data") or []]
            except CONNECTION_ERRORS as e:
                return None, describe_client_error(e, 30)
            except (ValueError, AttributeError, TypeError):
                return 200, None

        results = await asyncio.gather(*(probe(s) for s in self.servers))
        for server, (status, answer) in zip(self.servers, results):
            if status is None or status >= 500:
                self._mark_down(server, answer if status is None else f"HTTP {status}")
            elif status != 200:
                raise TracesError(f"{self.shard}: server at {server.url}: GET /v1/models answered HTTP {status}"
                                  f"{auth_hint(status, self.api_key)}: {answer}")
            elif answer is not None and self.model not in answer:
                raise TracesError(f"{self.shard}: {_not_served(server.url, answer, self.model)}")
        if all(s.down_since is not None for s in self.servers):
            raise TracesError(self._servers_down_message())

    async def _request(self, prompt):
        if is_conversation(prompt):
            await converse(self, prompt, self.turns.get(prompt["id"], []))
            return
        got = await self.post(prompt["id"], self.body(prompt["messages"]))
        if got is not None:
            self._finish(prompt, *got)

    def body(self, messages, tools=None) -> bytes:
        """A request's body: the messages (and tools) spliced into the settings' body."""
        tools = b',"tools":' + json.dumps(tools, separators=(",", ":")).encode() if tools else b""
        return self.body_head + json.dumps(messages, separators=(",", ":")).encode() + tools + self.body_tail

    async def post(self, rid, data, refused=None):
        """Send one request (``rid``: the prompt's id, for the errors file) with retries -> (raw answer, server,
        latency, attempts); "refused" where ``refused(status, body)`` says a non-retried answer is not an
        error; None when it failed (counted) or the shard is stopping."""
        g = self.gen
        attempt = 0
        while True:
            attempt += 1
            server = self._pick_server()
            server.outstanding += 1
            status = retry_after = None
            start = time.monotonic()
            try:
                async with self.session.post(server.endpoint, data=data) as resp:
                    status = resp.status
                    raw = await resp.read()
                    if status != 200:
                        retry_after = resp.headers.get("Retry-After")
            except CONNECTION_ERRORS as e:
                failure = describe_client_error(e, g["request_timeout"])
                if isinstance(e, CONNECTION_LOST):
                    self._mark_down(server, failure)
            else:
                server.down_since = None
                server.failures = 0
                if status == 200:
                    return raw, server, time.monotonic() - start, attempt
                body = raw[:ERROR_BODY_CHARS].decode("utf-8", "replace")
                if status not in RETRY_STATUSES:
                    if refused is not None and refused(status, body):
                        return "refused"
                    self._fail(rid, status, body, server, attempt)
                    return None
                failure = f"HTTP {status}: {body[:200]}"
            finally:
                server.outstanding -= 1
            if self.stopping:
                return None  # the shard has failed already; this prompt is sent again on the rerun
            if attempt > g["max_retries"]:
                if status is None and all(s.down_since is not None for s in self.servers):
                    raise TracesError(self._servers_down_message())
                self._fail(rid, status, f"gave up after {attempt} attempts; last: {failure}", server, attempt)
                return None
            self.stats.retries += 1
            await asyncio.sleep(self._backoff(attempt, retry_after))

    def _pick_server(self):
        """The replica with the fewest requests in flight, skipping those refusing connections
        except for one probe at a time once their back-off has passed."""
        servers = self.servers
        if len(servers) == 1:
            return servers[0]
        now = time.monotonic()
        best = None
        for s in servers:
            if s.down_since is not None and now < s.probe_at:
                continue
            if best is None or s.outstanding < best.outstanding:
                best = s
        if best is None:  # all refusing: try the one whose back-off ends first
            best = min(servers, key=lambda s: s.probe_at)
        if best.down_since is not None:  # a probe: hold the others back until it is answered
            best.probe_at = now + self._backoff(best.failures + 1, None)
        return best

    def _mark_down(self, server, failure):
        now = time.monotonic()
        if server.down_since is None:
            server.down_since = now
            if len(self.servers) > 1:
                up = sum(s.down_since is None for s in self.servers)
                say(f"WARNING: {self.shard}: the replica at {server.url} stopped answering ({failure}): dropped "
                    f"until it answers again; its requests go to the {up} others")
        server.failures += 1
        server.last_failure = failure
        server.probe_at = now + self._backoff(server.failures, None)

    def _backoff(self, attempt, retry_after):
        return self.retry.delay(attempt, retry_after)

    def parse(self, rid, raw, server, attempt):
        """(answer, its first choice, the reasoning) of a chat answer; None (counted as a failure) when it is
        not one. TracesError when it lacks the token ids."""
        try:
            answer = json.loads(raw)
            choice = answer["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            self._fail(rid, 200, "unexpected answer: " + raw[:ERROR_BODY_CHARS].decode("utf-8", "replace"),
                       server, attempt)
            return None
        if choice.get("token_ids") is None or answer.get("prompt_token_ids") is None:
            raise TracesError(
                f"{self.shard}: server at {server.url} answered without token ids; eaglenest needs a vLLM "
                "server that supports return_token_ids (the exact tokens of prompt and answer)")
        return answer, choice, reasoning_of(message)

    def _finish(self, prompt, raw, server, latency, attempt):
        parsed = self.parse(prompt["id"], raw, server, attempt)
        if parsed is None:
            return
        answer, choice, reasoning = parsed
        message = choice["message"]
        completion_ids, prompt_ids = choice["token_ids"], answer["prompt_token_ids"]
        finish_reason = choice.get("finish_reason")
        record = {
            "id": prompt["id"],
            "source": prompt.get("source"),
            "messages": prompt["messages"],
            "reasoning": reasoning,
            "content": message.get("content"),
            "finish_reason": finish_reason,
            "truncated": finish_reason == "length",
            "prompt_token_ids": prompt_ids,
            "completion_token_ids": completion_ids,
            "usage": answer.get("usage"),
            "latency_s": round(latency, 4),
            "server": server.url,
            "attempts": attempt,
        }
        server.answered += 1
        self.stats.answered(latency, len(completion_ids))
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

    def _fail(self, rid, status, body, server, attempts):
        self.errors.append({"id": rid, "status": status, "body": body, "server": server.url,
                            "attempts": attempts})
        if len(self.errors) > self.max_errors:
            self.stopping = True  # the shard has failed: let in-flight requests finish, send no more

    def _servers_down_message(self):
        down = [s for s in self.servers if s.down_since is not None]
        where = "server at " + down[0].url if len(down) == 1 else "servers at " + ", ".join(s.url for s in down)
        are = "is" if len(down) == 1 else "are"
        why = down[0].last_failure
        kept = f"finished records are kept in {self.files.partial}" if self.index else "nothing was finished"
        if self.first_success:
            return (f"{self.shard}: {where} stopped answering ({why}) after {self.stats.completed} finished records; "
                    f"{kept}; restart the server and rerun")
        return f"{self.shard}: {where} {are} not answering ({why}); {kept}; start the server (or fix the URL) and rerun"

# ---------------------------------------------------------------------------------------------


def _generation_settings(generation):
    """The `generation:` config checked and completed with the schema's defaults (a None value takes
    the default); numbers that may be written as ints are floats, so 0 and 0.0 fingerprint alike."""
    unknown = sorted(set(generation or {}) - set(GENERATION_DEFAULTS))
    if unknown:
        raise TracesError(f"generation settings {unknown} are not known; known: {sorted(GENERATION_DEFAULTS)}")
    g = {**GENERATION_DEFAULTS, **{k: v for k, v in (generation or {}).items() if v is not None}}
    for key in ("max_tokens", "concurrency"):
        if not isinstance(g[key], int) or g[key] < 1:
            raise TracesError(f"generation.{key} must be a positive integer, got {g[key]!r}")
    if not isinstance(g["max_retries"], int) or g["max_retries"] < 0:
        raise TracesError(f"generation.max_retries must be an integer >= 0, got {g['max_retries']!r}")
    for key in ("temperature", "top_p", "request_timeout", "backoff_base", "backoff_max", "max_error_fraction"):
        try:  # as floats, so that 0 and 0.0 give one fingerprint
            g[key] = float(g[key])
        except (TypeError, ValueError):
            raise TracesError(f"generation.{key} must be a number, got {g[key]!r}") from None
    for key in ("chat_template_kwargs", "extra_body"):
        if g[key] is not None and not isinstance(g[key], dict):
            raise TracesError(f"generation.{key} must be a mapping, got {g[key]!r}")
    return g


def _conversation_settings(conversation):
    """The conversation limits ({max_turns, max_context_tokens}) checked and completed with the schema's defaults."""
    c = {**GenerationSettings.defaults().conversation(), **{k: v for k, v in (conversation or {}).items() if v is not None}}
    if set(c) != set(CONVERSATION_KEYS):
        raise TracesError(f"conversation settings {sorted(set(c) - set(CONVERSATION_KEYS))} are not known; "
                          f"known: {list(CONVERSATION_KEYS)}")
    if not isinstance(c["max_turns"], int) or c["max_turns"] < 1:
        raise TracesError(f"dataset.max_turns must be a positive integer, got {c['max_turns']!r}")
    if c["max_context_tokens"] is not None and (not isinstance(c["max_context_tokens"], int) or c["max_context_tokens"] < 1):
        raise TracesError(f"dataset.max_context_tokens must be a positive integer or null, got {c['max_context_tokens']!r}")
    return c


def _base_url(url):
    """http://host:port from http://host:port/, http://host:port/v1, ..."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise TracesError(f"server URL {url!r} must start with http:// or https://")
    return url


def _not_served(url, models, model):
    return (f"server at {url} serves {models}, not {model!r}; "
            "set the model to the served name (vLLM's --served-model-name)")


def _sibling(output_path, suffix):
    return output_path.with_name(stem(output_path) + suffix)
