"""A validation job's servers stop however the job ends: SIGTERM (Snakemake cancelling the job) becomes
KeyboardInterrupt, so the ``finally`` that stops a server runs; and its exit status is collected."""

from __future__ import annotations

import contextlib
import os
import signal
import threading


@contextlib.contextmanager
def sigterm_stops_servers():
    """Turn SIGTERM (Snakemake cancelling a job) into KeyboardInterrupt so `finally` stops the server."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def reap(pid: int) -> None:
    """Collect the exit status of a server this process started, so no zombie is left behind."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
