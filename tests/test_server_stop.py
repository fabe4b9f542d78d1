"""The local server never outlives the workflow that started it, checked on processes and ports: a
`kill -9` of Snakemake itself mid-generation (the watchdog stops vLLM) and a SIGINT (the Snakefile's
onerror stops it before Snakemake exits). Real Snakemake, real vLLM on the toy target: each test starts
one or two servers (about a minute each on 2 cores)."""
import os
import signal
import time

import pytest

from eaglenest.serving.local import LocalPaths, read_pidfile, stop_local
from tests.support.config import write_config
from tests.support.processes import descendants
from tests.support.servers import server_gone, servers_gone, wait_port
from tests.support.workflow import assert_traces_complete, finished_before, run_snakemake, start_workflow, wait_partial

pytestmark = pytest.mark.vllm


def _server_record(wd, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = read_pidfile(LocalPaths(wd / "logs/server"))
        if record:
            return record
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    pytest.fail("the workflow started no server")


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def _kill_leftovers(procs):
    """End the processes this test's workflow started, given as {pid: command line} taken while they
    were its descendants (a pid reused since by another process is left alone)."""
    for pid, cmdline in procs.items():
        if _cmdline(pid) == cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# Enough questions that the kill lands mid-shard, after the first 20 answers, and few for the rerun to finish.
KILL_PROMPTS = 48


def test_kill_9_of_snakemake_leaves_no_vllm_and_a_rerun_finishes(tmp_path):
    wd = tmp_path / "kill9"
    write_config(wd, dataset={"limit": KILL_PROMPTS, "heldout": 0}, shards=1, generation={"concurrency": 4})
    proc = start_workflow(wd, "traces/shard_0.jsonl")
    below = {}
    try:
        partial = wait_partial(wd, 20, proc)
        record = _server_record(wd, proc)
        port = wait_port(wd / "logs/server")
        below = {pid: _cmdline(pid) for pid in descendants(proc.pid)}
        proc.kill()  # SIGKILL: no onerror, no cleanup of any kind; only the watchdog is left
        proc.wait()
        t0 = time.monotonic()
        server_gone(port, pgids=[record["pgid"]], timeout=60)
        print(f"watchdog: server gone {time.monotonic() - t0:.1f} s after kill -9 of Snakemake")
        # The orphaned job may still be retrying against the dead server: it is ours, end it.
        _kill_leftovers(below)
        before = finished_before(partial)
        assert 20 <= len(before) < KILL_PROMPTS
        # A kill -9 leaves Snakemake's lock behind: the user unlocks, as Snakemake's message says.
        run_snakemake(wd, "--unlock")
        run_snakemake(wd, "traces/shard_0.jsonl", "--rerun-incomplete")
        assert_traces_complete(wd, before)
        servers_gone(wd)  # the rerun's server too (its own free port)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the test failed before its kill: end what it started
            proc.wait()
        _kill_leftovers(below)
        stop_local(LocalPaths(wd / "logs/server"))


def test_sigint_stops_the_server_through_onerror_before_snakemake_exits(tmp_path):
    wd = tmp_path / "sigint"
    # every bundled prompt: the interrupt must land while the shard is still being generated
    write_config(wd, dataset={"limit": 2000, "heldout": 0}, shards=1, generation={"concurrency": 4})
    proc = start_workflow(wd, "traces/shard_0.jsonl")
    try:
        wait_partial(wd, 20, proc)
        record = _server_record(wd, proc)
        port = wait_port(wd / "logs/server")
        # Ctrl-C in a terminal reaches the foreground process group: Snakemake and its jobs (the server
        # and its watchdog run in sessions of their own and get nothing).
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        # Checked the moment Snakemake has exited, with no grace: the watchdog (which polls every 2 s
        # once the workflow is gone) cannot have done it; onerror did.
        server_gone(port, pgids=[record["pgid"]], timeout=0.5)
        assert "eaglenest: stopped vLLM" in out and "interrupted" in out, out[-3000:]
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stop_local(LocalPaths(wd / "logs/server"))
