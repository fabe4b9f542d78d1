"""The server's SLURM job: the SLURM commands (sbatch, squeue, scontrol) and what they answer, the job's name,
batch script and sbatch command, its record, and its submission (serving.slurm says how a job is found again
and why the key never reaches sbatch's command line)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ServerError
from ..util import file_in, say, write_atomic
from .backend import watchdog_command
from .local import guarded_server_command, launch_env, server_command
from .port import PORT_FILE
from .settings import ServerConfig, SlurmSettings, check_model_path
from .slurm_cluster import gpu_partition
from .vllm import server_parallel


JOB_PREFIX = "eaglenest-server-"
# States in which a job may still serve; anything else means it has ended (or is ending).
ALIVE = {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"}
# Reasons a pending job never leaves the queue by itself: fail now instead of waiting forever.
NEVER_STARTS = {"PartitionConfig", "PartitionTimeLimit", "PartitionNodeLimit", "InvalidAccount", "InvalidQOS",
                "BadConstraints", "QOSMaxWallDurationPerJobLimit", "AssocMaxWallDurationPerJobLimit",
                "DependencyNeverSatisfied"}
CANCEL_GRACE_S = 60.0


def server_job_gpus(cfg: ServerConfig, settings: SlurmSettings) -> int:
    """GPUs of the server's job: server.slurm.gpus, else the GPUs one server uses (tensor_parallel_size, times
    any pipeline or data-parallel size in extra_args: serving.vllm.server_parallel)."""
    return math.prod(server_parallel(cfg).values()) if settings.gpus is None else settings.gpus


@dataclass
class SlurmPaths:
    """Where the server job's record and logs live (the workflow's logs/server/)."""

    log_dir: Path
    record = file_in("log_dir", "slurm.job.json")
    log_pattern = file_in("log_dir", "vllm.slurm-%j.log")  # sbatch puts the job id in place of %j
    port_record = file_in("log_dir", PORT_FILE)  # written on the node by the job's port launcher


# ---------------------------------------------------------------------------------------------
# SLURM commands


def run_slurm(args: list[str], *, input: str | None = None, env: dict | None = None,
           check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    if shutil.which(args[0]) is None:
        raise ServerError(f"server.mode is 'slurm' but `{args[0]}` is not on PATH: run the workflow where the SLURM "
                          f"client tools are installed (for a one-node test cluster: ci/slurm.sh up)")
    try:
        out = subprocess.run(args, input=input, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise ServerError(f"`{shlex.join(args)}` did not answer within {timeout:g} s: is slurmctld up?") from e
    if check and out.returncode != 0:
        raise ServerError(f"`{shlex.join(args)}` failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out


def _parse_squeue(stdout: str) -> list[dict]:
    jobs = []
    for line in stdout.splitlines():
        parts = line.strip().split("|", 5)
        if len(parts) == 6:
            job_id, state, node, reason, comment, name = parts
            jobs.append({"job_id": job_id, "state": state, "node": node, "reason": reason.strip("()"),
                         "comment": comment, "name": name})
    return jobs


SQUEUE_FORMAT = "%i|%T|%N|%r|%k|%j"


def find_jobs(name: str) -> list[dict]:
    """This user's pending or running jobs called `name`: [{job_id, state, node, reason, comment, name}]."""
    out = run_slurm(["squeue", "--me", "--noheader", "--name", name, "--format", SQUEUE_FORMAT])
    return [j for j in _parse_squeue(out.stdout) if j["state"] in ALIVE]


def job_info(job_id: str) -> dict | None:
    """The job's state (also for a job that ended less than MinJobAge ago); None once SLURM forgot it."""
    out = run_slurm(["squeue", "--noheader", "--states=all", "--jobs", str(job_id), "--format", SQUEUE_FORMAT],
                 check=False)
    jobs = [j for j in _parse_squeue(out.stdout) if j["job_id"] == str(job_id)]
    return jobs[0] if jobs else None


def _scontrol_fields(kind: str, ident: str) -> dict:
    out = run_slurm(["scontrol", "--oneliner", "show", kind, str(ident)], check=False)
    fields = {}
    for token in out.stdout.split():
        key, sep, value = token.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


def node_address(node: str) -> str:
    """The address other nodes reach `node` at (NodeAddr; it can differ from the node's name)."""
    return _scontrol_fields("node", node).get("NodeAddr") or node


def end_summary(job_id: str, info: dict | None) -> str:
    fields = _scontrol_fields("job", job_id)
    state = (info or {}).get("state") or fields.get("JobState") or "no longer known to SLURM"
    details = [f"{k}={fields[k]}" for k in ("Reason", "ExitCode") if fields.get(k) not in (None, "None", "0:0")]
    return state + (f" ({', '.join(details)})" if details else "")


# ---------------------------------------------------------------------------------------------
# Submitting


def job_name(cfg: ServerConfig, log_dir: str | Path) -> str:
    """`eaglenest-server-<hash>`: the same record directory (``SlurmPaths.log_dir``, inside the workflow
    directory), model and port setting give the same name."""
    key = f"{Path(log_dir).resolve()}\n{cfg.model}\n{cfg.port}"
    return JOB_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:10]


def server_config(cfg: ServerConfig) -> ServerConfig:
    """The config the job serves with: listening on every interface, so other nodes reach it."""
    return dataclasses.replace(cfg, host="0.0.0.0") if cfg.host in ("127.0.0.1", "localhost") else cfg


def batch_script(cfg: ServerConfig, paths: SlurmPaths) -> str:
    """The job's script: vLLM's command line under the port launcher only (settings by sbatch options,
    secrets by environment); the launcher takes the port on the node the job runs on."""
    cmd = shlex.join(server_command(server_config(cfg), paths.port_record))
    return ("#!/bin/bash\n"
            "# eaglenest generation server (server.mode: slurm). An API key, if any, comes by environment.\n"
            f"echo \"=== $(date '+%F %T') SLURM job $SLURM_JOB_ID on $(hostname): \"{shlex.quote(cmd)}\n"
            f"exec {cmd}\n")


def sbatch_command(cfg: ServerConfig, settings: SlurmSettings, paths: SlurmPaths,
                   workdir: str | Path | None = None) -> list[str]:
    """sbatch's argument list (the script goes on stdin)."""
    workdir = Path(workdir or os.getcwd()).resolve()
    gpus, partition = server_job_gpus(cfg, settings), gpu_partition(settings)
    args = ["sbatch", "--parsable", "--job-name", job_name(cfg, paths.log_dir),
            "--output", str(paths.log_pattern.resolve()), "--open-mode=append", "--chdir", str(workdir),
            "--export=ALL", "--nodes=1", "--ntasks=1", f"--cpus-per-task={settings.cpus}",
            f"--time={settings.time}"]
    if gpus:
        args.append(f"--gres=gpu:{gpus}")
    if settings.mem is not None:
        args.append(f"--mem={settings.mem}")
    if partition:
        args.append(f"--partition={partition}")
    if settings.account:
        args.append(f"--account={settings.account}")
    return args + [str(a) for a in settings.extra_sbatch_args]


def settings_hash(cfg: ServerConfig, settings: SlurmSettings, paths: SlurmPaths,
                  workdir: str | Path | None = None, api_key: str | None = None) -> str:
    """What the job was submitted with: a job with another hash is not reused. The key enters only
    through a hash of it, so a job serving with an older key is replaced rather than refusing us."""
    key_digest = hashlib.sha256(api_key.encode()).hexdigest() if api_key else None
    what = [sbatch_command(cfg, settings, paths, workdir), batch_script(cfg, paths), sorted(cfg.env.items()), key_digest]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:12]


def read_record(paths: SlurmPaths) -> dict | None:
    try:
        return json.loads(paths.record.read_text())
    except (OSError, ValueError):
        return None


def submit_server(cfg: ServerConfig, settings: SlurmSettings | dict | None, paths: SlurmPaths, *,
                  workdir: str | Path | None = None, workflow_pid: int | None = None,
                  sentinel: str | Path | None = None, log=say) -> dict:
    """Submit vLLM as a SLURM job, or reuse the pending/running job this workflow submitted before.

    Returns the record (also written to paths.record): job_id, name, log, port, model, ...
    `workflow_pid`: a watchdog cancels the job when that process dies (unless server.keep_server).
    `sentinel` (server.ready) is removed whenever the job is cancelled."""
    if not isinstance(settings, SlurmSettings):
        settings = SlurmSettings.from_dict(settings)
    check_model_path(cfg.model)
    workdir = Path(workdir or os.getcwd()).resolve()
    paths.log_dir.mkdir(parents=True, exist_ok=True)
    api_key = cfg.api_key(create=True)
    name, digest = job_name(cfg, paths.log_dir), settings_hash(cfg, settings, paths, workdir, api_key)
    comment = f"eaglenest:{digest}"
    record = read_record(paths)

    job = None
    for found in find_jobs(name):
        if found["comment"] == comment and job is None:
            job = found
        else:
            log(f"cancelling SLURM job {found['job_id']} ({name}): it was submitted with other settings")
            run_slurm(["scancel", found["job_id"]], check=False)
    if job is not None:
        log(f"reusing the server job this workflow submitted before: SLURM job {job['job_id']} ({job['state']})")
        if not (record and record.get("job_id") == job["job_id"]):
            stdout = _scontrol_fields("job", job["job_id"]).get("StdOut")
            record = {"job_id": job["job_id"], "name": name, "comment": comment, "port": cfg.port,
                      "model": cfg.model_id, "log": stdout or str(paths.log_pattern).replace("%j", job["job_id"]),
                      "submitted_at": time.time(), "workdir": str(workdir)}
        record.update(reused=True, keep=cfg.keep_server,
                      sentinel=str(Path(sentinel).resolve()) if sentinel else record.get("sentinel"))
    else:
        args = sbatch_command(cfg, settings, paths, workdir)
        args[1:1] = ["--comment", comment]
        # The job gets the one server launch environment (--export=ALL); SLURM_* of an enclosing
        # allocation would leak into the new job's settings. SLURM_CONF stays: it says which cluster
        # sbatch talks to (a site's module sets it; so do the tests, for their own cluster).
        env = launch_env(cfg, api_key, drop_prefixes=("SLURM_",))
        if "SLURM_CONF" in os.environ:
            env.setdefault("SLURM_CONF", os.environ["SLURM_CONF"])
        out = run_slurm(args, input=batch_script(cfg, paths), env=env, check=False)
        if out.returncode != 0:
            why = "; ".join(line.strip() for line in out.stderr.splitlines() if line.strip())
            raise ServerError(f"sbatch refused the server job: {why}\n  sbatch call: {shlex.join(args)}\n"
                              f"Check server.slurm (partition, account, time, cpus, mem, gpus, extra_sbatch_args)")
        job_id = out.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise ServerError(f"sbatch answered {out.stdout.strip()!r}, not a job id")
        record = {"job_id": job_id, "name": name, "comment": comment, "port": cfg.port, "model": cfg.model_id,
                  "log": str(paths.log_pattern.resolve()).replace("%j", job_id), "submitted_at": time.time(),
                  "workdir": str(workdir), "sbatch": args, "command": guarded_server_command(server_config(cfg)),
                  "reused": False, "keep": cfg.keep_server,
                  "sentinel": str(Path(sentinel).resolve()) if sentinel else None}
        log(f"submitted vLLM as SLURM job {job_id} ({name}); log: {record['log']}")
    if workflow_pid and not cfg.keep_server and record.get("workflow_pid") != workflow_pid:
        watchdog = subprocess.Popen(watchdog_command("slurm", workflow_pid, record["job_id"], paths.log_dir),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        record.update(workflow_pid=workflow_pid, watchdog_pid=watchdog.pid)
    write_atomic(paths.record, record, indent=1)
    return record
