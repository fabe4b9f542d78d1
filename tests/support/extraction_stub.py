"""A stub of vLLM's extraction server, for faults real vLLM cannot be made to produce on demand (the tests
that use it say which): it answers like vLLM 0.32's ``/v1/completions`` with the connector's per-request
states file (``vllm_answer``: ``kv_transfer_params.hidden_states_path``, ``prompt_logprobs`` and the
generated ``token_ids``); its "greedy tokens" are a fixed function of the token ids (``stub_greedy``).
``StubExtractionServer`` writes random states, ``SeededStub`` states seeded by the token ids."""
import asyncio
import json
import threading
import zlib

import torch
from aiohttp import web
from safetensors.torch import save_file

from tests.support.servers import free_port


def stub_greedy(ids):
    """The stub target's "greedy next token" from each position: a fixed function of the token there."""
    return [(t * 7 + 3) % 100 for t in ids]


def vllm_answer(ids, path, greedy):
    """vLLM 0.32's answer to the client's request (``prompt_logprobs: 1``, ``return_token_ids``,
    ``max_tokens: 1``) for prompt ``ids`` whose greedy next tokens are ``greedy``: ``prompt_logprobs[0]``
    null, then per token i the prompt token's entry (first, with its rank) and, where it is not the
    top-1, the top-1 at rank 1, keyed by token id; ``token_ids`` the greedy token generated."""
    entries = [None]
    for i in range(1, len(ids)):
        entry = {str(ids[i]): {"logprob": -2.5, "rank": 2 + ids[i] % 3, "decoded_token": "b"}}
        entry[str(greedy[i - 1])] = {"logprob": -0.25, "rank": 1, "decoded_token": "a"}
        entries.append(entry)
    return {"choices": [{"index": 0, "text": "a", "token_ids": [greedy[-1]], "prompt_logprobs": entries}],
            "kv_transfer_params": {"hidden_states_path": str(path)}}


class StubExtractionServer:
    """Writes ``hidden_states [T, layers, H]`` and ``token_ids`` per request, like the connector;
    ``corrupt(ids) -> ids`` may change the token ids it writes; ``outside`` writes elsewhere;
    ``no_logprobs`` answers without ``prompt_logprobs`` (a server that ignores the field)."""

    def __init__(self, storage, layers, hidden, corrupt=None, outside=None, no_logprobs=False, busy=0):
        self.storage, self.layers, self.hidden = storage, layers, hidden
        self.corrupt, self.outside, self.requests, self.no_logprobs = corrupt, outside, 0, no_logprobs
        self.busy = busy  # the first `busy` requests are answered 503 with Retry-After: 0 (vLLM overloaded)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def completions(self, request):
        body = await request.json()
        self.requests += 1
        if self.requests <= self.busy:
            return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": "0"})
        ids = list(body["prompt"])
        rid = request.headers.get("X-Request-Id", "x")
        path = (self.outside or self.storage) / f"cmpl-{rid}-0.safetensors"
        written = self.corrupt(ids) if self.corrupt else ids
        save_file({"hidden_states": torch.randn(len(written), self.layers, self.hidden),
                   "token_ids": torch.tensor(written)}, str(path))
        answer = vllm_answer(ids, path, stub_greedy(ids))
        if self.no_logprobs:
            del answer["choices"][0]["prompt_logprobs"]
        return web.json_response(answer)

    def __enter__(self):
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class SeededStub(StubExtractionServer):
    """States seeded by the token ids (greedy tokens: ``stub_greedy``, answered as vLLM does); once
    ``dead()`` is true, every answer is a 503."""

    def __init__(self, *args, dead=None, **kw):
        super().__init__(*args, **kw)
        self.dead, self.asked = dead, []

    async def completions(self, request):
        body = await request.json()
        ids = list(body["prompt"])
        if self.dead is not None and self.dead():
            return web.json_response({"error": "engine dead"}, status=503)
        self.requests += 1
        self.asked.append(tuple(ids))
        g = torch.Generator().manual_seed(zlib.crc32(json.dumps(ids).encode()))
        path = self.storage / f"cmpl-{request.headers.get('X-Request-Id', 'x')}-0.safetensors"
        save_file({"hidden_states": torch.randn(len(ids), self.layers, self.hidden, generator=g),
                   "token_ids": torch.tensor(ids)}, str(path))
        return web.json_response(vllm_answer(ids, path, stub_greedy(ids)))
