"""The port launcher (eaglenest/serving/port.py): a server takes a port that is free where it runs, a
server that loses its pick to another process is started again on a new one, and a port the user set
that is taken starts nothing and names the port and the node. The "server" here is a few lines of
Python that bind the port they are given, as vLLM does (real sockets, real processes)."""
import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from eaglenest.serving.port import LAUNCHER, launch, launcher_command, read_port_record
from tests.support.servers import free_port

# Binds the --port it is given (SO_REUSEADDR, as vLLM does), says so, and serves until told to stop
# (or exits at once with "once"): a bind that fails raises Python's own "[Errno 98] Address already in use".
SERVER = """
import socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen()
print(f"bound {port}", flush=True)
if sys.argv[1] == "serve":
    while True:
        conn, _ = s.accept()
        conn.sendall(b"hello")
        conn.close()
"""


@pytest.fixture
def server(tmp_path):
    path = tmp_path / "server.py"
    path.write_text(SERVER)
    return [sys.executable, str(path)]


@pytest.fixture
def held():
    """A port another process holds (listening) on this machine."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_an_unset_port_is_a_free_one_where_the_server_runs_and_is_recorded(tmp_path, server, capfd):
    record = tmp_path / "port.json"
    assert launch("127.0.0.1", None, record, [*server, "once"]) == 0
    got = read_port_record(record)
    assert got["node"] == socket.gethostname() and got["attempt"] == 1 and "error" not in got
    assert f"bound {got['port']}" in capfd.readouterr().out  # the server was given the recorded port


def test_a_pick_taken_before_the_server_binds_it_is_never_tried_again(tmp_path, server, held, capfd):
    record = tmp_path / "port.json"
    picks = iter([held, free_port()])
    assert launch("127.0.0.1", None, record, [*server, "once"], pick=lambda host: next(picks)) == 0
    got = read_port_record(record)
    out = capfd.readouterr().out
    assert "Address already in use" in out and f"port {held} on" in out and "picking another" in out
    assert got["attempt"] == 2 and got["port"] != held and f"bound {got['port']}" in out


def test_a_set_port_that_is_taken_starts_nothing_and_names_port_and_node(tmp_path, server, held):
    record, started = tmp_path / "port.json", tmp_path / "started"
    cmd = [sys.executable, "-c", f"open({str(started)!r}, 'w')"]
    assert launch("127.0.0.1", held, record, cmd) == 98
    got = read_port_record(record)
    assert f"port {held} is already in use on {socket.gethostname()}" in got["error"] and "server.port" in got["error"]
    assert not started.exists()


def test_the_launcher_serves_on_its_recorded_port_and_passes_sigterm_on(tmp_path, server):
    """As a server is run: the launcher script under -I (no PYTHONPATH, no script directory on its path)."""
    record = tmp_path / "port.json"
    cmd = launcher_command(sys.executable, "127.0.0.1", None, record, [*server, "serve"])
    assert cmd[:3] == [sys.executable, "-I", LAUNCHER] and "--want" in cmd and cmd[cmd.index("--want") + 1] == "auto"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not read_port_record(record) and time.monotonic() < deadline:
            time.sleep(0.05)
        port = json.loads(record.read_text())["port"]
        for _ in range(100):  # the server binds a moment after the record is written
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
                    assert c.recv(5) == b"hello"
                break
            except ConnectionRefusedError:
                time.sleep(0.1)
        else:
            pytest.fail(f"nothing listens on the recorded port {port}")
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and f"serving on port {port}" in out and f"bound {port}" in out
    with socket.socket() as s:  # the server is gone with the launcher: its port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
