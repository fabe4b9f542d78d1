"""An ASGI middleware vLLM loads (`--middleware eaglenest.serving.guard.RequireApiKey`) so that a server
with an API key refuses every route without it, not only vLLM's guarded prefixes.

vLLM 0.32 checks its key (VLLM_API_KEY) only on paths under /v1, /v2, /inference and /cohere. Measured
on the toy target with the key set: POST /invocations (the SageMaker route, which dispatches to chat
completions) answered a chat completion without any key, and POST /tokenize answered too. This
guard requires `Authorization: Bearer <VLLM_API_KEY>` on every path but /health (a liveness answer,
no model output). It runs inside the vLLM process: standard library only, imported from this
checkout through PYTHONPATH (the workflow sets it for every server it starts).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets

OPEN_PATHS = ("/health",)


class RequireApiKey:
    """Pure ASGI middleware: 401 for any HTTP or WebSocket request without the bearer key."""

    def __init__(self, app) -> None:
        key = os.environ.get("VLLM_API_KEY")
        if not key:  # started without a key: refuse to serve at all rather than serve openly
            raise RuntimeError("eaglenest.serving.guard.RequireApiKey: VLLM_API_KEY is not set")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    hashlib.sha256(token.strip().encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
