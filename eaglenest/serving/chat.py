"""Chat completions sent to one or more vLLM replicas, token-exact: the request side of the traces
(eaglenest.data.traces) and validation's requests (``answer_prompts``).

``ChatRequests`` holds what a run of requests shares: the request body made once from the generation
settings (``return_token_ids`` always on), the replicas (each request goes to the one with the fewest
requests in flight; one refusing connections is dropped until a probe finds it answering), the retries,
the failed requests and the check, before the first request, that every replica serves the model.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod

from ..errors import TracesError
from ..settings import GenerationSettings
from ..util import progress_bar, say
from ..vllm_facts import reasoning_of
from .client import (CONNECTION_ERRORS, CONNECTION_LOST, PROBE_TIMEOUT, RETRY_STATUSES, RetryPolicy, auth_hint,
                     describe_client_error, open_session, run_workers)

__all__ = ["ChatRequests", "Replica", "answer_prompts", "answer_record", "base_url"]

ERROR_BODY_CHARS = 2000


class Replica:
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


def base_url(url):
    """http://host:port from http://host:port/, http://host:port/v1, ..."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise TracesError(f"server URL {url!r} must start with http:// or https://")
    return url


def not_served(url, models, model):
    return (f"server at {url} serves {models}, not {model!r}; "
            "set the model to the served name (vLLM's --served-model-name)")


def request_body(settings: GenerationSettings) -> tuple[bytes, bytes]:
    """The request body without the messages, encoded once -> (head, tail) spliced around each prompt's messages."""
    body = {"model": settings.model, "max_tokens": settings.max_tokens, "temperature": float(settings.temperature),
            "top_p": float(settings.top_p), "seed": settings.seed, "return_token_ids": True}
    if settings.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = settings.chat_template_kwargs
    body.update(settings.extra_body or {})
    body["return_token_ids"] = True
    body.pop("messages", None)
    return b'{"messages":', b"," + json.dumps(body, separators=(",", ":")).encode()[1:]


def answer_record(prompt, answer, choice, reasoning, latency, server, attempt) -> dict:
    """The trace record of a single question's answer (``answer``: the server's JSON, ``choice`` its first)."""
    finish_reason = choice.get("finish_reason")
    return {
        "id": prompt["id"],
        "source": prompt.get("source"),
        "messages": prompt["messages"],
        "reasoning": reasoning,
        "content": choice["message"].get("content"),
        "finish_reason": finish_reason,
        "truncated": finish_reason == "length",
        "prompt_token_ids": answer["prompt_token_ids"],
        "completion_token_ids": choice["token_ids"],
        "usage": answer.get("usage"),
        "latency_s": round(latency, 4),
        "server": server.url,
        "attempts": attempt,
    }


class ChatRequests(ABC):
    """Requests of ``settings`` (GenerationSettings: the model, sampling, concurrency, timeouts and retries) to
    the ``urls``' replicas under ``name`` (in messages); more than ``max_errors`` failed requests stop it.
    A subclass says what a finished answer becomes (``finish``) and where finished work is kept (``kept``)."""

    def __init__(self, *, name, urls, settings: GenerationSettings, api_key, max_errors, total, progress):
        self.name = name
        self.servers = [Replica(u) for u in dict.fromkeys(base_url(u) for u in urls)]
        self.settings = settings
        self.model = settings.model
        self.api_key = api_key
        self.retry = RetryPolicy.from_settings(settings)
        self.max_errors = max_errors
        self.body_head, self.body_tail = request_body(settings)
        self.errors = []         # this run's failed requests: {id, status, body, server, attempts}
        self.retries = 0
        self.stopping = False    # no new requests (error budget spent); in-flight ones finish
        self.first_success = False
        self.total, self.progress, self.pbar = total, progress, None

    @abstractmethod
    def finish(self, prompt, answer, choice, reasoning, latency, server, attempt):
        """Keep one answered request: each kind of run keeps its own (a trace shard appends it to its partial
        file, validation's answers hold it in memory), so the subclass says how."""

    def kept(self) -> str:
        """Where the finished work stays when the run fails (for its messages)."""
        return "nothing was finished"

    async def request(self, prompt):
        """Send a single question and finish its answer."""
        got = await self.post(prompt["id"], self.body(prompt["messages"]))
        if got is not None:
            raw, server, latency, attempt = got
            parsed = self.parse(prompt["id"], raw, server, attempt)
            if parsed is not None:
                server.answered += 1
                self.finish(prompt, *parsed, latency, server, attempt)

    async def send_all(self, todo, done=0):
        """Run ``settings.concurrency`` workers over ``todo`` (``done``: the ones finished before); returns a
        failure message or None."""
        s = self.settings
        async with open_session(self.api_key, s.concurrency, s.request_timeout) as session:
            self.session = session
            try:
                await self._preflight()
            except TracesError as e:
                return str(e)
            self.pbar = progress_bar(total=self.total, initial=done, desc=self.name, unit="req",
                                     disable=not self.progress, smoothing=0.1)
            self.t_send = time.monotonic()

            async def send(prompt):
                await self.request(prompt)
                return not self.stopping

            try:
                await run_workers(todo, send, s.concurrency)
            except TracesError as e:
                return str(e)
        return None

    async def _preflight(self):
        """Re-check every server before relying on it (a server.ready sentinel can outlive its
        server): one that refuses connections starts out marked down; none answering, a rejected
        key or a model that is not served fails the run at once."""

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
                raise TracesError(f"{self.name}: server at {server.url}: GET /v1/models answered HTTP {status}"
                                  f"{auth_hint(status, self.api_key)}: {answer}")
            elif answer is not None and self.model not in answer:
                raise TracesError(f"{self.name}: {not_served(server.url, answer, self.model)}")
        if all(s.down_since is not None for s in self.servers):
            raise TracesError(self.servers_down_message())

    def body(self, messages, tools=None) -> bytes:
        """A request's body: the messages (and tools) spliced into the settings' body."""
        tools = b',"tools":' + json.dumps(tools, separators=(",", ":")).encode() if tools else b""
        return self.body_head + json.dumps(messages, separators=(",", ":")).encode() + tools + self.body_tail

    async def post(self, rid, data, refused=None):
        """Send one request (``rid``: the prompt's id, for the errors file) with retries -> (raw answer, server,
        latency, attempts); "refused" where ``refused(status, body)`` says a non-retried answer is not an
        error; None when it failed (counted) or the run is stopping."""
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
                failure = describe_client_error(e, self.settings.request_timeout)
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
                    self.fail(rid, status, body, server, attempt)
                    return None
                failure = f"HTTP {status}: {body[:200]}"
            finally:
                server.outstanding -= 1
            if self.stopping:
                return None  # the run has failed already; this prompt is sent again on the rerun
            if attempt > self.settings.max_retries:
                if status is None and all(s.down_since is not None for s in self.servers):
                    raise TracesError(self.servers_down_message())
                self.fail(rid, status, f"gave up after {attempt} attempts; last: {failure}", server, attempt)
                return None
            self.retries += 1
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
                say(f"WARNING: {self.name}: the replica at {server.url} stopped answering ({failure}): dropped "
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
            self.fail(rid, 200, "unexpected answer: " + raw[:ERROR_BODY_CHARS].decode("utf-8", "replace"),
                      server, attempt)
            return None
        if choice.get("token_ids") is None or answer.get("prompt_token_ids") is None:
            raise TracesError(
                f"{self.name}: server at {server.url} answered without token ids; eaglenest needs a vLLM "
                "server that supports return_token_ids (the exact tokens of prompt and answer)")
        return answer, choice, reasoning_of(message)

    def fail(self, rid, status, body, server, attempts):
        self.errors.append({"id": rid, "status": status, "body": body, "server": server.url,
                            "attempts": attempts})
        if len(self.errors) > self.max_errors:
            self.stopping = True  # the run has failed: let in-flight requests finish, send no more

    def first_error(self) -> str:
        """The first failed request, for messages: what came back, from where."""
        first = self.errors[0]
        what = f"HTTP {first['status']}{auth_hint(first['status'], self.api_key)}" if first["status"] else "no answer"
        return f"{what} from {first['server']}: {first['body'][:300]}"

    def servers_down_message(self):
        down = [s for s in self.servers if s.down_since is not None]
        where = "server at " + down[0].url if len(down) == 1 else "servers at " + ", ".join(s.url for s in down)
        are = "is" if len(down) == 1 else "are"
        why = down[0].last_failure
        if self.first_success:
            return (f"{self.name}: {where} stopped answering ({why}) after {self.answered_count()} finished records; "
                    f"{self.kept()}; restart the server and rerun")
        return f"{self.name}: {where} {are} not answering ({why}); {self.kept()}; start the server (or fix the URL) and rerun"

    def answered_count(self) -> int:
        return sum(s.answered for s in self.servers)


class _Answers(ChatRequests):
    """``answer_prompts``' run: the records kept in memory, by prompt index."""

    def __init__(self, prompts, **kw):
        super().__init__(max_errors=0, total=len(prompts), **kw)  # any failure fails
        self.records = {}

    def finish(self, prompt, answer, choice, reasoning, latency, server, attempt):
        self.records[prompt["id"]] = answer_record(prompt, answer, choice, reasoning, latency, server, attempt)
        self.first_success = True


def answer_prompts(prompts, *, url, model, generation: GenerationSettings, api_key=None, name="answers"):
    """The trace records of ``prompts`` (single questions: dicts with "messages"), in order, from the server at
    ``url``: the request body and retry policy of the traces, of ``generation`` (its model replaced by ``model``).
    Any failed request raises TracesError."""
    keyed = [{**p, "id": str(i)} for i, p in enumerate(prompts)]  # unique ids: every prompt is sent
    run = _Answers(keyed, name=name, urls=[url], settings=generation.replace(model=model), api_key=api_key,
                   progress=False)
    failure = asyncio.run(run.send_all(keyed))
    run.pbar.close()
    if run.errors:
        raise TracesError(f"{name}: {len(run.errors)} of {len(prompts)} requests failed; first: {run.first_error()}")
    if failure is not None:
        raise TracesError(failure)
    return [{**run.records[k["id"]], "id": p.get("id", k["id"])} for k, p in zip(keyed, prompts)]
