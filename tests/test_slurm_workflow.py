"""The whole workflow up to draft/checkpoint through the real one-node SLURM cluster of ci/slurm_up.sh:
--profile profiles/slurm, the vLLM server (the real toy target) as its own SLURM job, every other
heavy rule a SLURM job. Fails (does not skip) when no cluster answers."""
import re
import time

import pytest

from conftest import run_snakemake, write_config
from eaglenest.server import ServerConfig
from eaglenest.slurm import job_name
from test_slurm import ROOT, _scontrol_job, cluster, cluster_up  # noqa: F401  (the fixtures)

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.timeout(1500)]


def test_workflow_runs_through_slurm_up_to_the_draft(tmp_path, cluster):  # noqa: F811
    wd = tmp_path / "wf"
    cfg = write_config(wd, dataset={"limit": 24, "heldout": 4},
                 server={"mode": "slurm", "slurm": {"cpus": 1, "mem": "3G", "gpus": 0, "time": "30:00"}},
                 train={"max_steps": 10, "batch_tokens": 2048, "save_every": 5},
                 hidden={"dtype": "float32", "max_length": 512})
    # The run cancels its server job itself; the fixture cancels it (by its whole name) if the test fails.
    cluster.append(job_name(ServerConfig.from_dict(cfg["server"]), wd))
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
        info = _scontrol_job(job_id)
        if not info:  # ended more than MinJobAge (300 s) ago: SLURM no longer knows it
            forgotten.append(job_id)
            continue
        assert f"JobId={job_id}" in info and "JobState=COMPLETED" in info, info
    assert len(forgotten) < len(submitted), f"SLURM forgot every rule job: {submitted}"
    # The server was its own SLURM job, cancelled once the last trace shard was done.
    logs = list((wd / "logs/server").glob("vllm.slurm-*.log"))
    assert len(logs) == 1
    server_job = logs[0].name.split("-")[1].split(".")[0]
    info = _scontrol_job(server_job)  # empty once SLURM forgot it (cancelled over MinJobAge ago)
    assert not info or ("JobName=eaglenest-server-" in info and "JobState=CANCELLED" in info), info
    assert "server ready" in (wd / "logs/server_ready.log").read_text()
    # hidden.backend vllm (the default): the extraction server was a second SLURM job, cancelled
    # once the last hidden shard was extracted.
    hidden_logs = list((wd / "logs/hidden_server").glob("vllm.slurm-*.log"))
    assert len(hidden_logs) == 1
    hidden_job = hidden_logs[0].name.split("-")[1].split(".")[0]
    info = _scontrol_job(hidden_job)
    assert "JobName=eaglenest-server-" in info and "JobState=CANCELLED" in info, info
    assert "extract_hidden_states" in hidden_logs[0].read_text()
    assert "extract_hidden_vllm" in rule_jobs.values()
    assert (wd / "draft/checkpoint/config.json").exists() and (wd / "draft/checkpoint/model.safetensors").exists()
    print(f"SLURM run: {len(submitted)} rule jobs + server jobs {server_job}, {hidden_job} in {seconds:.0f} s; {rule_jobs}")
