"""Servers the tests start or check: free ports, the port a launcher recorded, a server checked gone,
and the toy server started by hand (conftest.toy_server)."""
import dataclasses
import socket
import time
from pathlib import Path

import pytest

from tests.support.config import BASE_CONFIG
from tests.support.processes import group_members, listeners, started_at, uptime, vllm_pids


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick for a bind to port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_ports(wd) -> list[int]:
    """Every port a server under ``wd`` listened on (the port launchers' records, serving.port)."""
    from eaglenest.serving.port import PORT_FILE, read_port_record

    records = [read_port_record(p) for p in Path(wd).rglob(PORT_FILE)]
    return sorted({r["port"] for r in records if r and r.get("port")})


def servers_gone(wd, timeout: float = 30.0) -> None:
    """Every server a workflow in ``wd`` started is gone (``server_gone`` on each port it used)."""
    ports = served_ports(wd)
    assert ports, f"no port record under {wd}"
    for port in ports:
        server_gone(port, timeout=timeout)


def wait_port(log_dir, timeout: float = 120.0) -> int:
    """The port the server whose records live in ``log_dir`` took, once its launcher wrote it."""
    from eaglenest.serving.port import PORT_FILE, read_port_record

    deadline = time.monotonic() + timeout
    while True:
        record = read_port_record(Path(log_dir) / PORT_FILE)
        if record and record.get("port"):
            return record["port"]
        if time.monotonic() > deadline:
            pytest.fail(f"no port record in {log_dir} within {timeout:g} s")
        time.sleep(0.2)


def server_gone(port: int, pgids=(), timeout: float = 30.0) -> None:
    """The server is gone: no vLLM process for `port`, none left in its process groups `pgids`, and
    the port is free. Not the pidfile: stop_local deletes that whatever happens to the process."""
    # Call it once the server should be gone. On a shared machine another test may start a server on
    # the same port meanwhile: a process that started after this call is not ours.
    since = uptime()

    def ours(pids):
        return sorted({p for p in pids if started_at(p) <= since})

    deadline = time.monotonic() + timeout
    while True:
        left = ours(vllm_pids(port) + [p for g in pgids for p in group_members(g)])
        held_by = ours(listeners(port))
        if not left and not held_by:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the server on port {port} is not gone: processes {left}, port held by {held_by}")
        time.sleep(0.5)


# The session's toy server parses tool calls (vLLM's pythonic parser: no special tokens needed), so a test can
# force a real one with a structured-output regex (tests/test_conversations.py); requests without tools are
# answered as without these arguments.
TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]


def start_toy_server(log_dir: Path):
    """A vLLM serving the toy target (BASE_CONFIG's server on a free port, parsing tool calls) that the test
    started and owns, as a user's systemd service or hand-started server would be: (ServerConfig, pidfile record)."""
    from eaglenest.serving.lifecycle import wait_ready
    from eaglenest.serving.local import LocalPaths, start_local, stop_local
    from eaglenest.serving.settings import ServerConfig

    server = BASE_CONFIG["server"]
    cfg = ServerConfig.from_dict({**server, "extra_args": [*server["extra_args"], *TOOL_ARGS]})  # no port: a free one
    paths = LocalPaths(log_dir)
    record = start_local(cfg, paths, log=print)  # no workflow pid: no watchdog, the test owns it
    try:
        ready = wait_ready(cfg, paths, log=print)
    except BaseException:
        stop_local(paths)
        raise
    return dataclasses.replace(cfg, port=int(ready["urls"][0].rsplit(":", 1)[1])), record
