"""The generation server's lifecycle: launch vLLM, wait until it serves, check it, stop it.

Modes (docs/dag.md, "Server lifecycle"): `local` starts vLLM in its own process group with a pidfile
and a log; `slurm` submits it as its own SLURM job (eaglenest.slurm); `external` only polls URLs the
user gives. `start_server` and `stop_server` dispatch between them, for the rules and the workflow's
exit handlers alike; every mode launches vLLM with `launch_env`. The `server.ready` sentinel written
from `wait_ready`'s answer is JSON that describes the server; it can outlive the server, so
consumers call `check_sentinel` before use.

A server that listens beyond this machine (slurm mode binds 0.0.0.0; local mode with `server.host`
not a loopback address) always requires an API key: the user's (`server.api_key_env`), else a random
key made for the run (`run_key`), kept in a mode-0600 file under the mode-0700 `.eaglenest/` of the
working directory, which jobs on other nodes read through the shared working directory. The key
reaches vLLM by environment only (VLLM_API_KEY), never a command line, script, sentinel or log.

A local server is guarded by a watchdog process (`python -m eaglenest.server watch ...`) that stops
it when the workflow process that asked for it dies (kill -9, a crash of Snakemake itself), so a
server never outlives its workflow by accident. `keep_server: true` disables the watchdog.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import vllm_format
from .config import schema_field
from .errors import ConfigError, ServerError
from .gpus import nvidia_smi, visible_devices
from .util import say, write_atomic

# A GPU with more memory in use than this is taken to be busy (the driver alone holds a few MiB).
GPU_BUSY_MIB = 1024
STOP_GRACE_S = 30.0
# Snakemake sets these to a job's thread count; vLLM's CPU backend pins its worker to its own cores
# and, given OMP_NUM_THREADS=2 on a 2-core machine, ran 100x slower (21 vs 2100 tokens/s, measured).
# A server never inherits them; server.env can still set them.
# Addresses only this machine reaches: a server bound to anything else requires an API key.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
CHECKOUT = str(Path(__file__).resolve().parent.parent)  # the directory that holds the eaglenest package
# The run's own API key, relative to the working directory (which jobs on every node share).
RUN_KEY_FILE = Path(".eaglenest") / "api_key"
THREAD_ENV = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


@dataclass
class ServerConfig:
    """The `server:` section of the workflow config; schemas/config.schema.yaml documents each key
    and holds its default (the only place it is written)."""

    mode: str = schema_field("server", "mode")
    model: str = schema_field("server", "model")
    served_model_name: str | None = schema_field("server", "served_model_name")
    host: str = schema_field("server", "host")
    port: int = schema_field("server", "port")
    urls: list[str] = schema_field("server", "urls")
    tensor_parallel_size: int = schema_field("server", "tensor_parallel_size")
    max_model_len: int | None = schema_field("server", "max_model_len")
    reasoning_parser: str | None = schema_field("server", "reasoning_parser")
    gpu_memory_utilization: float | None = schema_field("server", "gpu_memory_utilization")
    kv_cache_gb: float | None = schema_field("server", "kv_cache_gb")
    dtype: str | None = schema_field("server", "dtype")
    extra_args: list[str] = schema_field("server", "extra_args")
    env: dict[str, str] = schema_field("server", "env")
    api_key_env: str | None = schema_field("server", "api_key_env")
    poll_interval: float = schema_field("server", "poll_interval")
    ready_timeout: float = schema_field("server", "ready_timeout")
    keep_server: bool = schema_field("server", "keep_server")
    python: str | None = schema_field("server", "python")  # interpreter that has vLLM; None: this one
    slurm: dict = schema_field("server", "slurm")  # mode slurm: slurm.SlurmSettings' keys

    @classmethod
    def from_dict(cls, d: dict) -> "ServerConfig":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @property
    def model_id(self) -> str:
        """The model name clients send: the served name, else the model path as vLLM reports it."""
        return self.served_model_name or self.model

    @property
    def local_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def base_urls(self) -> list[str]:
        if self.mode == "external":
            if not self.urls:
                raise ServerError("server.mode is 'external' but server.urls is empty: "
                                  "give the base URL(s) of the running server(s), e.g. http://host:8000")
            return [u.rstrip("/") for u in self.urls]
        return [self.local_url]

    @property
    def needs_key(self) -> bool:
        """Whether the server the workflow starts listens beyond this machine, so it must require a key:
        slurm mode (the job binds 0.0.0.0 for other nodes), or local mode on a non-loopback host."""
        return self.mode == "slurm" or (self.mode == "local" and self.host not in LOOPBACK_HOSTS)

    def api_key(self, create: bool = False) -> str | None:
        """The API key servers and clients use: the variable named by `api_key_env` (never stored), else,
        where a server listens beyond this machine, the run's own key (`run_key`; `create` makes it
        when missing: only what starts a server does), else None."""
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ServerError(f"server.api_key_env names ${self.api_key_env}, which is not set: "
                                  f"export it before running the workflow")
            return key
        return run_key(create=create) if self.needs_key else None


def run_key(create: bool = False) -> str:
    """The run's random API key from RUN_KEY_FILE under the working directory; `create` makes it first
    when missing (a 0600 file in a 0700 directory, linked into place whole, so concurrent starters
    agree on one key). Refuses a key file other users can read."""
    path = RUN_KEY_FILE.resolve()
    if create and not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        tmp = path.with_name(f".api_key.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_urlsafe(32).encode())
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another starter made it first: use theirs
        finally:
            tmp.unlink()
    try:
        mode = path.stat().st_mode & 0o777
        key = path.read_text().strip()
    except FileNotFoundError:
        raise ServerError(f"the server requires an API key (it listens beyond this machine) and no "
                          f"server.api_key_env is set, but the run's key {path} does not exist: the server "
                          f"was not started by this workflow in this directory. Delete server.ready and "
                          f"rerun, so the workflow starts the server (and its key) again") from None
    if mode & 0o077:
        raise ServerError(f"{path} (the run's API key) is readable by other users (mode {mode:o}): "
                          f"delete it (the next server start makes a new one) or `chmod 600` it")
    if not key:
        raise ServerError(f"{path} (the run's API key) is empty: delete it and rerun")
    return key


def forget_run_key() -> None:
    """Remove the run's key once no server of this run is left; the next run makes a new one."""
    RUN_KEY_FILE.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# HTTP probes


# Probes go straight to the server, as the aiohttp client does: no proxies from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get_text(url: str, api_key: str | None = None, timeout: float = 30.0) -> str:
    """GET ``url`` straight from the server (no proxy); raises the OSError family when it fails."""
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with _OPENER.open(req, timeout=timeout) as resp:
        return resp.read().decode()


def _get_json(url: str, api_key: str | None, timeout: float) -> dict:
    return json.loads(get_text(url, api_key, timeout))


def probe(url: str, api_key: str | None = None, timeout: float = 5.0) -> dict:
    """GET /v1/models (and /version). Returns {models, max_model_len, version}; raises OSError-family
    errors (connection refused, timeout) and ServerError for an answer that is not vLLM's."""
    try:
        listing = _get_json(f"{url}/v1/models", api_key, timeout)
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise ServerError(f"{url}/v1/models refused the request (HTTP {e.code}): "
                              + key_hint(api_key)) from e
        raise
    entries = (listing.get("data") if isinstance(listing, dict) else None) or []
    models = [m.get("id") for m in entries]
    max_len = {m.get("id"): m.get("max_model_len") for m in entries}
    version = None
    try:
        version = _get_json(f"{url}/version", api_key, timeout).get("version")
    except (OSError, ValueError):
        pass
    return {"models": models, "max_model_len": max_len, "version": version}


def key_hint(api_key: str | None) -> str:
    """What to do when a server answers 401/403: the key sent was missing or wrong."""
    what = "no API key was sent" if not api_key else "the API key sent is not the server's"
    return (f"{what}. A server the workflow starts beyond this machine uses the run's key "
            f"({RUN_KEY_FILE}) unless server.api_key_env names a variable holding one; for a server "
            f"started otherwise, set server.api_key_env to the variable that holds its key")


def is_serving(url: str, model: str, api_key: str | None = None, timeout: float = 5.0) -> bool:
    try:
        return model in probe(url, api_key, timeout)["models"]
    except (OSError, ValueError, ServerError):
        return False


def check_sentinel(sentinel_path: str | Path, api_key: str | None = None) -> dict:
    """Re-check that the servers a `server.ready` sentinel describes still answer with its model.

    A sentinel outlives its server (a crash, a stop); this turns that into one clear error. A server
    that refuses the key raises probe's ServerError, which says so, rather than calling it stale."""
    info = json.loads(Path(sentinel_path).read_text())
    dead = []
    for u in info["urls"]:
        try:
            if info["model"] not in probe(u, api_key)["models"]:
                dead.append(u)
        except (OSError, ValueError):
            dead.append(u)
    if dead:
        raise ServerError(
            f"{sentinel_path} is stale: the server at {', '.join(dead)} no longer serves "
            f"'{info['model']}'. Delete it and rerun, e.g. `rm {sentinel_path} && snakemake --cores all`, "
            f"so the workflow starts (or waits for) the server again.")
    return info


# ---------------------------------------------------------------------------------------------
# GPUs


def busy_gpus(devices: list[int] | None = None, threshold_mib: int = GPU_BUSY_MIB) -> list[str]:
    """Describe the GPUs among `devices` that already hold memory, with the processes holding it.

    Empty when nvidia-smi is absent (a CPU machine) or every GPU is free."""
    gpus = nvidia_smi("--query-gpu=index,uuid,memory.used,memory.total")
    apps = nvidia_smi("--query-compute-apps=gpu_uuid,pid,process_name,used_memory")
    busy = []
    for index, uuid, used, total in gpus:
        if devices is not None and int(index) not in devices:
            continue
        if float(used) > threshold_mib:
            procs = [f"pid {pid} {name} ({mem} MiB)" for g, pid, name, mem in apps if g == uuid]
            busy.append(f"GPU {index}: {used}/{total} MiB in use"
                        + (f" by {', '.join(procs)}" if procs else ""))
    return busy


def gpu_memory_summary() -> str | None:
    """One line of GPU memory in use, a second readiness signal while a big model loads."""
    rows = nvidia_smi("--query-gpu=index,memory.used")
    return " ".join(f"gpu{i}:{m}MiB" for i, m in rows) or None


def _server_devices(cfg: ServerConfig) -> list[int]:
    visible = cfg.env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    if visible:
        return visible_devices(visible)
    return list(range(cfg.tensor_parallel_size))


# ---------------------------------------------------------------------------------------------
# Local launch and stop


def looks_like_local_path(model: str) -> bool:
    """Whether `server.model` names a local path rather than a hub id (`org/name`).

    A path: it starts with / ./ ../ or ~, has more than one slash (a hub id has one), or its first
    component is a directory here (`toy/target`). `org/name` with no `org` directory is a hub id."""
    if model.startswith(("/", "./", "../", "~")) or model in (".", ".."):
        return True
    parts = model.split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def check_model_path(model: str, key: str = "server.model") -> None:
    """Fail at once, naming the path, when `model` is a local path that does not exist (vLLM would
    first try the hub with it and fail half a minute later)."""
    if model and looks_like_local_path(model) and not Path(model).expanduser().exists():
        raise ConfigError(f"{key} is {model!r}, a local path that does not exist "
                          f"({Path(model).expanduser().resolve()}): fix the path, or give a hub name "
                          f"such as org/name")


def launch_env(cfg: ServerConfig, api_key: str | None, drop_prefixes: tuple[str, ...] = ()) -> dict:
    """The environment every vLLM server starts with, in every mode: this process's, without the
    job's thread-count variables (THREAD_ENV) and any `drop_prefixes`, then `server.env`."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV and not k.startswith(drop_prefixes)}
    env.update({k: str(v) for k, v in cfg.env.items()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    if api_key:
        env["VLLM_API_KEY"] = api_key  # vLLM reads it; never on the command line or in the log
        # vLLM imports the key guard (KEY_GUARD) from this checkout, whatever server.env's PYTHONPATH says.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (CHECKOUT, env.get("PYTHONPATH")) if p)
    return env


# vLLM checks its key only under /v1, /v2, /inference, /cohere; this guard covers every other route
# (eaglenest/vllm_guard.py says what was open without it).
KEY_GUARD = "eaglenest.vllm_guard.RequireApiKey"


def vllm_command(cfg: ServerConfig) -> list[str]:
    """The command line that starts vLLM's OpenAI server (built in vllm_format), plus the key guard
    where the server has a key. No secret in it: the key goes by environment (launch_env)."""
    if not cfg.model:
        raise ServerError("server.model is empty: give a model path or hub name for vLLM to serve")
    has_key = bool(cfg.api_key_env) or cfg.needs_key
    return vllm_format.vllm_command(cfg) + (["--middleware", KEY_GUARD] if has_key else [])


@dataclass
class LocalPaths:
    """Where a local server keeps its pidfile and log (under the workflow's logs/)."""

    log_dir: Path

    @property
    def pidfile(self) -> Path:
        return self.log_dir / "vllm.pid.json"

    @property
    def log(self) -> Path:
        return self.log_dir / "vllm.log"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not alive for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def read_pidfile(paths: LocalPaths) -> dict | None:
    try:
        return json.loads(paths.pidfile.read_text())
    except (OSError, ValueError):
        return None


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1" if host in ("0.0.0.0", "") else host, port)) == 0


def start_local(cfg: ServerConfig, paths: LocalPaths, workflow_pid: int | None = None,
                sentinel: str | Path | None = None, log=say) -> dict:
    """Start vLLM in its own process group, or reuse a healthy server this workflow started before.

    `sentinel` (server.ready) is removed whenever the server is stopped, so it never describes a
    server we know is gone. Returns the pidfile record. Refuses (ServerError) when the GPUs it will use are busy or the port
    is held by a process that is not ours."""
    check_model_path(cfg.model)
    paths.log_dir.mkdir(parents=True, exist_ok=True)
    api_key = cfg.api_key(create=True)
    record = read_pidfile(paths)
    if record and alive(record["pid"]):
        if record.get("port") == cfg.port and is_serving(cfg.local_url, cfg.model_id, api_key):
            log(f"reusing the server this workflow started before (pid {record['pid']}, {cfg.local_url})")
            return record
        if record.get("port") == cfg.port and record.get("command") == vllm_command(cfg):
            log(f"a server this workflow started (pid {record['pid']}) is still loading; waiting for it")
            return record
        log(f"stopping the server this workflow started earlier (pid {record['pid']}): "
            f"its settings differ from the config")
        stop_local(paths, log=log)
    if _port_in_use(cfg.host, cfg.port):
        raise ServerError(f"port {cfg.port} on {cfg.host} is already in use by a process this workflow "
                          f"did not start: stop it, set server.port to a free port, or use "
                          f"server.mode: external with server.urls: [http://{cfg.host}:{cfg.port}]")
    busy = busy_gpus(_server_devices(cfg))
    if busy:
        raise ServerError("refusing to start vLLM: the GPUs it would use are not free:\n  "
                          + "\n  ".join(busy)
                          + "\nstop those processes, or point CUDA_VISIBLE_DEVICES (server.env) at free GPUs")

    cmd = vllm_command(cfg)
    env = launch_env(cfg, api_key)
    logf = open(paths.log, "ab")
    logf.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {shlex.join(cmd)}\n".encode())
    logf.flush()
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    logf.close()
    record = {"pid": proc.pid, "pgid": proc.pid, "port": cfg.port, "host": cfg.host,
              "url": cfg.local_url, "model": cfg.model_id, "command": cmd, "log": str(paths.log),
              "started_at": time.time(), "keep": cfg.keep_server,
              "sentinel": str(Path(sentinel).resolve()) if sentinel else None}
    if workflow_pid and not cfg.keep_server:
        watchdog = subprocess.Popen(
            [sys.executable, "-m", "eaglenest.server", "watch", "--workflow-pid", str(workflow_pid),
             "--server-pid", str(proc.pid), "--log-dir", str(paths.log_dir)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        record["watchdog_pid"] = watchdog.pid
    write_atomic(paths.pidfile, record, indent=1)
    log(f"started vLLM (pid {proc.pid}) on {cfg.local_url}; log: {paths.log}")
    return record


def stop_local(paths: LocalPaths, grace_s: float = STOP_GRACE_S, log=say) -> bool:
    """Stop the server this workflow started (its whole process group). True if one was running."""
    record = read_pidfile(paths)
    if record is None:
        return False
    pgid, was_running = record.get("pgid", record["pid"]), alive(record["pid"])
    if was_running:
        signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while alive(record["pid"]) and time.monotonic() < deadline:
            time.sleep(0.2)
    # vLLM's engine processes share the group; make sure none lingers holding a GPU.
    signal_group(pgid, signal.SIGKILL)
    if record.get("watchdog_pid") and record["watchdog_pid"] != os.getpid():
        signal_group(record["watchdog_pid"], signal.SIGTERM)
    paths.pidfile.unlink(missing_ok=True)
    if record.get("sentinel"):
        Path(record["sentinel"]).unlink(missing_ok=True)
    if was_running:
        log(f"stopped vLLM (pid {record['pid']})")
    return was_running


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def log_tail(path: str | Path, lines: int = 40) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


# ---------------------------------------------------------------------------------------------
# Waiting for readiness


def wait_ready(cfg: ServerConfig, paths: LocalPaths | None = None, log=say) -> dict:
    """Poll /v1/models every `poll_interval` s until every URL lists the model (or `ready_timeout`).

    In local mode a dead process fails within one poll, with the tail of its log."""
    urls, model, api_key = cfg.base_urls(), cfg.model_id, cfg.api_key()
    record = read_pidfile(paths) if paths else None
    start = record["started_at"] if record else time.time()
    t0 = time.monotonic()
    pending, infos = list(urls), {}
    last_report = 0.0
    while pending:
        if record and not alive(record["pid"]):
            paths.pidfile.unlink(missing_ok=True)
            refusal = vllm_format.memory_refusal(vllm_format.last_start(paths.log))
            if refusal:
                raise ServerError(f"{refusal} (vLLM's log: {paths.log})")
            raise ServerError(f"vLLM (pid {record['pid']}) exited before it was ready. "
                              f"Last lines of {paths.log}:\n{log_tail(paths.log)}")
        for url in list(pending):
            try:
                info = probe(url, api_key, timeout=min(10.0, cfg.poll_interval + 5))
            except (OSError, ValueError):
                continue
            if model in info["models"]:
                infos[url] = info
                pending.remove(url)
            else:
                raise ServerError(f"{url} serves {info['models']}, not '{model}': set server.served_model_name "
                                  f"(or server.model) to the name the server reports")
        waited = time.monotonic() - t0
        if not pending:
            break
        if waited > cfg.ready_timeout:
            tail = f" Last lines of {paths.log}:\n{log_tail(paths.log)}" if record else ""
            raise ServerError(f"{', '.join(pending)} did not serve '{model}' within server.ready_timeout="
                              f"{cfg.ready_timeout:g} s.{tail}")
        if waited - last_report >= 30 or last_report == 0.0:
            gpu = gpu_memory_summary()
            log(f"waiting for {', '.join(pending)} ({waited:.0f} s)" + (f"; GPU memory {gpu}" if gpu else ""))
            last_report = waited or 1e-9
        time.sleep(cfg.poll_interval)
    first = infos[urls[0]]
    ready = {"mode": cfg.mode, "urls": urls, "model": model,
             "max_model_len": first["max_model_len"].get(model), "version": first["version"],
             "seconds_to_ready": round(time.time() - start, 1), "ready_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if record:
        ready["pid"] = record["pid"]
        ready.update(vllm_format.kv_cache_facts(paths.log))
    log(f"server ready: {', '.join(urls)} serves '{model}' after {ready['seconds_to_ready']} s"
        + (f"; its KV cache holds {ready['max_concurrency']:g} sequences of {ready['concurrency_tokens']} tokens"
           if "max_concurrency" in ready else ""))
    return ready


def kv_shortfall(ready: dict, concurrency: int) -> str | None:
    """A warning when the server's KV cache (as its log reported, ``kv_cache_facts``) holds fewer than
    ``concurrency`` sequences of max_model_len tokens: vLLM then runs fewer requests at a time than the
    config sends. None when it holds enough, or the log did not say."""
    held = ready.get("max_concurrency")
    if held is None or held >= concurrency:
        return None
    need = (f" (about {ready['kv_cache_gib'] * concurrency / held:.2f} GiB)"
            if ready.get("kv_cache_gib") else "")
    return (f"the server's KV cache holds {held:g} sequences of {ready['concurrency_tokens']} tokens, fewer than "
            f"generation.concurrency={concurrency}: vLLM queues the rest. Raise server.kv_cache_gb{need}, or on a "
            f"GPU server.gpu_memory_utilization, or lower generation.concurrency")


def write_sentinel(path: str | Path, ready: dict) -> None:
    write_atomic(path, ready, indent=1)


# ---------------------------------------------------------------------------------------------
# One entry point for every mode: the server_ready and stop_server rules and the workflow's
# onsuccess/onerror handlers all go through these two functions.


def start_server(cfg: ServerConfig, log_dir: str | Path, *, sentinel: str | Path | None = None,
                 workflow_pid: int | None = None, log=say) -> dict:
    """Start (local), submit (slurm) or find (external) the server and wait until it serves.

    Returns what server.ready holds. A local server or SLURM job that never becomes ready is stopped
    before the error propagates, so it never holds GPUs or the port."""
    log_dir = Path(log_dir)
    if cfg.mode == "local":
        paths = LocalPaths(log_dir)
        start_local(cfg, paths, workflow_pid=workflow_pid, sentinel=sentinel, log=log)
        try:
            return wait_ready(cfg, paths, log=log)
        except BaseException:
            stop_local(paths, log=log)
            raise
    if cfg.mode == "slurm":
        from .slurm import SlurmPaths, cancel_server, slurm_wait_ready, submit_server

        jobs = SlurmPaths(log_dir)
        submit_server(cfg, cfg.slurm, jobs, sentinel=sentinel, workflow_pid=workflow_pid, log=log)
        try:
            return slurm_wait_ready(cfg, jobs, log=log)
        except BaseException:
            cancel_server(jobs, log=log)
            raise
    return wait_ready(cfg, log=log)


def stop_server(cfg: ServerConfig, log_dir: str | Path, log=say) -> str:
    """Stop the local server or cancel the SLURM job this workflow started, unless server.keep_server;
    an external server is left alone. Returns what happened, in a few words."""
    if cfg.mode not in ("local", "slurm"):
        return f"left alone ({cfg.mode} mode)"
    if cfg.keep_server:
        return "kept (server.keep_server)"
    if cfg.mode == "local":
        return "stopped" if stop_local(LocalPaths(Path(log_dir)), log=log) else "not running"
    from .slurm import SlurmPaths, cancel_server

    return "cancelled (SLURM job)" if cancel_server(SlurmPaths(Path(log_dir)), log=log) else "not running"


# ---------------------------------------------------------------------------------------------
# The watchdog: stops the server when the workflow that asked for it has gone.


def watch(workflow_pid: int, server_pid: int, log_dir: Path, interval: float = 2.0) -> None:
    paths = LocalPaths(log_dir)
    while alive(server_pid):
        if not alive(workflow_pid):
            record = read_pidfile(paths)
            if record and record["pid"] == server_pid:
                stop_local(paths, log=lambda *_: None)
            return
        time.sleep(interval)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m eaglenest.server")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="stop the server when the workflow process dies")
    w.add_argument("--workflow-pid", type=int, required=True)
    w.add_argument("--server-pid", type=int, required=True)
    w.add_argument("--log-dir", type=Path, required=True)
    s = sub.add_parser("stop", help="stop the local server started by the workflow in this directory")
    s.add_argument("--log-dir", type=Path, default=Path("logs/server"))
    args = p.parse_args(argv)
    if args.cmd == "watch":
        watch(args.workflow_pid, args.server_pid, args.log_dir)
    else:
        print("stopped" if stop_local(LocalPaths(args.log_dir)) else "no server running")


if __name__ == "__main__":
    main()
