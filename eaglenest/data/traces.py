"""Traces: one chat request per prompt to a vLLM server, kept token-exact and crash-safe.

`generate_shard` sends every prompt of a shard independently to one or more OpenAI-compatible
vLLM servers (replicas share the load: each request goes to the one with the fewest requests in
flight) and keeps the whole answer: reasoning, content and the exact prompt and completion token
ids (`return_token_ids`), so later stages never re-template or re-tokenize.

Crash safety. Each finished record is appended and flushed to a partial file outside the declared
output, `<partial_dir>/<shard>.<fingerprint>.partial.jsonl`. The fingerprint hashes every setting
that changes the answers, so a settings change starts a fresh file instead of mixing answers. A
rerun after a crash or `kill -9` drops a torn last line, skips the ids already finished and sends
the rest (failed requests included). The declared output appears only once the shard is complete,
in prompt order, through a temp file and an atomic rename; the partial file then becomes a hard
link to it, so a forced rerun of a finished shard (Snakemake reruns every consumer of a rebuilt
`server.ready`) resumes everything and sends nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path

import requests

from ..config import defaults
from ..errors import ServerError, TracesError
from ..serving.client import (CONNECTION_ERRORS, CONNECTION_LOST, PROBE_TIMEOUT, RETRY_STATUSES, RetryPolicy,
                              auth_hint, describe_client_error, open_session, run_workers)
from ..serving.probe import describe_os_error, probe
from ..serving.vllm import reasoning_of
from ..util import open_locked, progress_bar, say, write_atomic

__all__ = ["TracesError", "answer_prompts", "check_server", "generate_shard", "fingerprint"]

# The `generation:` section of the config; its keys and defaults are the schema's (the only place).
GENERATION_DEFAULTS = defaults("generation")
# The settings that change the answers; they, and only they, name the partial file, and a change to
# one of them reruns the traces (rules/common.smk reads this list too).
ANSWER_SETTINGS = ("max_tokens", "temperature", "top_p", "seed", "chat_template_kwargs", "extra_body")
ERROR_BODY_CHARS = 2000




def fingerprint(model, generation=None):
    """Short hash of everything that changes the answers (model and ANSWER_SETTINGS)."""
    g = _generation_settings(generation or {})
    key = {"model": model, **{k: g[k] for k in ANSWER_SETTINGS}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def generate_shard(prompts_path, output_path, *, urls, model, generation, api_key=None,
                   partial_dir=None, errors_path=None, stats_path=None, progress=True):
    """Answer every prompt of `prompts_path` and write `output_path` once the shard is complete.

    prompts_path: JSONL of {"id", "source", "messages": [{"role", "content"}, ...]}; a repeated
        id is sent once.
    output_path: JSONL, one record per answered prompt, in prompt order: id, source, messages,
        reasoning, content, finish_reason, truncated, prompt_token_ids, completion_token_ids,
        usage, latency_s, server, attempts.
    urls: base URLs of the replicas (http://host:port, with or without /v1).
    generation: the `generation:` config (GENERATION_DEFAULTS' keys), all optional.
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
    shard = _stem(output_path)
    fp = fingerprint(model, gen)
    partial_dir = Path(partial_dir) if partial_dir is not None else output_path.parent / "partial"
    run = _ShardRun(
        shard=shard,
        prompts=_read_prompts(prompts_path),
        output_path=output_path,
        partial_path=partial_dir / f"{shard}.{fp}.partial.jsonl",
        errors_path=Path(errors_path) if errors_path is not None else _sibling(output_path, ".errors.jsonl"),
        stats_path=Path(stats_path) if stats_path is not None else _sibling(output_path, ".stats.json"),
        servers=[_Server(u) for u in dict.fromkeys(_base_url(u) for u in urls)],
        model=model,
        gen=gen,
        api_key=api_key,
        fingerprint=fp,
        max_error_fraction=gen["max_error_fraction"],
        progress=progress,
    )
    return asyncio.run(run.main())


def answer_prompts(prompts, *, url, model, generation, api_key=None, name="answers", progress=False):
    """The trace records of ``prompts`` (dicts with "messages"), in order, from the server at ``url``:
    the client, request body and retry policy of ``generate_shard``, with its files in a temporary
    directory that is removed afterwards. Any failed request raises TracesError."""
    import tempfile

    gen = _generation_settings(generation)
    keyed = [{**p, "id": str(i)} for i, p in enumerate(prompts)]  # unique ids: every prompt is sent
    with tempfile.TemporaryDirectory(prefix="eaglenest-answers-") as tmp:
        tmp = Path(tmp)
        output_path = tmp / f"{name}.jsonl"
        run = _ShardRun(shard=name, prompts=keyed, output_path=output_path, partial_path=tmp / "partial.jsonl",
                        errors_path=tmp / "errors.jsonl", stats_path=tmp / "stats.json",
                        servers=[_Server(_base_url(url))], model=model, gen=gen, api_key=api_key,
                        fingerprint=fingerprint(model, gen), max_error_fraction=0.0, progress=progress)
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


class _ShardRun:
    def __init__(self, *, shard, prompts, output_path, partial_path, errors_path, stats_path, servers,
                 model, gen, api_key, fingerprint, max_error_fraction, progress):
        self.shard = shard
        self.prompts = prompts
        self.output_path = output_path
        self.partial_path = partial_path
        self.errors_path = errors_path
        self.stats_path = stats_path
        self.servers = servers
        self.model = model
        self.gen = gen
        self.retry = RetryPolicy.from_settings(gen)
        self.api_key = api_key
        self.fingerprint = fingerprint
        self.max_error_fraction = max_error_fraction
        self.progress = progress
        self.max_errors = int(max_error_fraction * len(prompts))
        # Request body without the messages: encoded once, spliced around each prompt's messages.
        body = {"model": model, "max_tokens": gen["max_tokens"], "temperature": gen["temperature"],
                "top_p": gen["top_p"], "seed": gen["seed"], "return_token_ids": True}
        if gen["chat_template_kwargs"] is not None:
            body["chat_template_kwargs"] = gen["chat_template_kwargs"]
        body.update(gen["extra_body"] or {})
        body["return_token_ids"] = True
        body.pop("messages", None)
        self.body_head = b'{"messages":'
        self.body_tail = b"," + json.dumps(body, separators=(",", ":")).encode()[1:]
        self.index = {}          # id -> (offset, length) of its line in the partial file
        self.errors = []         # this run's failed requests: {id, status, body, server, attempts}
        self.latencies = []      # this run's answers
        self.totals = dict(prompt_tokens=0, completion_tokens=0, reasoning_tokens=0, truncated=0,
                           no_reasoning=0, empty_content=0)
        self.reasoning_reported = False
        self.completed = self.resumed = self.retries = 0
        self.new_completion_tokens = 0
        self.stopping = False    # no new requests (error budget spent); in-flight ones finish
        self.first_success = False
        self.pbar = None
        self.next_postfix = 0.0
        self.partial = None

    # -- the run ----------------------------------------------------------------------------

    async def main(self):
        t0 = time.monotonic()
        self._open_partial()
        failure = None
        try:
            todo = [p for p in self.prompts if p["id"] not in self.index]
            if todo:
                failure = await self._send_all(todo)
        finally:
            if self.pbar is not None:
                self._postfix(time.monotonic())
                self.pbar.close()
            self.partial.close()  # flushed per record already; closing releases the lock
        wall = time.monotonic() - t0
        if failure is None and len(self.errors) > self.max_errors:
            first = self.errors[0]
            what = f"HTTP {first['status']}{auth_hint(first['status'], self.api_key)}" if first["status"] else "no answer"
            failure = (f"{self.shard}: {len(self.errors)} of {len(self.prompts)} requests failed "
                       f"(more than {self.max_error_fraction:.0%}); first: {what} from {first['server']}: "
                       f"{first['body'][:300]}; all of them are in {self.errors_path}; "
                       f"finished records are kept in {self.partial_path}; fix the cause and rerun")
        stats = self._stats(wall, complete=failure is None)
        write_atomic(self.errors_path, b"".join(_json_line(e) for e in self.errors))
        write_atomic(self.stats_path, stats)
        say(self._summary(stats))
        if failure is not None:
            raise TracesError(failure)
        self._write_output()
        self._link_partial_to_output()
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

    async def _worker(self, queue):
        for prompt in queue:
            await self._request(prompt)
            if self.stopping:
                return

    async def _request(self, prompt):
        g = self.gen
        data = self.body_head + json.dumps(prompt["messages"], separators=(",", ":")).encode() + self.body_tail
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
                    self._finish(prompt, raw, server, time.monotonic() - start, attempt)
                    return
                body = raw[:ERROR_BODY_CHARS].decode("utf-8", "replace")
                if status not in RETRY_STATUSES:
                    self._fail(prompt, status, body, server, attempt)
                    return
                failure = f"HTTP {status}: {body[:200]}"
            finally:
                server.outstanding -= 1
            if self.stopping:
                return  # the shard has failed already; this prompt is sent again on the rerun
            if attempt > g["max_retries"]:
                if status is None and all(s.down_since is not None for s in self.servers):
                    raise TracesError(self._servers_down_message())
                self._fail(prompt, status, f"gave up after {attempt} attempts; last: {failure}", server, attempt)
                return
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
        server.failures += 1
        server.last_failure = failure
        server.probe_at = now + self._backoff(server.failures, None)

    def _backoff(self, attempt, retry_after):
        return self.retry.delay(attempt, retry_after)

    def _finish(self, prompt, raw, server, latency, attempt):
        try:
            answer = json.loads(raw)
            choice = answer["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            self._fail(prompt, 200, "unexpected answer: " + raw[:ERROR_BODY_CHARS].decode("utf-8", "replace"),
                       server, attempt)
            return
        completion_ids = choice.get("token_ids")
        prompt_ids = answer.get("prompt_token_ids")
        if completion_ids is None or prompt_ids is None:
            raise TracesError(
                f"{self.shard}: server at {server.url} answered without token ids; eaglenest needs a vLLM "
                "server that supports return_token_ids (the exact tokens of prompt and answer)")
        reasoning = reasoning_of(message)
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
        line = _json_line(record)
        self.partial.write(line)
        self.partial.flush()
        self.index[prompt["id"]] = (self.partial_end, len(line))
        self.partial_end += len(line)
        server.answered += 1
        self.first_success = True
        self.completed += 1
        self.latencies.append(latency)
        self.new_completion_tokens += len(completion_ids)
        self._count(record)
        if self.pbar is not None:
            self.pbar.update(1)
            now = time.monotonic()
            if now >= self.next_postfix:
                self._postfix(now)

    def _postfix(self, now):
        if not self.pbar.disable:
            self.next_postfix = now + 1.0
            rate = self.new_completion_tokens / max(now - self.t_send, 1e-9)
            self.pbar.set_postfix_str(f"{rate:,.0f} tok/s, {len(self.errors)} errors, {self.retries} retries",
                                      refresh=False)

    def _fail(self, prompt, status, body, server, attempts):
        self.errors.append({"id": prompt["id"], "status": status, "body": body, "server": server.url,
                            "attempts": attempts})
        if len(self.errors) > self.max_errors:
            self.stopping = True  # the shard has failed: let in-flight requests finish, send no more

    def _count(self, record):
        t = self.totals
        t["prompt_tokens"] += len(record.get("prompt_token_ids") or ())
        t["completion_tokens"] += len(record.get("completion_token_ids") or ())
        details = (record.get("usage") or {}).get("completion_tokens_details") or {}
        if details.get("reasoning_tokens") is not None:
            self.reasoning_reported = True
            t["reasoning_tokens"] += details["reasoning_tokens"]
        t["truncated"] += bool(record.get("truncated"))
        t["no_reasoning"] += not record.get("reasoning")
        t["empty_content"] += not record.get("content")

    def _servers_down_message(self):
        down = [s for s in self.servers if s.down_since is not None]
        where = "server at " + down[0].url if len(down) == 1 else "servers at " + ", ".join(s.url for s in down)
        are = "is" if len(down) == 1 else "are"
        why = down[0].last_failure
        kept = f"finished records are kept in {self.partial_path}" if self.index else "nothing was finished"
        if self.first_success:
            return (f"{self.shard}: {where} stopped answering ({why}) after {self.completed} finished records; "
                    f"{kept}; restart the server and rerun")
        return f"{self.shard}: {where} {are} not answering ({why}); {kept}; start the server (or fix the URL) and rerun"

    # -- files ------------------------------------------------------------------------------

    def _open_partial(self):
        """Open (and lock) the partial file, drop a torn last line, index the finished records."""
        self.partial_path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_locked(self.partial_path, TracesError(
            f"{self.shard}: another process is writing {self.partial_path}; "
            "wait for it to finish (or stop it) before rerunning this shard"))
        f = os.fdopen(fd, "r+b")
        wanted = {p["id"] for p in self.prompts}
        offset = bad = 0
        for line in f:
            if not line.endswith(b"\n"):
                break  # torn by a crash mid-write: dropped below
            try:
                record = json.loads(line)
                rid = record["id"]
            except (ValueError, KeyError, TypeError):
                bad += 1  # a complete but unreadable line: its prompt is sent again
            else:
                if rid in wanted and rid not in self.index:
                    self.index[rid] = (offset, len(line))
                    self._count(record)
            offset += len(line)
        f.truncate(offset)
        f.seek(offset)
        self.partial_end = offset
        self.partial = f
        self.resumed = len(self.index)
        if bad:
            say(f"{self.shard}: skipped {bad} unreadable lines in {self.partial_path}; "
                "their prompts are sent again")

    def _write_output(self):
        """Copy the finished records into the output, in prompt order, atomically."""
        out = self.output_path
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
        with open(self.partial_path, "rb") as src, open(tmp, "wb") as dst:
            fd = src.fileno()
            for p in self.prompts:
                where = self.index.get(p["id"])
                if where is not None:
                    dst.write(os.pread(fd, where[1], where[0]))
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, out)
        _fsync_dir(out.parent)

    def _link_partial_to_output(self):
        """Keep the finished shard resumable without a second copy on disk."""
        link = self.partial_path.with_name(self.partial_path.name + ".link")
        try:
            link.unlink(missing_ok=True)
            os.link(self.output_path, link)
            os.replace(link, self.partial_path)
        except OSError:
            pass  # another filesystem: the partial file itself holds the same records

    # -- reporting --------------------------------------------------------------------------

    def _stats(self, wall, complete):
        lat = sorted(self.latencies)
        t = self.totals
        return {
            "shard": self.shard,
            "complete": complete,
            "requests": len(self.prompts),
            "completed": self.completed,
            "resumed": self.resumed,
            "errors": len(self.errors),
            "retries": self.retries,
            # over every record of the shard (resumed ones included)
            "records": len(self.index),
            "prompt_tokens": t["prompt_tokens"],
            "completion_tokens": t["completion_tokens"],
            "reasoning_tokens": t["reasoning_tokens"] if self.reasoning_reported else None,
            "truncated": t["truncated"],
            "no_reasoning": t["no_reasoning"],
            "empty_content": t["empty_content"],
            # this run only
            "latency_mean_s": round(sum(lat) / len(lat), 4) if lat else None,
            "latency_p50_s": round(_percentile(lat, 0.50), 4) if lat else None,
            "latency_p95_s": round(_percentile(lat, 0.95), 4) if lat else None,
            "wall_s": round(wall, 3),
            "requests_per_s": round(self.completed / wall, 3) if wall > 0 else None,
            "completion_tokens_per_s": round(self.new_completion_tokens / wall, 1) if wall > 0 else None,
            "generated_tokens": self.new_completion_tokens,
            "urls": [s.url for s in self.servers],
            "answered_per_url": {s.url: s.answered for s in self.servers},
            "model": self.model,
            "fingerprint": self.fingerprint,
        }

    def _summary(self, s):
        resumed = f", {s['resumed']} resumed" if s["resumed"] else ""
        return (f"{self.shard}: {s['completed']} answers ({s['truncated']} truncated, {s['errors']} errors, "
                f"{s['retries']} retries{resumed}), {s['generated_tokens']} tokens in {s['wall_s']:.1f} s "
                f"({s['requests_per_s'] or 0:.1f} req/s, {s['completion_tokens_per_s'] or 0:.0f} tok/s)")


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


def _read_prompts(path):
    """The shard's prompts, in order, first occurrence of each id."""
    prompts, seen = [], set()
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TracesError(f"cannot read prompt shard {path}: {e.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                p = json.loads(line)
                ok = isinstance(p, dict) and isinstance(p.get("id"), str) and isinstance(p.get("messages"), list) \
                    and all(isinstance(m, dict) and "role" in m and "content" in m for m in p["messages"])
            except ValueError:
                ok = False
            if not ok:
                raise TracesError(f"{path}:{n}: not a prompt record (want JSON with 'id' and 'messages' "
                                  "[{role, content}, ...]); regenerate the prompt shards")
            if p["id"] not in seen:
                seen.add(p["id"])
                prompts.append(p)
    return prompts


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


def _stem(path):
    name = path.name
    return name[: -len(".jsonl")] if name.endswith(".jsonl") else path.stem


def _sibling(output_path, suffix):
    return output_path.with_name(_stem(output_path) + suffix)


def _json_line(obj):
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _percentile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def write_stats_table(stats_paths, out_csv):
    """The per-shard trace statistics (``traces/shard_{i}.stats.json``) as one table, a row per shard
    and a column per figure (nested ones flattened as ``a.b``), written as CSV for notebooks; returns the
    pandas DataFrame."""
    import pandas as pd

    rows = [{"shard": _stem(Path(p)).removesuffix(".stats"), **json.loads(Path(p).read_text())} for p in stats_paths]
    table = pd.json_normalize(rows)
    write_atomic(out_csv, table.to_csv(index=False))
    return table
