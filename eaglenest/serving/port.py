"""The port a server listens on, chosen where the server runs (docs/dag.md, "Ports").

Every server the workflow starts (trace server, replicas, extraction server, validation's servers;
local and SLURM) runs under this launcher: ``python -I eaglenest/serving/port.py --host H --want N|auto
--file F -- <vLLM command>``. It runs on the server's own node, so it sees that node's ports:

- ``auto`` (the default, ``server.port: null``): the kernel picks a free port (a bind to port 0), the
  launcher writes it to ``F`` (the server's port record: port, node, pid, SLURM job) and starts the
  server with ``--port`` set to it. A server that still dies on a taken port (another process bound it
  between the pick and vLLM's own bind) is started again on a new pick, never on the same port.
- a port the user set: it is checked on that node first; taken, the record holds the error (port and
  node named) and nothing starts.

The controller reads the port and the node from ``F`` (``read_port_record``), never from the config.
Only the standard library here: the launcher runs as a script under any interpreter (``-I``: the
environment's PYTHONPATH and the script's directory stay off its path).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PORT_FILE = "port.json"
# What a server prints when its bind fails on a taken port (Python's OSError for EADDRINUSE).
TAKEN_MARKERS = ("Address already in use", f"[Errno {errno.EADDRINUSE}]")
TRIES = 5
LAUNCHER = str(Path(__file__).resolve())


def launcher_command(python: str, host: str, port: int | None, record: str | Path, cmd: list[str]) -> list[str]:
    """The command line that starts ``cmd`` (a server that takes ``--port``) on a free port, or on
    ``port`` when one is set, writing the port record to ``record``."""
    return [python, "-I", LAUNCHER, "--host", host, "--want", str(port) if port else "auto",
            "--file", str(record), "--", *cmd]


def bind_address(host: str) -> str:
    return "" if host in ("0.0.0.0", "::") else host


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on this node for ``host`` now: the kernel's pick for a bind to port 0."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((bind_address(host), 0))
        return s.getsockname()[1]


def port_taken(host: str, port: int) -> bool:
    """Whether ``port`` cannot be bound for ``host`` on this node (a listener or a connection holds it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds: TIME_WAIT is no obstacle
        try:
            s.bind((bind_address(host), port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def taken_message(port: int, node: str, key: str = "server.port") -> str:
    return (f"port {port} is already in use on {node} ({key} = {port}): free it there, or leave {key} unset "
            f"(null) so the server takes a free port where it runs")


def write_record(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_port_record(path: str | Path) -> dict | None:
    """The port record a launcher wrote (``port``, ``node``, ``pid``, ``job_id``; or ``error``), or None."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


class _Child:
    """The server process; with ``forward_signals``, SIGTERM, SIGINT and SIGHUP to the launcher go on to it."""

    def __init__(self, forward_signals: bool = False):
        self.proc = None
        if forward_signals:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, self._forward)

    def _forward(self, signum, frame):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)
        else:
            sys.exit(128 + signum)

    def run(self, cmd: list[str]) -> tuple[int, bool]:
        """Run ``cmd``, its output copied to ours line by line; (exit code, whether it said its port was taken)."""
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        taken = False
        out = sys.stdout.buffer
        for line in self.proc.stdout:
            out.write(line)
            out.flush()
            taken = taken or any(m.encode() in line for m in TAKEN_MARKERS)
        return self.proc.wait(), taken


def launch(host: str, want: int | None, record_path: Path, cmd: list[str], tries: int = TRIES, pick=free_port,
           forward_signals: bool = False) -> int:
    """Start ``cmd --port P`` where P is ``want`` or a free pick (``pick(host)``); returns the server's
    exit code (98 where ``want`` is taken: nothing started)."""
    node = socket.gethostname()
    base = {"node": node, "host": host, "pid": os.getpid(), "job_id": os.environ.get("SLURM_JOB_ID")}
    child = _Child(forward_signals)
    for attempt in range(1, tries + 1):
        port = want or pick(host)
        if want and port_taken(host, want):
            message = taken_message(want, node)
            write_record(record_path, {**base, "port": want, "error": message})
            print(f"eaglenest: {message}", flush=True)
            return 98
        write_record(record_path, {**base, "port": port, "attempt": attempt, "at": time.time()})
        print(f"eaglenest: serving on port {port} of {node}" + (f" (attempt {attempt})" if attempt > 1 else ""),
              flush=True)
        rc, taken = child.run([*cmd, "--port", str(port)])
        if not (rc and taken):
            return rc
        if want:
            message = taken_message(want, node)
            write_record(record_path, {**base, "port": want, "error": message})
            return rc
        print(f"eaglenest: port {port} on {node} was taken before the server bound it; picking another",
              flush=True)
    write_record(record_path, {**base, "error": f"no free port held on {node} after {tries} picks"})
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--want", required=True, help="a port, or auto")
    parser.add_argument("--file", required=True, type=Path, help="where the port record goes")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    a = parser.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    return launch(a.host, None if a.want == "auto" else int(a.want), a.file, cmd, forward_signals=True)


if __name__ == "__main__":
    sys.exit(main())
