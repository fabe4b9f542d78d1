"""A stub OpenAI-compatible chat server that answers like vLLM.

It is used only to inject faults that a real vLLM server cannot be made to produce on demand
(429/503 bursts, 400s for chosen prompts, an old server's `reasoning_content`, truncation, slowness,
a server that dies mid-shard, a server without `return_token_ids`) and to benchmark the client
alone. It is no model: the end-to-end tests against real vLLM live elsewhere.

Answers are deterministic functions of the request (messages, max_tokens), shaped like vLLM 0.32's
with `return_token_ids: true`: `choices[0].message.{content,reasoning}`, `choices[0].token_ids`,
top-level `prompt_token_ids`, `usage`, `finish_reason`. A "token" is one character's code point.

In process (a thread with its own event loop):

    with StubServer(delay=0.05, reject_match="TOO_LONG") as stub:
        stub.url                    # http://127.0.0.1:<free port>
        stub.answered, stub.requests

As a process (prints `LISTENING <port>` on stdout once it accepts connections):

    python tests/stub_server.py --port 0 --mode fixed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading

from aiohttp import web

MODEL = "stub-model"
MAX_MODEL_LEN = 4096
VERSION = "0.0.0-stub"


class StubServer:
    """Options (attributes; they may be changed while the server runs):

    mode            "echo": answer derived from the prompt; "fixed": one small pre-encoded answer
                    (benchmark: no per-request work beyond reading the body)
    delay           seconds before each answer
    answer_tokens   completion length before max_tokens truncation (echo mode)
    fail_times      answer `fail_status` this many times per prompt before succeeding
    fail_status     429 or 503 (any status works)
    fail_match      only prompts containing this substring fail (None: all prompts)
    retry_after     value of the Retry-After header on those failures (None: no header)
    reject_match    prompts containing this substring get a vLLM-style 400 (context too long)
    reasoning_field "reasoning" (vLLM >= 0.10), "reasoning_content" (older vLLM, SGLang) or None
    token_ids       False: ignore return_token_ids, like a server that does not support it
    die_after       after this many answers, stop listening and drop every connection
    api_key         if set, requests without `Authorization: Bearer <api_key>` get 401, like vLLM --api-key
    """

    def __init__(self, *, port=0, mode="echo", delay=0.0, answer_tokens=48, fail_times=0,
                 fail_status=503, fail_match=None, retry_after=None, reject_match=None,
                 reasoning_field="reasoning", token_ids=True, die_after=None, api_key=None, on_die=None):
        self.port = port
        self.mode = mode
        self.delay = delay
        self.answer_tokens = answer_tokens
        self.fail_times = fail_times
        self.fail_status = fail_status
        self.fail_match = fail_match
        self.retry_after = retry_after
        self.reject_match = reject_match
        self.reasoning_field = reasoning_field
        self.token_ids = token_ids
        self.die_after = die_after
        self.api_key = api_key
        self.on_die = on_die          # called after dying (the process mode exits)
        self.requests = 0             # chat requests received
        self.answered = 0             # 200 answers sent
        self.failures = {}            # prompt text -> injected failures sent
        self.per_prompt = {}          # prompt text -> chat requests received
        self.last_body = None         # the last chat request, decoded (echo mode)
        self.authorizations = set()   # Authorization headers seen
        self.dead = False
        self._transports = set()
        self._fixed = _fixed_answer()
        self._loop = None
        self._thread = None
        self._runner = None
        self._site = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    # -- serving ------------------------------------------------------------------------------

    def app(self):
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/health", self._health)
        return app

    async def start_async(self):
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False,
                                     shutdown_timeout=0.5)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, backlog=1024)
        await self._site.start()
        self.port = self._runner.addresses[0][1]

    async def stop_async(self):
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start(self):
        """Serve from a background thread; returns once the port accepts connections."""
        ready = threading.Event()
        failed = []

        def serve():
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self.start_async())
            except BaseException as e:  # pragma: no cover - reported to the caller below
                failed.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self.stop_async())
            self._loop.close()

        self._thread = threading.Thread(target=serve, name=f"stub-{self.port}", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failed:
            raise failed[0]
        return self

    def stop(self):
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- handlers -----------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request, handler):
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _chat(self, request):
        self.requests += 1
        if self.dead:
            request.transport.abort()
            return web.Response(status=503)
        self._transports.add(request.transport)
        raw = await request.read()
        if self.mode == "fixed":
            self.answered += 1
            return web.Response(body=self._fixed, content_type="application/json")
        body = self.last_body = json.loads(raw)
        self.authorizations.add(request.headers.get("Authorization"))
        if body.get("model") != MODEL:
            return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        messages = body["messages"]
        text = "".join(m["content"] for m in messages)
        self.per_prompt[text] = self.per_prompt.get(text, 0) + 1
        if self.reject_match is not None and self.reject_match in text:
            return _error(400, f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
                          f"However, your request has {MAX_MODEL_LEN + 1} input tokens.", "BadRequestError")
        if self.fail_times and (self.fail_match is None or self.fail_match in text):
            sent = self.failures.get(text, 0)
            if sent < self.fail_times:
                self.failures[text] = sent + 1
                headers = {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}
                return _error(self.fail_status, "injected failure", "ServiceUnavailableError", headers)
        if self.delay:
            await asyncio.sleep(self.delay)
        answer = self._answer(messages, body.get("max_tokens") or 1 << 30, body.get("return_token_ids"))
        self.answered += 1
        response = web.json_response(answer)
        if self.die_after is not None and self.answered >= self.die_after:
            # Send this last answer in full, then die.
            await response.prepare(request)
            await response.write_eof()
            self._transports.discard(request.transport)
            request.transport.close()
            self._die()
        return response

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "owned_by": "vllm", "root": MODEL, "max_model_len": MAX_MODEL_LEN}]})

    async def _version(self, request):
        return web.json_response({"version": VERSION})

    async def _health(self, request):
        return web.Response(status=200)

    def _die(self):
        """Stop listening (new connections are refused) and drop every open connection."""
        if self.dead:
            return
        self.dead = True
        if self._site is not None and self._site._server is not None:
            self._site._server.close()
        for transport in self._transports:
            transport.abort()
        self._transports.clear()
        if self.on_die is not None:
            asyncio.get_running_loop().call_later(0.1, self.on_die)

    def _answer(self, messages, max_tokens, return_token_ids):
        prompt = "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"
        last = messages[-1]["content"]
        reasoning = f"Think about {last!r} step by step. "
        reasoning = (reasoning * (1 + self.answer_tokens // len(reasoning)))[: self.answer_tokens // 2]
        content = f"Answer to {last!r}: {len(last)}."
        full = "<think>" + reasoning + "</think>" + content
        finish_reason = "stop"
        if len(full) > max_tokens:
            full = full[:max_tokens]
            finish_reason = "length"
        # Split the (possibly truncated) completion back into reasoning and content, as a
        # reasoning parser would.
        if "</think>" in full:
            reasoning, content = full[len("<think>"):].split("</think>", 1)
        else:
            reasoning, content = full[len("<think>"):], ""
        message = {"role": "assistant", "content": content, "tool_calls": []}
        if self.reasoning_field:
            message[self.reasoning_field] = reasoning
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": None}
        answer = {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": MODEL,
                  "choices": [choice],
                  "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(full),
                            "total_tokens": len(prompt) + len(full), "prompt_tokens_details": None},
                  "prompt_logprobs": None}
        if return_token_ids and self.token_ids:
            choice["token_ids"] = [ord(c) for c in full]
            answer["prompt_token_ids"] = [ord(c) for c in prompt]
        return answer


def _error(status, message, kind, headers=None):
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response({"error": body}, status=status, headers=headers)


def _fixed_answer():
    """One small vLLM-shaped answer, encoded once (benchmark mode)."""
    full = "<think>ok</think>Yes."
    answer = {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": MODEL,
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Yes.",
                                                   "reasoning": "ok", "tool_calls": []},
                           "logprobs": None, "finish_reason": "stop", "stop_reason": None,
                           "token_ids": [ord(c) for c in full]}],
              "usage": {"prompt_tokens": 12, "completion_tokens": len(full), "total_tokens": 12 + len(full)},
              "prompt_logprobs": None, "prompt_token_ids": list(range(12))}
    return json.dumps(answer).encode()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=0, help="0: a free port (printed as LISTENING <port>)")
    p.add_argument("--mode", choices=["echo", "fixed"], default="echo")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--fail-times", type=int, default=0)
    p.add_argument("--fail-status", type=int, default=503)
    p.add_argument("--fail-match")
    p.add_argument("--retry-after")
    p.add_argument("--reject-match")
    p.add_argument("--reasoning-field", default="reasoning",
                   help="reasoning | reasoning_content | none")
    p.add_argument("--no-token-ids", action="store_true")
    p.add_argument("--die-after", type=int)
    p.add_argument("--api-key")
    a = p.parse_args(argv)
    stub = StubServer(port=a.port, mode=a.mode, delay=a.delay, answer_tokens=a.answer_tokens,
                      fail_times=a.fail_times, fail_status=a.fail_status, fail_match=a.fail_match,
                      retry_after=a.retry_after, reject_match=a.reject_match,
                      reasoning_field=None if a.reasoning_field == "none" else a.reasoning_field,
                      token_ids=not a.no_token_ids, die_after=a.die_after, api_key=a.api_key,
                      on_die=lambda: os._exit(0))
    try:
        import uvloop  # the benchmark wants the stub to be cheap; optional
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    loop.run_until_complete(stub.start_async())
    print(f"LISTENING {stub.port}", flush=True)
    try:
        loop.run_forever()
    except KeyboardInterrupt:
        pass
    finally:
        loop.run_until_complete(stub.stop_async())


if __name__ == "__main__":
    sys.exit(main())
