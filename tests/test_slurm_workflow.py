"""The workflow with its vLLM server (the real toy target) as a SLURM job of the tests' own one-node
cluster (ci/slurm.sh, conftest's slurm_cluster). Skips with the reason where that cluster cannot run.

- The whole workflow up to draft/checkpoint with --profile profiles/slurm: every heavy rule a SLURM job.
- The server job's life across runs (the rule jobs run locally: server_ready and onerror run in
  Snakemake's own process whatever the executor): a run with server.keep_server leaves the job up, a
  rerun reuses it (same job, same vLLM processes), and a run that fails cancels it. These share one
  vLLM start (module fixture `kept_server`) and run in file order."""
import json
import re
import time

import pytest
import yaml

from eaglenest.serving.settings import ServerConfig
from eaglenest.serving.slurm_jobs import ALIVE, SlurmPaths, find_jobs, job_info, job_name, read_record
from tests.support.config import ROOT, TOY_PROMPTS, write_config
from tests.support.processes import started_at, vllm_pids
from tests.support.servers import server_gone, wait_port
from tests.support.slurm import scontrol_job, slurm_command
from tests.support.workflow import run_snakemake

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.timeout(1500)]


def test_workflow_runs_through_slurm_up_to_the_draft(tmp_path, cluster):
    wd = tmp_path / "wf"
    # One shard: each SLURM job costs ~33 s here (the executor's status checks back off by 10 s), and a
    # second shard adds two jobs that show nothing the first does not.
    cfg = write_config(wd, dataset={"limit": 24, "heldout": 4}, shards=1,
                 server={"mode": "slurm", "slurm": {"cpus": 1, "mem": "3G", "gpus": 0, "time": "30:00"}},
                 train={"max_steps": 10, "batch_tokens": 2048, "save_every": 5},
                 hidden={"dtype": "float32", "max_length": 512})
    # The run cancels its server job itself; the fixture cancels it (by its whole name) if the test fails.
    cluster.append(job_name(ServerConfig.from_dict(cfg["server"]), wd / "logs/server"))
    t0 = time.monotonic()
    out = run_snakemake(wd, "draft/checkpoint", "--profile", str(ROOT / "profiles/slurm"), "--jobs", "2",
                        "--slurm-init-seconds-before-status-checks", "1", "--latency-wait", "10", timeout=1400)
    seconds = time.monotonic() - t0
    text = out.stdout + out.stderr
    rule_jobs = dict(re.findall(r"SLURM jobid (\d+) \(log: [^)]*?/rule_(\w+)/", text))
    submitted = re.findall(r"SLURM jobid (\d+)", text)
    assert submitted, text[-3000:]
    forgotten = []
    for job_id in submitted:  # every rule job really went through SLURM and finished there
        info = scontrol_job(job_id)
        if not info:  # ended more than MinJobAge (300 s) ago: SLURM no longer knows it
            forgotten.append(job_id)
            continue
        assert f"JobId={job_id}" in info and "JobState=COMPLETED" in info, info
    assert len(forgotten) < len(submitted), f"SLURM forgot every rule job: {submitted}"
    # The server was its own SLURM job, cancelled once the last trace shard was done.
    logs = list((wd / "logs/server").glob("vllm.slurm-*.log"))
    assert len(logs) == 1
    server_job = logs[0].name.split("-")[1].split(".")[0]
    info = scontrol_job(server_job)  # empty once SLURM forgot it (cancelled over MinJobAge ago)
    assert not info or ("JobName=eaglenest-server-" in info and "JobState=CANCELLED" in info), info
    assert "server ready" in (wd / "logs/server_ready.log").read_text()
    # hidden.backend vllm (the default): the extraction server was a second SLURM job, cancelled
    # once the last hidden shard was extracted.
    hidden_logs = list((wd / "logs/hidden_server").glob("vllm.slurm-*.log"))
    assert len(hidden_logs) == 1
    hidden_job = hidden_logs[0].name.split("-")[1].split(".")[0]
    info = scontrol_job(hidden_job)
    assert "JobName=eaglenest-server-" in info and "JobState=CANCELLED" in info, info
    assert "extract_hidden_states" in hidden_logs[0].read_text()
    assert "extract_hidden_vllm" in rule_jobs.values()
    assert (wd / "draft/checkpoint/config.json").exists() and (wd / "draft/checkpoint/model.safetensors").exists()
    print(f"SLURM run: {len(submitted)} rule jobs + server jobs {server_job}, {hidden_job} in {seconds:.0f} s; {rule_jobs}")


# ------------------------------------------------------------------ the server job across runs

SMALL = {"dataset": {"path": str(TOY_PROMPTS), "limit": 8, "heldout": 2}, "shards": 2,
         "generation": {"max_tokens": 16, "concurrency": 4, "request_timeout": 300, "max_retries": 1}}
SLURM_SERVER = {"mode": "slurm", "keep_server": True, "slurm": {"cpus": 1, "mem": "4G", "gpus": 0, "time": "20:00"}}


def _vllm(port):
    """{pid: start time} of the vLLM processes serving `port` (the job runs on this, the only, node)."""
    return {pid: started_at(pid) for pid in vllm_pids(port)}


@pytest.fixture(scope="module")
def kept_server(tmp_path_factory, slurm_cluster):
    """A run with server.keep_server up to traces/shard_0.jsonl: its server job stays up after it.
    Every job this workflow directory submitted is cancelled, by id, when the module ends, passed or
    failed (the job name is a hash of this directory: no other test's or user's job has it)."""
    wd = tmp_path_factory.mktemp("slurm_rerun")
    cfg = write_config(wd, **SMALL, server=SLURM_SERVER)
    name = job_name(ServerConfig.from_dict(cfg["server"]), wd / "logs/server")
    submitted = set()
    try:
        t0 = time.monotonic()
        run_snakemake(wd, "traces/shard_0.jsonl", timeout=800)
        record = read_record(SlurmPaths(wd / "logs/server"))
        assert record, "the run kept no server job record (logs/server/slurm.job.json)"
        submitted.add(record["job_id"])
        print(f"first run (vLLM submitted as SLURM job {record['job_id']}): {time.monotonic() - t0:.0f} s")
        port = wait_port(wd / "logs/server")  # the port the job's launcher took on the node
        yield {"wd": wd, "name": name, "port": port, "job_id": record["job_id"]}
    finally:
        submitted.update(j["job_id"] for j in find_jobs(name))
        for job_id in sorted(submitted):
            slurm_command(["scancel", job_id])


def test_a_rerun_reuses_the_running_server_job(kept_server):
    wd, port, job_id = kept_server["wd"], kept_server["port"], kept_server["job_id"]
    assert [j["job_id"] for j in find_jobs(kept_server["name"])] == [job_id]
    assert job_info(job_id)["state"] == "RUNNING"
    before = _vllm(port)
    assert before, f"no vLLM process serves port {port}, though SLURM job {job_id} runs"
    assert not (wd / "server.ready").exists()  # temp(): the rerun must ask for the server again

    t0 = time.monotonic()
    run_snakemake(wd, "traces/shard_1.jsonl", timeout=600)
    print(f"rerun reusing SLURM job {job_id}: {time.monotonic() - t0:.0f} s")

    said = (wd / "logs/server_ready.log").read_text()  # this run's: Snakemake removes a job's old log
    assert f"reusing the server job this workflow submitted before: SLURM job {job_id} (RUNNING)" in said, said
    assert f"(SLURM job {job_id} on " in said and "submitted vLLM" not in said, said
    # Same job, same vLLM processes (not restarted), one start in the job's log, no other job.
    assert [j["job_id"] for j in find_jobs(kept_server["name"])] == [job_id]
    assert _vllm(port) == before
    assert [p.name for p in (wd / "logs/server").glob("vllm.slurm-*.log")] == [f"vllm.slurm-{job_id}.log"]
    assert (wd / f"logs/server/vllm.slurm-{job_id}.log").read_text().count(f"SLURM job {job_id} on ") == 1
    rows = [json.loads(line) for line in (wd / "traces/shard_1.jsonl").read_text().splitlines()]
    prompts = (wd / "data/prompts/shard_1.jsonl").read_text().splitlines()
    assert rows and len(rows) == len(prompts) and all(r["completion_token_ids"] for r in rows)
    assert job_info(job_id)["state"] == "RUNNING"  # kept again (server.keep_server) for the next test


def test_a_failed_workflow_cancels_the_server_job(kept_server):
    wd, port, job_id = kept_server["wd"], kept_server["port"], kept_server["job_id"]
    assert job_info(job_id)["state"] == "RUNNING" and _vllm(port)
    # This run does not keep its server (the setting is not part of the job's: the job is reused).
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    cfg["server"]["keep_server"] = False
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg))
    # A later rule fails for real: shard 0's traces are redone from a prompt shard that is not one.
    for f in ("traces/shard_0.jsonl", "traces/shard_0.stats.json"):
        (wd / f).unlink()
    (wd / "data/prompts/shard_0.jsonl").write_text('{"question": "no id, no messages"}\n')

    t0 = time.monotonic()
    out = run_snakemake(wd, "traces/shard_0.jsonl", timeout=600, check=False)
    state = job_info(job_id)  # at once: the watchdog would cancel the job too, but only later
    seconds = time.monotonic() - t0
    text = out.stdout + out.stderr

    assert out.returncode != 0, text[-3000:]
    assert "shard_0.jsonl:1: not a prompt record" in (wd / "logs/generate_traces/shard_0.log").read_text()
    said = (wd / "logs/server_ready.log").read_text()
    assert f"reusing the server job this workflow submitted before: SLURM job {job_id} (RUNNING)" in said, said
    # The job had ended when Snakemake exited (not later, by the watchdog), cancelled by onerror.
    assert state is None or state["state"] not in ALIVE | {"COMPLETING"}, state
    assert f"cancelled the server's SLURM job {job_id} (the workflow failed or was interrupted)" in text, text[-3000:]
    assert find_jobs(kept_server["name"]) == []
    server_gone(port, timeout=60)  # no vLLM process left on the node, the port free
    assert not (wd / "logs/server/slurm.job.json").exists() and not (wd / "server.ready").exists()
    print(f"failed run, server job {job_id} cancelled: {seconds:.0f} s")


def test_the_slurm_profile_refuses_a_local_server_naming_the_slurm_preset(tmp_path, cluster):
    """A preset whose server runs locally, under the SLURM profile: vLLM would start on this (login) node while
    the rules go to the cluster. Refused before any job, naming the preset's .slurm sibling."""
    wd = tmp_path / "local_server"
    cfg = write_config(wd)  # server.mode: local
    (wd / "mine.yaml").write_text(yaml.safe_dump(cfg))
    (wd / "mine.slurm.yaml").write_text(yaml.safe_dump({**cfg, "server": {**cfg["server"], "mode": "slurm"}}))
    out = run_snakemake(wd, "--configfile", str(wd / "mine.yaml"), "--profile", str(ROOT / "profiles/slurm"),
                        check=False, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-2000:]
    assert "server.mode: local under the slurm executor" in text and f"--configfile {wd / 'mine.slurm.yaml'}" in text
    assert "SLURM jobid" not in text and not (wd / "logs/server").exists(), "a job or a server started"
