"""server.mode: slurm and profiles/slurm against the tests' own one-node SLURM cluster (ci/slurm.sh,
started by conftest's slurm_cluster; SLURM_CONF names it to every SLURM command).

These tests skip, with the reason, where that cluster cannot run (not root, no slurm-wlm); they fail
where it should start and does not.
The server tests submit a fake vLLM (a module `vllm.entrypoints.openai.api_server` put first on the
job's PYTHONPATH: it answers /v1/models like vLLM, after a second). Real vLLM as a SLURM job, the toy
target served and found ready through the workflow's own server_ready, is tested in
tests/test_slurm_workflow.py and tests/test_api_key.py. Everything submitted is cancelled at the end."""
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglenest.errors import ServerError
from eaglenest.serving.backend import watchdog_command
from eaglenest.serving.lifecycle import wait_ready
from eaglenest.serving.probe import probe
from eaglenest.serving.settings import ServerConfig
from eaglenest.serving.settings import SlurmSettings
from eaglenest.serving.slurm import cancel_server
from eaglenest.serving.slurm_jobs import ALIVE, SlurmPaths, job_info, job_name, read_record, submit_server
from tests.support.config import ROOT
from tests.support.servers import free_port
from tests.support.slurm import scontrol_job, slurm_command

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
KEY_ENV, KEY = "EAGLENEST_TEST_SLURM_KEY", "s3cret-slurm-key"

FAKE_API_SERVER = '''
"""A stand-in for vLLM's OpenAI server: /v1/models and /version, an API key from $VLLM_API_KEY."""
import argparse, json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
for a in ("--model", "--host", "--port", "--served-model-name", "--max-model-len"):
    p.add_argument(a)
a, _ = p.parse_known_args()
print(f"fake vllm: loading {a.model}", flush=True)
if a.model == "FAIL":
    print("fake vllm: RuntimeError: the model cannot be loaded", flush=True)
    sys.exit(3)
time.sleep(1.0)
key, name = os.environ.get("VLLM_API_KEY"), a.served_model_name or a.model


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            self.send_response(401); self.end_headers(); return
        body = {"/v1/models": {"object": "list", "data": [{"id": name, "max_model_len": 512}]},
                "/version": {"version": "fake"}}.get(self.path)
        if body is None:
            self.send_response(404); self.end_headers(); return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


print(f"fake vllm: serving {name} on {a.host}:{a.port}, api key set: {key is not None}", flush=True)
print(f"fake vllm: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
ThreadingHTTPServer((a.host, int(a.port)), Handler).serve_forever()
'''


@pytest.fixture
def fake_vllm(tmp_path):
    pkg = tmp_path / "fakevllm" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_API_SERVER)
    return tmp_path / "fakevllm"


def _server(tmp_path, fake_vllm, cluster, monkeypatch, **over):
    monkeypatch.setenv(KEY_ENV, KEY)
    cfg = ServerConfig(mode="slurm", model=over.pop("model", "fake-target"), served_model_name="toy", port=free_port(),
                       max_model_len=512, poll_interval=0.5, ready_timeout=60, api_key_env=KEY_ENV,
                       env={"PYTHONPATH": str(fake_vllm)})
    settings = SlurmSettings(**{"cpus": 1, "mem": "500M", "gpus": 0, "time": "10:00", **over})
    cluster.append(job_name(cfg, tmp_path / "logs" / "server"))
    return cfg, settings, SlurmPaths(tmp_path / "logs" / "server")


def _wait_gone(job_id, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info is None or info["state"] not in ALIVE | {"COMPLETING"}:
            return info
        time.sleep(0.5)
    pytest.fail(f"SLURM job {job_id} still {info['state']} {timeout} s after it was cancelled")


def test_server_job_serves_is_reused_and_cancelled(tmp_path, fake_vllm, cluster, monkeypatch):
    cfg, settings, paths = _server(tmp_path, fake_vllm, cluster, monkeypatch)
    sentinel = tmp_path / "server.ready"
    first = submit_server(cfg, settings, paths, workdir=tmp_path, sentinel=sentinel, log=lambda m: None)
    job_id = first["job_id"]
    shown = scontrol_job(job_id)
    assert f"JobId={job_id} " in shown and f"JobName={job_name(cfg, tmp_path / 'logs' / 'server')} " in shown
    assert "NumCPUs=1 " in shown and "gpu" not in shown.lower()  # gpus: 0 asks for none

    again = submit_server(cfg, settings, paths, workdir=tmp_path, sentinel=sentinel, log=lambda m: None)
    assert again["job_id"] == job_id and again["reused"]
    assert len(slurm_command(["squeue", "--me", "--noheader", "--name", first["name"]]).stdout.splitlines()) == 1

    ready = wait_ready(cfg, paths, log=lambda m: None)
    assert ready["slurm_job_id"] == job_id and ready["model"] == "toy" and ready["max_model_len"] == 512
    assert ready["urls"] == [f"http://127.0.0.1:{cfg.port}"]  # the node's NodeAddr, not its name
    assert "toy" in probe(ready["urls"][0], KEY)["models"]
    sentinel.write_text(json.dumps(ready))

    # The key reached vLLM by environment only: not in the batch script, the record or the log.
    script = slurm_command(["scontrol", "write", "batch_script", job_id, "-"]).stdout
    assert "vllm.entrypoints.openai.api_server" in script and "--host 0.0.0.0" in script
    log_text = Path(first["log"]).read_text()
    assert "api key set: True" in log_text
    for text in (script, log_text, paths.record.read_text(), shown):
        assert KEY not in text

    assert cancel_server(paths, log=lambda m: None)
    assert _wait_gone(job_id) is None or job_info(job_id)["state"] == "CANCELLED"
    assert not paths.record.exists() and not sentinel.exists()
    assert not cancel_server(paths, log=lambda m: None)


def test_a_set_port_taken_on_the_node_fails_the_job_at_once_naming_port_and_node(tmp_path, fake_vllm, cluster,
                                                                                monkeypatch):
    """server.port set and held by another process on the node the job runs on: the job's launcher starts
    no server, and the controller's error says which port on which node, within a poll or two."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        cfg, settings, paths = _server(tmp_path, fake_vllm, cluster, monkeypatch)
        cfg = dataclasses.replace(cfg, port=held.getsockname()[1])
        cluster.append(job_name(cfg, paths.log_dir))
        record = submit_server(cfg, settings, paths, workdir=tmp_path, log=lambda m: None)
        t0 = time.monotonic()
        with pytest.raises(ServerError) as e:
            wait_ready(cfg, paths, log=lambda m: None)
    said = str(e.value)
    assert f"port {cfg.port} is already in use on {socket.gethostname()} (server.port = {cfg.port})" in said, said
    assert time.monotonic() - t0 < 60
    assert "fake vllm: loading" not in Path(record["log"]).read_text()  # no server was started on it
    assert _wait_gone(record["job_id"]) is None or job_info(record["job_id"])["state"] not in ALIVE


def test_start_and_stop_server_dispatch_to_slurm_with_the_one_launch_environment(tmp_path, fake_vllm, cluster,
                                                                                 monkeypatch):
    """The same entry points the rules use; the job gets no thread-count variable (as a local server)."""
    from eaglenest.serving.lifecycle import start_server, stop_server

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.chdir(tmp_path)  # the job's name comes from the working directory
    cfg, settings, paths = _server(tmp_path, fake_vllm, cluster, monkeypatch)
    cfg = dataclasses.replace(cfg, slurm=dataclasses.asdict(settings))
    ready = start_server(cfg, paths.log_dir, log=lambda m: None)
    assert ready["mode"] == "slurm" and ready["model"] == "toy"
    log_text = Path(read_record(paths)["log"]).read_text()
    assert "fake vllm: OMP_NUM_THREADS=None" in log_text
    assert stop_server(cfg, paths.log_dir, log=lambda m: None) == "cancelled (SLURM job)"
    assert not paths.record.exists()


def test_changed_settings_replace_the_job(tmp_path, fake_vllm, cluster, monkeypatch):
    cfg, settings, paths = _server(tmp_path, fake_vllm, cluster, monkeypatch)
    old = submit_server(cfg, settings, paths, workdir=tmp_path, log=lambda m: None)["job_id"]
    cfg = dataclasses.replace(cfg, max_model_len=256)
    new = submit_server(cfg, settings, paths, workdir=tmp_path, log=lambda m: None)["job_id"]
    assert new != old
    assert _wait_gone(old)["state"] == "CANCELLED"
    assert job_info(new)["state"] in ALIVE
    cancel_server(paths, log=lambda m: None)


def test_job_that_fails_early_is_reported_with_its_log_tail(tmp_path, fake_vllm, cluster, monkeypatch):
    cfg, settings, paths = _server(tmp_path, fake_vllm, cluster, monkeypatch, model="FAIL")
    job_id = submit_server(cfg, settings, paths, workdir=tmp_path, log=lambda m: None)["job_id"]
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        wait_ready(cfg, paths, log=lambda m: None)
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert job_id in msg and "FAILED" in msg and "ExitCode=3:0" in msg
    assert "RuntimeError: the model cannot be loaded" in msg
    assert not paths.record.exists()


def test_sbatch_refusal_names_the_settings(tmp_path, fake_vllm, cluster, monkeypatch):
    cfg, settings, paths = _server(tmp_path, fake_vllm, cluster, monkeypatch, mem="100000G")
    refused = r"sbatch refused the server job: .*not available\n.*--mem=100000G\nCheck server\.slurm"
    with pytest.raises(ServerError, match=refused):
        submit_server(cfg, settings, paths, workdir=tmp_path, log=lambda m: None)
    assert read_record(paths) is None


def test_job_that_can_never_start_fails_at_once(tmp_path, fake_vllm, cluster, monkeypatch):
    # More CPUs than the partition has: sbatch accepts it, SLURM keeps it pending for ever.
    cfg, settings, paths = _server(tmp_path, fake_vllm, cluster, monkeypatch, cpus=4096)
    job_id = submit_server(cfg, settings, paths, workdir=tmp_path, log=lambda m: None)["job_id"]
    with pytest.raises(ServerError, match=f"never start the server job {job_id}: PartitionConfig"):
        wait_ready(cfg, paths, log=lambda m: None)
    assert _wait_gone(job_id)["state"] == "CANCELLED"


def test_watchdog_cancels_the_job_when_the_workflow_dies(tmp_path, fake_vllm, cluster, monkeypatch):
    cfg, settings, paths = _server(tmp_path, fake_vllm, cluster, monkeypatch)
    workflow = subprocess.Popen(["sleep", "600"])
    try:
        record = submit_server(cfg, settings, paths, workdir=tmp_path, workflow_pid=workflow.pid, log=lambda m: None)
        assert record["watchdog_pid"]
        # The watchdog's default look every 10 s is too slow for a test: run one that looks every second.
        os.kill(record["watchdog_pid"], signal.SIGTERM)
        watchdog = subprocess.Popen(watchdog_command("slurm", workflow.pid, record["job_id"], paths.log_dir, interval=1),
                                    cwd=ROOT)
        time.sleep(2)
        assert job_info(record["job_id"])["state"] in ALIVE
    finally:
        workflow.kill()
        workflow.wait()
    watchdog.wait(timeout=30)
    assert _wait_gone(record["job_id"])["state"] == "CANCELLED"
    assert not paths.record.exists()


TWO_RULES = """
rule all:
    input: "b.txt"

rule cpu_step:
    output: "a.txt"
    threads: 2
    resources: gpu=0
    shell: "echo job=$SLURM_JOB_ID cpus=$SLURM_CPUS_PER_TASK > {output}"

rule next_step:
    input: "a.txt"
    output: "b.txt"
    shell: "cat {input} > {output}; echo job=$SLURM_JOB_ID >> {output}"
"""


def test_profile_sends_rules_through_slurm(tmp_path, cluster):
    (tmp_path / "Snakefile").write_text(TWO_RULES)
    # No SBATCH_/SLURM_ settings of the caller's, but the tests' cluster (SLURM_CONF).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "SLURM_")) or k == "SLURM_CONF"}
    env["EAGLENEST_GPU_PARTITION"] = "no-such-partition"  # only rules named in set-resources go there
    out = subprocess.run([SNAKEMAKE, "--profile", str(ROOT / "profiles" / "slurm"), "--verbose", "--retries", "0",
                          "--slurm-init-seconds-before-status-checks", "1", "--latency-wait", "5"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    submitted = [l for l in log.splitlines() if "has been submitted with SLURM jobid" in l]
    assert len(submitted) == 2, log[-6000:]
    calls = [l.split("--wrap")[0] for l in log.splitlines() if "sbatch call:" in l]
    assert len(calls) == 2
    for call in calls:  # no GPU asked for where rules declare none; time and memory from the profile
        assert "--gpus" not in call and "--gres" not in call and "no-such-partition" not in call
        assert "-t 60" in call and "--mem-per-cpu 4000" in call
    assert any("--cpus-per-task=2" in c for c in calls)
    lines = (tmp_path / "b.txt").read_text().split()
    assert lines[0].startswith("job=") and lines[0] != "job=" and "cpus=2" in lines
    assert lines[-1].startswith("job=") and lines[-1] != lines[0]


def test_the_gpu_partition_is_checked_with_sinfo_and_an_unset_one_names_the_default(slurm_cluster, monkeypatch):
    from eaglenest.errors import ConfigError
    from eaglenest.serving.slurm_cluster import check_gpu_partition, cluster_partitions

    monkeypatch.delenv("SBATCH_PARTITION", raising=False)
    monkeypatch.delenv("EAGLENEST_GPU_PARTITION", raising=False)
    partitions, default = cluster_partitions()
    real = slurm_command(["sinfo", "--noheader", "--format=%P"]).stdout.split()
    assert partitions == [p.rstrip("*") for p in real] and default in partitions
    with pytest.raises(ConfigError) as e:
        check_gpu_partition(SlurmSettings(partition="no-such-partition"), gpus=1)
    assert "'no-such-partition'" in str(e.value) and "server.slurm.partition" in str(e.value) and default in str(e.value)
    assert f"partition {default} (server.slurm.partition, listed by sinfo)" in check_gpu_partition(
        SlurmSettings(partition=default), gpus=1)
    assert f"the cluster's default partition, {default} (sinfo)" in check_gpu_partition(SlurmSettings(), gpus=1)
    assert check_gpu_partition(SlurmSettings(partition="no-such-partition"), gpus=0) is None  # no GPU job, no check
