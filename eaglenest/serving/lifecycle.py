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

from pathlib import Path

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


def start_server(cfg: ServerConfig, log_dir: str | Path, *, sentinel: str | Path | None = None,
                 workflow_pid: int | None = None, log=say) -> dict:
    """Start (local), submit (slurm) or find (external) the server and wait until it serves.

    Returns what server.ready holds. A local server or SLURM job that never becomes ready is stopped
    before the error propagates, so it never holds GPUs or the port."""
    server = backend(cfg, log_dir)
    server.start(sentinel=sentinel, workflow_pid=workflow_pid, log=log)
    try:
        return server.wait_ready(log=log)
    except BaseException:
        server.stop(log=log)
        raise


def stop_server(cfg: ServerConfig, log_dir: str | Path, log=say) -> str:
    """Stop the local server or cancel the SLURM job this workflow started, unless server.keep_server;
    an external server is left alone. Returns what happened, in a few words."""
    if cfg.mode not in ("local", "slurm"):
        return f"left alone ({cfg.mode} mode)"
    if cfg.keep_server:
        return "kept (server.keep_server)"
    if not backend(cfg, log_dir).stop(log=log):
        return "not running"
    return "stopped" if cfg.mode == "local" else "cancelled (SLURM job)"


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
