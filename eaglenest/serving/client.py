"""The async HTTP client of the workflow's bulk requests: the traces (chat completions, eaglenest.data.traces)
and vLLM's hidden-state extraction (completions, eaglenest.states.extract), hundreds in flight.

What both share lives here once: the aiohttp session (the key in its headers, no proxy, no cookies,
keep-alive shorter than the server's), the retry and back-off policy (configurable for both:
``generation.*`` and ``hidden.*`` keys of the same names), the hint for a refused key, the words for
a failed connection, and the bounded pool of workers that takes the next item as one finishes.
Synchronous probes go through requests (eaglenest.serving.probe).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import aiohttp

from ..settings import GenerationSettings, HiddenSettings, QuestionSettings
from .probe import describe_os_error
from .settings import key_hint

# Statuses worth another attempt: the server is busy or restarting, not refusing the request.
RETRY_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
# vLLM's HTTP server (uvicorn) closes idle connections after 5 s: reusing one it is closing costs a retry.
KEEPALIVE_S = 4.0
# A GET of /v1/models before the bulk requests: an answer is quick or not coming.
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=30)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a request: ``max_retries`` after the first attempt, waiting
    ``backoff_base`` s doubled per attempt up to ``backoff_max`` (jittered), or what Retry-After says."""

    max_retries: int
    backoff_base: float = 1.0
    backoff_max: float = 60.0

    @classmethod
    def from_settings(cls, settings: GenerationSettings | QuestionSettings | HiddenSettings) -> "RetryPolicy":
        """The policy a stage's settings give its client: ``generation.*`` (the traces, validation's requests, the
        questions) or ``hidden.vllm.*`` (the extraction)."""
        return cls(settings.max_retries, settings.backoff_base, settings.backoff_max)

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (``attempt`` counts from 1)."""
        if retry_after is not None:
            seconds = retry_after_seconds(retry_after)
            if seconds is not None:
                return min(seconds, 600.0)
        delay = min(self.backoff_max, self.backoff_base * 2 ** (attempt - 1))
        return delay * random.uniform(0.5, 1.0)  # jitter: replicas' clients must not retry in lockstep


def open_session(api_key: str | None, concurrency: int, request_timeout: float) -> aiohttp.ClientSession:
    """The session for ``concurrency`` requests in flight to one server (enter it in the running loop)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=min(30.0, request_timeout))
    return aiohttp.ClientSession(headers=headers, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar(),
                                 connector=aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=KEEPALIVE_S))


def auth_hint(status: int | None, api_key: str | None) -> str:
    """What an error status most likely means here, for error messages: for 401/403 what to do about
    the key, for 404 the model name or URL; empty otherwise."""
    if status in (401, 403):
        return f" (refused: {key_hint(api_key)})"
    return {404: " (check the model name and URL)"}.get(status, "")


def retry_after_seconds(value: str) -> float | None:
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError):
        return None


def describe_client_error(e: BaseException, request_timeout: float, key: str = "generation.request_timeout") -> str:
    """A failed request's cause in a few words (``key``: the setting that bounds its wait)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        return describe_os_error(e.os_error)
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "server disconnected"
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return f"no answer within {request_timeout:g} s ({key})"
    return str(e) or type(e).__name__


CONNECTION_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
# Failures that say the server itself is gone (not just this request): mark it down.
CONNECTION_LOST = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


async def run_workers(items, work, concurrency: int) -> None:
    """Run ``await work(item)`` over ``items`` with at most ``concurrency`` at a time: each worker takes
    the next item as it finishes one. The first exception stops the others and is raised; so is a
    cancellation from outside (KeyboardInterrupt), after the workers have stopped."""
    queue = iter(items)  # shared by the workers; safe: one thread, no await between next() calls
    todo = len(items) if hasattr(items, "__len__") else concurrency

    async def worker():
        for item in queue:
            if await work(item) is False:
                return

    workers = [asyncio.create_task(worker()) for _ in range(max(0, min(concurrency, todo)))]
    if not workers:
        return
    try:
        done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    for w in done:
        if not w.cancelled() and w.exception() is not None:
            raise w.exception()
