"""The generation server's lifecycle, for every mode: start it, wait until it serves, stop it.

Modes (docs/dag.md, "Server lifecycle"): `local` starts vLLM in its own process group with a pidfile
and a log (serving.local); `slurm` submits it as its own SLURM job (serving.slurm); `external` only
polls URLs the user gives (serving.backend). `backend` is the one dispatch between them;
`start_server` and `stop_server` serve the rules and the workflow's exit handlers alike. The
`server.ready` sentinel written from `wait_ready`'s answer is JSON that describes the server; it can
outlive the server, so consumers call `probe.check_sentinel` before use.

`python -m eaglenest.serving.lifecycle watch ...` is the watchdog a started server runs beside it
(`Backend.watch`); `... stop` stops the server of the workflow in this directory.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..gpus import device_groups, physical_gpus, visible_devices
from ..util import say, write_atomic
from .backend import Backend, ExternalServer
from .local import LocalPaths, LocalServer
from .settings import ServerConfig
from .slurm import SlurmPaths, SlurmServer


def backend(cfg: ServerConfig | None, log_dir: str | Path, mode: str | None = None) -> Backend:
    """The backend of ``cfg.server.mode`` (or ``mode``), keeping its records under ``log_dir``."""
    mode = mode or cfg.mode
    if mode == "local":
        return LocalServer(cfg, LocalPaths(Path(log_dir)))
    if mode == "slurm":
        return SlurmServer(cfg, SlurmPaths(Path(log_dir)))
    return ExternalServer(cfg)


def wait_ready(cfg: ServerConfig, paths: LocalPaths | SlurmPaths | None = None, log=say) -> dict:
    """Wait until the server ``paths`` keeps the records of (local or SLURM; None: external) serves."""
    if isinstance(paths, SlurmPaths):
        return SlurmServer(cfg, paths).wait_ready(log=log)
    return (LocalServer(cfg, paths) if paths else ExternalServer(cfg)).wait_ready(log=log)


REPLICA_PREFIX = "replica_"


def replica_dir(log_dir: str | Path, i: int) -> Path:
    """Where replica ``i`` keeps its records: the log directory itself for the first (as a single
    server does), ``replica_<i>/`` below it for the others."""
    return Path(log_dir) / f"{REPLICA_PREFIX}{i}" if i else Path(log_dir)


def replica_configs(cfg: ServerConfig) -> list[ServerConfig]:
    """One config per replica (``server.replicas``): each takes a free port where it runs, or, where
    ``server.port`` is set, replica i listens on ``port + i`` (each checked free there); in local mode
    on a GPU machine it gets its own group of ``tensor_parallel_size`` GPUs (CUDA_VISIBLE_DEVICES in its
    env) of those server.env, this process or nvidia-smi give."""
    if cfg.mode == "external" or cfg.replicas == 1:
        return [cfg]
    groups = [[] for _ in range(cfg.replicas)]
    if cfg.mode == "local":
        visible = cfg.env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
        groups = device_groups(cfg.replicas, cfg.tensor_parallel_size,
                               visible_devices(visible) if visible else physical_gpus())
    return [dataclasses.replace(cfg, port=cfg.port + i if cfg.port else None,
                                env={**cfg.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, g))} if g else cfg.env)
            for i, g in enumerate(groups)]


def start_server(cfg: ServerConfig, log_dir: str | Path, *, sentinel: str | Path | None = None,
                 workflow_pid: int | None = None, log=say) -> dict:
    """Start (local), submit (slurm) or find (external) the server's replicas and wait until they serve.

    Returns what server.ready holds: the URLs of the replicas that serve (``urls``), the first one's
    facts, and each one's (``replicas``). A replica that never becomes ready is stopped, so it never
    holds GPUs or the port; with others serving it is dropped with a warning, with none the first
    error propagates."""
    servers = [backend(c, replica_dir(log_dir, i)) for i, c in enumerate(replica_configs(cfg))]
    try:
        for server in servers:
            server.start(sentinel=sentinel, workflow_pid=workflow_pid, log=log)
    except BaseException:
        for server in servers:
            server.stop(log=log)
        raise
    ready, failed = [], None
    for i, server in enumerate(servers):
        try:
            ready.append(server.wait_ready(log=log))
        except Exception as e:
            server.stop(log=log)
            if len(servers) == 1:
                raise
            log(f"WARNING: replica {i} of {len(servers)} dropped: {e}")
            failed = failed or e
        except BaseException:
            for s in servers:
                s.stop(log=log)
            raise
    if not ready:
        raise failed
    if len(servers) == 1:
        return ready[0]
    return {**ready[0], "urls": [u for r in ready for u in r["urls"]], "replicas": ready}


def replica_dirs(log_dir: str | Path) -> list[Path]:
    """The log directory and every replica directory below it: a rerun with fewer replicas still
    finds the servers of the others."""
    log_dir = Path(log_dir)
    return [log_dir, *sorted(log_dir.glob(f"{REPLICA_PREFIX}*"))]


def stop_server(cfg: ServerConfig, log_dir: str | Path, log=say) -> str:
    """Stop every local replica or cancel every SLURM job this workflow started, unless
    server.keep_server; an external server is left alone. Returns what happened, in a few words."""
    if cfg.mode not in ("local", "slurm"):
        return f"left alone ({cfg.mode} mode)"
    if cfg.keep_server:
        return "kept (server.keep_server)"
    stopped = sum(backend(cfg, d).stop(log=log) for d in replica_dirs(log_dir))
    if not stopped:
        return "not running"
    what = "stopped" if cfg.mode == "local" else "cancelled (SLURM job)"
    return what if stopped == 1 else f"{stopped} replicas {what}"


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


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m eaglenest.serving.lifecycle")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="stop the server when the workflow process dies")
    w.add_argument("--mode", choices=("local", "slurm"), required=True)
    w.add_argument("--workflow-pid", type=int, required=True)
    w.add_argument("--server-id", required=True, help="the server's pid (local) or SLURM job id")
    w.add_argument("--log-dir", type=Path, required=True)
    w.add_argument("--interval", type=float, default=None, help="seconds between looks (local 2, slurm 10)")
    s = sub.add_parser("stop", help="stop the server started by the workflow in this directory")
    s.add_argument("--mode", choices=("local", "slurm"), default="local")
    s.add_argument("--log-dir", type=Path, default=Path("logs/server"))
    args = p.parse_args(argv)
    server = backend(None, args.log_dir, args.mode)
    if args.cmd == "watch":
        server.watch(args.workflow_pid, args.server_id, args.interval or (2.0 if args.mode == "local" else 10.0))
    else:
        print("stopped" if server.stop() else "no server running")


if __name__ == "__main__":
    main()
