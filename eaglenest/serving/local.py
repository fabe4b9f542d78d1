"""`server.mode: local`: vLLM started by the workflow on this machine, in its own process group,
with a pidfile, a port record and a log under logs/server/, refused while the GPUs it would use are
busy or the port the user set is taken. Every mode launches vLLM with `launch_env` and
`server_command` (the port launcher, serving.port, around `guarded_server_command`): the port is chosen where
the server runs and read back from its record.

A watchdog (eaglenest.serving.backend, `Backend.watch`) stops the server when the workflow process
that asked for it dies (kill -9, a crash of Snakemake itself), so a server never outlives its workflow
by accident. `keep_server: true` disables the watchdog.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ServerError
from ..gpus import lock_devices, nvidia_smi, physical_gpus, visible_devices
from ..util import file_in, say, write_atomic
from ..vllm_facts import kv_cache_facts, last_start, memory_refusal
from .port import PORT_FILE, launcher_command, port_taken, read_port_record, taken_message
from .backend import Backend, alive, log_tail, signal_group, watchdog_command
from .probe import is_serving
from .settings import ServerConfig, check_model_path
from .vllm import SINGLE_PROCESS_ENV, api_server_command, single_process_worker

GPU_BUSY_MIB = 1024
STOP_GRACE_S = 30.0
# Snakemake sets these to a job's thread count; vLLM's CPU backend pins its worker to its own cores
# and, given OMP_NUM_THREADS=2 on a 2-core machine, ran far slower (benchmarks/RESULTS.md, "Figures
# moved out of code comments").
# A server never inherits them; server.env can still set them.
THREAD_ENV = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
CHECKOUT = str(Path(__file__).resolve().parents[2])  # the directory that holds the eaglenest package


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


def launch_env(cfg: ServerConfig, api_key: str | None, drop_prefixes: tuple[str, ...] = ()) -> dict:
    """The environment every vLLM server starts with, in every mode: this process's, without the
    job's thread-count variables (THREAD_ENV) and any `drop_prefixes`, then `server.env`."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV and not k.startswith(drop_prefixes)}
    if single_process_worker(cfg):
        env.update(SINGLE_PROCESS_ENV)
    env.update({k: str(v) for k, v in cfg.env.items()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    if api_key:
        env["VLLM_API_KEY"] = api_key  # vLLM reads it; never on the command line or in the log
        # vLLM imports the key guard (KEY_GUARD) from this checkout, whatever server.env's PYTHONPATH says.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (CHECKOUT, env.get("PYTHONPATH")) if p)
    return env


# vLLM checks its key only under /v1, /v2, /inference, /cohere; this guard covers every other route
# (eaglenest/serving/guard.py says what was open without it).
KEY_GUARD = "eaglenest.serving.guard.RequireApiKey"


def guarded_server_command(cfg: ServerConfig) -> list[str]:
    """The command line that starts vLLM's OpenAI server (serving.vllm.api_server_command), plus the key guard
    where the server has a key. No secret in it: the key goes by environment (launch_env)."""
    if not cfg.model:
        raise ServerError("server.model is empty: give a model path or hub name for vLLM to serve")
    has_key = bool(cfg.api_key_env) or cfg.needs_key
    return api_server_command(cfg) + (["--middleware", KEY_GUARD] if has_key else [])


def server_command(cfg: ServerConfig, port_record: str | Path) -> list[str]:
    """`guarded_server_command` under the port launcher (serving.port): it runs where the server runs, takes
    `server.port` or a free port there, and writes which to `port_record`."""
    return launcher_command(sys.executable, cfg.host, cfg.port, Path(port_record).resolve(),
                            guarded_server_command(cfg))


@dataclass
class LocalPaths:
    """Where a local server keeps its pidfile, port record and log (under the workflow's logs/)."""

    log_dir: Path
    pidfile = file_in("log_dir", "vllm.pid.json")
    log = file_in("log_dir", "vllm.log")
    port_record = file_in("log_dir", PORT_FILE)


def served_url(cfg: ServerConfig, paths: LocalPaths, pid: int) -> str | None:
    """The URL of the server launched as `pid`, from its port record; None until the launcher wrote it.
    Raises ServerError with the launcher's own error (a port the user set that is taken)."""
    record = read_port_record(paths.port_record)
    if not record or record.get("pid") != pid:
        return None
    if record.get("error"):
        raise ServerError(f"{record['error']} (vLLM's log: {paths.log})")
    return cfg.url_at(record["port"])


def read_pidfile(paths: LocalPaths) -> dict | None:
    try:
        return json.loads(paths.pidfile.read_text())
    except (OSError, ValueError):
        return None


def start_local(cfg: ServerConfig, paths: LocalPaths, workflow_pid: int | None = None,
                sentinel: str | Path | None = None, log=say) -> dict:
    """Start vLLM in its own process group, or reuse a healthy server this workflow started before.

    `sentinel` (server.ready) is removed whenever the server is stopped, so it never describes a
    server we know is gone. Returns the pidfile record. Refuses (ServerError) when the GPUs it will use are busy or the
    port the user set (`server.port`) is held by a process that is not ours."""
    check_model_path(cfg.model)
    paths.log_dir.mkdir(parents=True, exist_ok=True)
    api_key = cfg.api_key(create=True)
    record = read_pidfile(paths)
    if record and alive(record["pid"]):
        same = record.get("port") == cfg.port and record.get("command") == guarded_server_command(cfg)
        url = same and _quiet_url(cfg, paths, record["pid"])
        if url and is_serving(url, cfg.model_id, api_key):
            log(f"reusing the server this workflow started before (pid {record['pid']}, {url})")
            return record
        if same:
            log(f"a server this workflow started (pid {record['pid']}) is still loading; waiting for it")
            return record
        log(f"stopping the server this workflow started earlier (pid {record['pid']}): "
            f"its settings differ from the config")
        stop_local(paths, log=log)
    if cfg.port and port_taken(cfg.host, cfg.port):
        raise ServerError(f"{taken_message(cfg.port, socket.gethostname())}; or use server.mode: external "
                          f"with server.urls: [{cfg.url_at(cfg.port)}] if that is a server to use")
    busy = busy_gpus(_server_devices(cfg))
    if busy:
        raise ServerError("refusing to start vLLM: the GPUs it would use are not free:\n  "
                          + "\n  ".join(busy)
                          + "\nstop those processes, or point CUDA_VISIBLE_DEVICES (server.env) at free GPUs")

    paths.port_record.unlink(missing_ok=True)  # the record of an earlier server
    cmd = server_command(cfg, paths.port_record)
    env = launch_env(cfg, api_key)
    # A replica's GPU group is claimed (gpus.py's locks) for as long as the server runs: it holds the locks.
    locks = lock_devices(_server_devices(cfg)) if cfg.replicas > 1 and physical_gpus() else []
    logf = open(paths.log, "ab")
    logf.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {shlex.join(cmd)}\n".encode())
    logf.flush()
    try:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, pass_fds=locks)
    finally:
        logf.close()
        for fd in locks:
            os.close(fd)
    record = {"pid": proc.pid, "pgid": proc.pid, "port": cfg.port, "host": cfg.host,
              "model": cfg.model_id, "command": guarded_server_command(cfg), "launch": cmd, "log": str(paths.log),
              "started_at": time.time(), "keep": cfg.keep_server,
              "sentinel": str(Path(sentinel).resolve()) if sentinel else None}
    if workflow_pid and not cfg.keep_server:
        watchdog = subprocess.Popen(watchdog_command("local", workflow_pid, proc.pid, paths.log_dir),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        record["watchdog_pid"] = watchdog.pid
    write_atomic(paths.pidfile, record, indent=1)
    where = f"port {cfg.port}" if cfg.port else "a free port"
    log(f"started vLLM (pid {proc.pid}) on {where} of {cfg.host}; log: {paths.log}, port record: {paths.port_record}")
    return record


def _quiet_url(cfg: ServerConfig, paths: LocalPaths, pid: int) -> str | None:
    try:
        return served_url(cfg, paths, pid)
    except ServerError:
        return None


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


class LocalServer(Backend):
    """The server this workflow starts on this machine (`start_local`, `stop_local`)."""

    mode = "local"

    def __init__(self, cfg: ServerConfig | None, paths: LocalPaths):
        super().__init__(cfg)
        self.paths = paths
        self.record = None

    def start(self, *, sentinel=None, workflow_pid=None, log=say) -> None:
        start_local(self.cfg, self.paths, workflow_pid=workflow_pid, sentinel=sentinel, log=log)

    def stop(self, log=say) -> bool:
        return stop_local(self.paths, log=log)

    def begin_wait(self) -> float:
        self.record = read_pidfile(self.paths)
        return self.record["started_at"] if self.record else time.time()

    def poll(self, log):
        if self.record is None:
            raise ServerError(f"no server record at {self.paths.pidfile}: start the server first (start_local)")
        if not alive(self.record["pid"]):
            self.paths.pidfile.unlink(missing_ok=True)
            served_url(self.cfg, self.paths, self.record["pid"])  # the launcher's own error, if it left one
            refusal = memory_refusal(last_start(self.paths.log))
            if refusal:
                raise ServerError(f"{refusal} (vLLM's log: {self.paths.log})")
            raise ServerError(f"vLLM (pid {self.record['pid']}) exited before it was ready. "
                              f"Last lines of {self.paths.log}:\n{log_tail(self.paths.log)}")
        url = served_url(self.cfg, self.paths, self.record["pid"])
        return ([url] if url else []), self.wait_started

    def progress_note(self) -> str:
        gpu = gpu_memory_summary()
        return f"; GPU memory {gpu}" if gpu else ""

    def timeout_note(self) -> str:
        return f". Last lines of {self.paths.log}:\n{log_tail(self.paths.log)}" if self.record else ""

    def ready_facts(self) -> dict:
        if not self.record:
            return {}
        return {"pid": self.record["pid"], **kv_cache_facts(self.paths.log)}

    def running(self, ident: str) -> bool:
        return alive(int(ident))

    def owns(self, ident: str) -> bool:
        record = read_pidfile(self.paths)
        return bool(record) and str(record["pid"]) == str(ident)

    def stop_orphan(self, ident: str) -> None:
        pass  # not ours to stop: the pidfile names another server
