"""server.replicas: 2 in local mode, with real vLLM servers of the toy on this machine.

One workflow run (to server.stopped: the traces, then the servers stopped after the last shard) with
two replicas serves every assert: both replicas answer; replica 1 is killed (-9, its whole process
group) mid-shard and the run finishes on replica 0 with nothing lost or duplicated; the traces equal a
one-replica run's at temperature 0 (the session's toy server, sent the same prompts); afterwards no
server process is left and both ports are free. Each replica takes a free port of its own (serving.port)."""
import json
import os
import signal
import subprocess
import time

import pytest

from eaglenest.config import validate_config
from eaglenest.data.traces import generate_shard
from eaglenest.serving.local import LocalPaths, read_pidfile
from eaglenest.settings import GenerationSettings
from tests.support.config import write_config
from tests.support.servers import server_gone, wait_port
from tests.support.workflow import prompt_ids, read_lines, snakemake_cmd, start_workflow

pytestmark = pytest.mark.vllm


def wait_for(what, check, proc, timeout=600.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        assert proc.poll() is None, f"the workflow ended before {what}:\n{proc.stdout.read()[-4000:]}"
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def replicas_run(tmp_path_factory):
    """The two-replica run, and beside it a second workflow started at the same moment on this machine
    with the same (default) port settings: three servers of two workflows starting at once."""
    wd, wd_b = tmp_path_factory.mktemp("replicas"), tmp_path_factory.mktemp("beside")
    # one shard of 120 prompts, 8 in flight: long enough to kill replica 1 in its middle
    cfg = write_config(wd, server={"replicas": 2}, shards=1, dataset={"limit": 120, "heldout": 8},
                       generation={"concurrency": 8})
    cfg_b = write_config(wd_b, shards=1, dataset={"limit": 8, "heldout": 0}, generation={"concurrency": 8})
    assert cfg["server"].get("port") == cfg_b["server"].get("port") is None  # the same default: nothing set
    t0 = time.monotonic()
    proc = start_workflow(wd, "server.stopped")
    with open(wd_b / "snakemake.out", "w") as out_b:
        beside = subprocess.Popen(snakemake_cmd(wd_b, "server.stopped"), stdout=out_b, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    records, ports = {}, {}
    try:
        for i in range(2):
            paths = LocalPaths(wd / "logs/server" / (f"replica_{i}" if i else ""))
            records[i] = wait_for(f"replica {i}'s pidfile", lambda: read_pidfile(paths), proc)
            ports[i] = wait_port(paths.log_dir)
        urls = [f"http://127.0.0.1:{ports[i]}" for i in range(2)]
        assert ports[0] != ports[1]

        def replica_1_answered():
            parts = list((wd / "traces/partial").glob("shard_0*.jsonl")) if (wd / "traces/partial").exists() else []
            lines = [line for line in parts[0].read_text().split("\n")[:-1] if line.strip()] if parts else []
            return lines if any(json.loads(line)["server"] == urls[1] for line in lines) else None

        before = wait_for("an answer from replica 1", replica_1_answered, proc)
        os.killpg(records[1]["pgid"], signal.SIGKILL)  # the replica dies mid-shard
        out, _ = proc.communicate(timeout=900)
        beside.wait(timeout=600)
    finally:
        for p in (proc, beside):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
                p.wait(60)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, out[-6000:]
    return {"wd": wd, "cfg": cfg, "urls": urls, "ports": ports, "records": records, "before": before, "out": out,
            "seconds": seconds, "beside": (wd_b, beside.returncode)}


def test_both_replicas_answer_and_one_killed_mid_shard_loses_nothing(replicas_run):
    wd, urls = replicas_run["wd"], replicas_run["urls"]
    traces = read_lines(wd / "traces/shard_0.jsonl")
    assert sorted(r["id"] for r in traces) == prompt_ids(wd, 1), "every prompt answered exactly once"
    by_id = {r["id"]: r for r in traces}
    for line in replicas_run["before"]:  # what was finished before the kill is kept as it was
        assert by_id[json.loads(line)["id"]] == json.loads(line)
    stats = json.loads((wd / "traces/shard_0.stats.json").read_text())
    answered = stats["answered_per_url"]
    assert answered[urls[1]] > 0 and answered[urls[0]] > answered[urls[1]], answered
    assert sum(answered.values()) == len(traces) and stats["errors"] == 0
    log = (wd / "logs/generate_traces/shard_0.log").read_text()
    assert f"the replica at {urls[1]} stopped answering" in log and "dropped" in log
    print(f"2 replicas, replica 1 killed mid-shard: {len(traces)} traces, answered {answered}, "
          f"shard wall {stats['wall_s']} s, workflow {replicas_run['seconds']:.0f} s")


def test_a_workflow_started_beside_it_with_the_same_port_settings_finishes_too(replicas_run):
    """Before ports were taken where the server runs, both would have asked for the same configured port."""
    wd_b, returncode = replicas_run["beside"]
    assert returncode == 0, (wd_b / "snakemake.out").read_text()[-6000:]
    assert sorted(r["id"] for r in read_lines(wd_b / "traces/shard_0.jsonl")) == prompt_ids(wd_b, 1)
    port_b = wait_port(wd_b / "logs/server", timeout=0)
    assert port_b not in replicas_run["ports"].values(), (port_b, replicas_run["ports"])
    server_gone(port_b)


def test_the_traces_equal_a_one_replica_run_at_temperature_0(replicas_run, toy_server, tmp_path):
    wd, cfg = replicas_run["wd"], replicas_run["cfg"]
    server_cfg, _ = toy_server
    settings = GenerationSettings.from_config(validate_config(cfg)).replace(model="toy")
    stats = generate_shard(wd / "data/prompts/shard_0.jsonl", tmp_path / "shard_0.jsonl", settings,
                           urls=[server_cfg.url_at(server_cfg.port)], progress=False)
    two = {r["id"]: r for r in read_lines(wd / "traces/shard_0.jsonl")}
    one = {r["id"]: r for r in read_lines(tmp_path / "shard_0.jsonl")}
    keys = ("prompt_token_ids", "completion_token_ids", "reasoning", "content", "finish_reason")
    assert {i: [r[k] for k in keys] for i, r in two.items()} == {i: [r[k] for k in keys] for i, r in one.items()}
    print(f"1 replica (the session's toy server): {len(one)} traces, shard wall {stats['wall_s']} s")


def test_no_server_is_left_and_both_ports_are_free(replicas_run):
    wd, records = replicas_run["wd"], replicas_run["records"]
    for i in range(2):
        server_gone(replicas_run["ports"][i], pgids=[records[i]["pgid"]])
        assert read_pidfile(LocalPaths(wd / "logs/server" / (f"replica_{i}" if i else ""))) is None
    assert not (wd / "server.ready").exists()
    assert "server (logs/server): stopped" in (wd / "logs/stop_server.log").read_text()  # replica 0; 1 was dead
