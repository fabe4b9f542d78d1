"""Synchronous HTTP to a server, through requests: readiness probes (/v1/models, /version), the
sentinel's re-check and reads such as /metrics.

One ``requests.Session`` per server (base URL and key): keep-alive across polls, the key in its
headers. The session ignores proxies from the environment (``trust_env = False``): these calls go to
the server's own URL, as the async client's do. Failures keep requests' exceptions, which are
``OSError``s (connection refused, timeout), except a refused key: ServerError naming the key to set.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from urllib.parse import urlsplit

import requests

from ..errors import ServerError
from ..util import say
from .settings import key_hint


@functools.lru_cache(maxsize=None)
def session(base_url: str, api_key: str | None = None) -> requests.Session:
    """The one session for the server at ``base_url`` (scheme://host:port) with ``api_key``."""
    s = requests.Session()
    s.trust_env = False  # no proxy (nor .netrc) from the environment for the server's own URL
    if api_key:
        s.headers["Authorization"] = f"Bearer {api_key}"
    return s


def get(url: str, api_key: str | None = None, timeout: float = 30.0) -> requests.Response:
    """GET ``url`` straight from its server. Raises ServerError when the key is refused (401/403),
    requests' HTTPError for another error status, and requests' OSError family when it does not answer."""
    parts = urlsplit(url)
    resp = session(f"{parts.scheme}://{parts.netloc}", api_key).get(url, timeout=timeout)
    if resp.status_code in (401, 403):
        raise ServerError(f"{url} refused the request (HTTP {resp.status_code}): " + key_hint(api_key))
    resp.raise_for_status()
    return resp


def get_text(url: str, api_key: str | None = None, timeout: float = 30.0) -> str:
    """The body of GET ``url`` as text (as ``get``, for /metrics and the like)."""
    return get(url, api_key, timeout).text


def probe(url: str, api_key: str | None = None, timeout: float = 5.0) -> dict:
    """GET /v1/models (and /version). Returns {models, max_model_len, version}; raises OSError-family
    errors (connection refused, timeout), ValueError for an answer that is not JSON and ServerError
    for a refused key."""
    listing = get(f"{url}/v1/models", api_key, timeout).json()
    entries = (listing.get("data") if isinstance(listing, dict) else None) or []
    models = [m.get("id") for m in entries]
    max_len = {m.get("id"): m.get("max_model_len") for m in entries}
    version = None
    try:
        version = get(f"{url}/version", api_key, timeout).json().get("version")
    except (OSError, ValueError, AttributeError):
        pass
    return {"models": models, "max_model_len": max_len, "version": version}


def is_serving(url: str, model: str, api_key: str | None = None, timeout: float = 5.0) -> bool:
    try:
        return model in probe(url, api_key, timeout)["models"]
    except (OSError, ValueError, ServerError):
        return False


def describe_os_error(e: BaseException) -> str:
    """Why a connection failed, in a few words: "connection refused", "timed out", else the error's text.
    Looks through requests' and urllib3's wrappers for the socket error underneath."""
    if isinstance(e, requests.Timeout):
        return "timed out"
    seen = e
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return "connection refused"
        if isinstance(seen, TimeoutError):
            return "timed out"
        inner = seen.args[0] if seen.args and isinstance(seen.args[0], BaseException) else None
        seen = inner or getattr(seen, "reason", None) or seen.__context__
        if not isinstance(seen, BaseException):
            break
    if "Connection refused" in str(e):
        return "connection refused"
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def check_sentinel(sentinel_path: str | Path, api_key: str | None = None, log=say) -> dict:
    """Re-check that the servers a `server.ready` sentinel describes still answer with its model.

    A sentinel outlives its server (a crash, a stop); this turns that into one clear error when no
    server of it answers. Replicas (server.replicas) that no longer answer are dropped from the
    returned ``urls`` with a warning: the others take their requests. A server that refuses the key
    raises probe's ServerError, which says so, rather than calling it stale."""
    info = json.loads(Path(sentinel_path).read_text())
    dead = []
    for u in info["urls"]:
        try:
            if info["model"] not in probe(u, api_key)["models"]:
                dead.append(u)
        except (OSError, ValueError):
            dead.append(u)
    if len(dead) == len(info["urls"]):
        raise ServerError(
            f"{sentinel_path} is stale: the server at {', '.join(dead)} no longer serves "
            f"'{info['model']}'. Delete it and rerun, e.g. `rm {sentinel_path} && snakemake --cores all`, "
            f"so the workflow starts (or waits for) the server again.")
    if dead:
        log(f"WARNING: the replica(s) at {', '.join(dead)} no longer serve '{info['model']}': dropped; "
            f"the {len(info['urls']) - len(dead)} others take their requests")
        info["urls"] = [u for u in info["urls"] if u not in dead]
    return info
