"""The one interface of the generation server, whatever runs it, and the loops every backend shares.

A backend (local: eaglenest.serving.local, slurm: eaglenest.serving.slurm, external: below) starts its
server, says where it can be reached (`poll`) and stops it. `Backend.wait_ready` is the one readiness
loop: it polls /v1/models until every URL lists the model, with one timeout (`server.ready_timeout`,
counted from the moment the server runs), one progress line and one error when it never serves.
`Backend.watch` is the one watchdog loop (`python -m eaglenest.serving.lifecycle watch ...`): it stops
the server when the workflow process that asked for it has died.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..errors import ServerError
from ..util import say
from .probe import probe
from .settings import ServerConfig

REPORT_EVERY_S = 30.0


class Backend:
    """What every server mode does. Subclasses supply start, stop, poll and the watchdog's three
    questions (running, owns, stop_orphan); the rest has defaults that fit a server with no process."""

    mode = ""

    def __init__(self, cfg: ServerConfig | None):
        self.cfg = cfg
        self.wait_started = time.monotonic()

    def start(self, *, sentinel=None, workflow_pid=None, log=say) -> None:
        """Start (or find again) the server; does not wait for it."""

    def stop(self, log=say) -> bool:
        """Stop the server this workflow started; True if one was running."""
        return False

    def begin_wait(self) -> float:
        """Called once before polling: the wall-clock time the server was started (seconds_to_ready)."""
        return time.time()

    def poll(self, log) -> tuple[list[str], float] | None:
        """``(urls to probe now, monotonic time they began to run)``, or None while the server is not
        running yet (queued). Raises ServerError once the server has ended."""
        return self.cfg.base_urls(), self.wait_started

    def progress_note(self) -> str:
        return ""

    def timeout_note(self) -> str:
        return ""

    def where(self) -> str:
        return ""

    def ready_facts(self) -> dict:
        return {}

    def wait_ready(self, log=say) -> dict:
        """Poll every ``server.poll_interval`` s until every URL lists the model; returns what
        server.ready holds."""
        cfg = self.cfg
        model, api_key = cfg.model_id, cfg.api_key()
        self.wait_started = time.monotonic()
        started_at = self.begin_wait()
        infos, last_report = {}, -REPORT_EVERY_S
        while True:
            state = self.poll(log)
            if state is not None:
                urls, since = state
                for url in urls:
                    if url in infos:
                        continue
                    try:
                        info = probe(url, api_key, timeout=min(10.0, cfg.poll_interval + 5))
                    except (OSError, ValueError):
                        continue
                    if model not in info["models"]:
                        raise ServerError(f"{url} serves {info['models']}, not '{model}': set "
                                          f"server.served_model_name (or server.model) to the name the server reports")
                    infos[url] = info
                # no URL yet: the server's launcher has not written its port record
                pending = [u for u in urls if u not in infos] or (["the server's port record"] if not urls else [])
                if not pending:
                    break
                now = time.monotonic()
                if now - since > cfg.ready_timeout:
                    raise ServerError(f"{', '.join(pending)}{self.where()} did not serve '{model}' within "
                                      f"server.ready_timeout={cfg.ready_timeout:g} s{self.timeout_note() or '.'}")
                if now - last_report >= REPORT_EVERY_S:
                    log(f"waiting for {', '.join(pending)} ({now - since:.0f} s){self.progress_note()}")
                    last_report = now
            time.sleep(cfg.poll_interval)
        first = infos[urls[0]]
        ready = {"mode": self.mode, "urls": urls, "model": model,
                 "max_model_len": first["max_model_len"].get(model), "version": first["version"],
                 "seconds_to_ready": round(time.time() - started_at, 1),
                 "ready_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **self.ready_facts()}
        log(f"server ready: {', '.join(urls)}{self.where()} serves '{model}' after {ready['seconds_to_ready']} s"
            + (f"; its KV cache holds {ready['max_concurrency']:g} sequences of {ready['concurrency_tokens']} tokens"
               if "max_concurrency" in ready else ""))
        return ready

    # The watchdog's questions, about the server ``ident`` (a pid, a SLURM job id) it was started for.
    def running(self, ident: str) -> bool:
        return False

    def owns(self, ident: str) -> bool:
        """Whether the workflow's record still names ``ident`` (then `stop` cleans up after it)."""
        return False

    def stop_orphan(self, ident: str) -> None:
        """Stop ``ident`` where the record names another server."""

    def watch(self, workflow_pid: int, ident: str, interval: float) -> None:
        """Stop the server when the workflow process dies; return once the server has ended."""
        while self.running(ident):
            if not alive(workflow_pid):
                if self.owns(ident):
                    self.stop(log=lambda *_: None)
                else:
                    self.stop_orphan(ident)
                return
            time.sleep(interval)


class ExternalServer(Backend):
    """`server.mode: external`: servers the user runs; the workflow only polls them."""

    mode = "external"


def watchdog_command(mode: str, workflow_pid: int, ident, log_dir: Path, interval: float | None = None) -> list[str]:
    """The command line of the watchdog process a backend starts beside its server."""
    cmd = [sys.executable, "-m", "eaglenest.serving.lifecycle", "watch", "--mode", mode,
           "--workflow-pid", str(workflow_pid), "--server-id", str(ident), "--log-dir", str(Path(log_dir).resolve())]
    return cmd + (["--interval", str(interval)] if interval else [])


# ---------------------------------------------------------------------------------------------
# Processes


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
