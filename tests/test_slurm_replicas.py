"""server.replicas: 2 with server.mode slurm: two server jobs of the real toy target on the tests'
one-node cluster (conftest's slurm_cluster), one vLLM start each, shared by the tests in file order.

A run with server.keep_server up to shard 0's traces: the plan shows 2 server jobs, both serve it, both
stay up. A rerun that fails reuses both running jobs, then cancels both."""
import json
import time

import pytest
import yaml

from eaglenest.serving.settings import ServerConfig
from eaglenest.serving.slurm_jobs import ALIVE, SlurmPaths, find_jobs, job_info, job_name, read_record
from tests.support.config import TOY_PROMPTS, write_config
from tests.support.servers import server_gone, wait_port
from tests.support.slurm import slurm_command
from tests.support.workflow import read_lines, run_snakemake

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.timeout(1500)]

SMALL = {"dataset": {"path": str(TOY_PROMPTS), "limit": 24, "heldout": 2}, "shards": 2,
         "generation": {"max_tokens": 16, "concurrency": 4, "request_timeout": 300, "max_retries": 1}}
SERVER = {"mode": "slurm", "replicas": 2, "keep_server": True,
          "slurm": {"cpus": 1, "mem": "3G", "gpus": 0, "time": "20:00"}}


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory, slurm_cluster):
    wd = tmp_path_factory.mktemp("slurm_replicas")
    cfg = write_config(wd, **SMALL, server=SERVER)  # each job takes a free port on its node
    dirs = [wd / "logs/server" / (f"replica_{i}" if i else "") for i in range(2)]
    names = [job_name(ServerConfig.from_dict(cfg["server"]), d) for d in dirs]
    try:
        t0 = time.monotonic()
        out = run_snakemake(wd, "traces/shard_0.jsonl", timeout=900)
        records = [read_record(SlurmPaths(d)) for d in dirs]
        assert all(records), "a replica's job record is missing"
        ports = [wait_port(d) for d in dirs]
        assert ports[0] != ports[1], ports
        print(f"first run, 2 server jobs {[r['job_id'] for r in records]}: {time.monotonic() - t0:.0f} s")
        yield {"wd": wd, "ports": ports, "names": names, "jobs": [r["job_id"] for r in records],
               "out": out.stdout + out.stderr}
    finally:
        for name in names:
            slurm_command(["scancel", "--me", "--name", name])


def test_the_plan_shows_two_server_jobs_and_both_serve(two_jobs):
    wd, ports = two_jobs["wd"], two_jobs["ports"]
    assert "replicas: 2 (server.replicas, server.mode slurm)" in two_jobs["out"]
    assert "GPUs, generate_traces: 2 SLURM job(s) x 0 GPUs" in two_jobs["out"]
    for job_id in two_jobs["jobs"]:
        assert job_info(job_id)["state"] == "RUNNING"  # kept (server.keep_server)
    stats = json.loads((wd / "traces/shard_0.stats.json").read_text())
    answered = stats["answered_per_url"]
    assert sorted(answered) == sorted(f"http://127.0.0.1:{port}" for port in ports)
    assert all(n > 0 for n in answered.values()), answered
    assert len(read_lines(wd / "traces/shard_0.jsonl")) == sum(answered.values())


def test_a_failed_rerun_reuses_both_jobs_then_cancels_both(two_jobs):
    wd, jobs = two_jobs["wd"], two_jobs["jobs"]
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    cfg["server"]["keep_server"] = False
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg))
    # shard 1 fails for real: its prompt shard is not one
    (wd / "data/prompts/shard_1.jsonl").write_text('{"question": "no id, no messages"}\n')
    out = run_snakemake(wd, "traces/shard_1.jsonl", timeout=600, check=False)
    states = [job_info(j) for j in jobs]
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    said = (wd / "logs/server_ready.log").read_text()
    for job_id in jobs:
        assert f"reusing the server job this workflow submitted before: SLURM job {job_id} (RUNNING)" in said, said
        assert f"cancelled the server's SLURM job {job_id} (the workflow failed or was interrupted)" in text
    assert "submitted vLLM" not in said
    assert all(s is None or s["state"] not in ALIVE | {"COMPLETING"} for s in states), states
    assert all(find_jobs(name) == [] for name in two_jobs["names"])
    for port in two_jobs["ports"]:
        server_gone(port, timeout=60)
