"""`server.mode: slurm`: vLLM as its own SLURM job. Submit it (or find it again), learn its node,
wait until it serves, cancel it.

The job is named `eaglenest-server-<hash of its record directory, model, port setting>` (the record
directory tells the trace server, each replica and the extraction server apart), so a rerun finds a server job
this workflow started that is still pending or running (`squeue --me --name`) and reuses it instead
of queueing another. Its `--comment` carries a hash of the settings (command line, sbatch options,
env): a job found with other settings is cancelled and replaced, as in local mode. The job id, name
and log are kept in `logs/server/slurm.job.json` (the local mode's pidfile, for SLURM).

vLLM listens on 0.0.0.0 so jobs on other nodes reach it at http://NODE:PORT, where NODE is the
node's address as SLURM knows it (NodeAddr) and PORT the one the port launcher (serving.port) took on
that node and wrote to `logs/server/port.json` with the job's id, so the server always requires an API key (the user's,
else the run's own: serving.settings.run_key). The key goes to the job by environment only: it is in sbatch's
own environment (sbatch --export=ALL), never on sbatch's command line, in the batch script, the
record or a log. The rule jobs that talk to the server read it as the workflow does (ServerConfig.api_key).

The watchdog (serving.backend, `Backend.watch`) cancels the job when the workflow process that
asked for it dies, so an idle GPU job does not outlive its workflow until its time limit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, ServerError
from ..util import file_in, say, write_atomic
from .backend import Backend, log_tail, signal_group, watchdog_command
from .local import guarded_server_command, launch_env, server_command
from .port import PORT_FILE, read_port_record
from .settings import ServerConfig, SlurmSettings, check_model_path
from .vllm import server_parallel

JOB_PREFIX = "eaglenest-server-"
# States in which a job may still serve; anything else means it has ended (or is ending).
ALIVE = {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"}
# Reasons a pending job never leaves the queue by itself: fail now instead of waiting forever.
NEVER_STARTS = {"PartitionConfig", "PartitionTimeLimit", "PartitionNodeLimit", "InvalidAccount", "InvalidQOS",
                "BadConstraints", "QOSMaxWallDurationPerJobLimit", "AssocMaxWallDurationPerJobLimit",
                "DependencyNeverSatisfied"}
CANCEL_GRACE_S = 60.0


def gpu_partition(settings: SlurmSettings) -> str | None:
    """The partition of every GPU job, the servers' and the GPU rules': server.slurm.partition, else
    $EAGLENEST_GPU_PARTITION; None asks for none (``check_gpu_partition`` refuses that while $SBATCH_PARTITION
    is set, which would take the GPU jobs; else they go to the cluster's default partition)."""
    return settings.partition or os.environ.get("EAGLENEST_GPU_PARTITION") or None


@dataclass(frozen=True)
class NodeKind:
    """Nodes of one partition alike for sinfo: their GPUs of one type (gres), and their features."""

    partition: str
    gpus: int                 # GPUs a node has (of this type)
    gpu_type: str | None      # the gres type (e.g. h100, nvidia_h100_80gb_hbm3); None where the gres names none
    features: tuple[str, ...]
    gres: str                 # as sinfo wrote it, for messages


def sinfo_nodes() -> tuple[list[NodeKind], str | None] | None:
    """Every partition's node kinds as ``sinfo`` lists them, and the default partition; None where SLURM cannot
    be asked from here. A partition without GPUs has one kind of 0 GPUs."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(["sinfo", "--noheader", "--format=%P|%G|%f"], capture_output=True, text=True, timeout=15)
    except (subprocess.TimeoutExpired, OSError):
        return None
    if out.returncode != 0:
        return None
    kinds, default = [], None
    for line in out.stdout.splitlines():
        name, _, rest = line.strip().partition("|")
        gres, _, features = rest.partition("|")
        if not name:
            continue
        if name.endswith("*"):
            name = default = name.rstrip("*")
        feats = tuple(f for f in re.split(r"[,&|]", features) if f and f != "(null)")
        gpus = re.findall(r"gpu:(?:([^:,()]+):)?(\d+)", gres)
        kinds += [NodeKind(name, int(n), t or None, feats, gres) for t, n in gpus] or [NodeKind(name, 0, None, feats, gres)]
    return kinds, default


def cluster_partitions() -> tuple[list[str], str | None] | None:
    """(partitions, the default one) as ``sinfo`` lists them, or None where SLURM cannot be asked from here."""
    listed = sinfo_nodes()
    if listed is None:
        return None
    return list(dict.fromkeys(k.partition for k in listed[0])), listed[1]


def partition_nodes(settings: SlurmSettings, listed=None) -> list[NodeKind] | None:
    """The node kinds the GPU jobs may land on: the GPU partition's (gpu_partition, else sinfo's default), those
    with the feature a plain ``--constraint`` in extra_sbatch_args names; None where sinfo does not answer.
    ``listed``: sinfo_nodes()'s answer, where the caller has it."""
    listed = sinfo_nodes() if listed is None else listed
    if listed is None:
        return None
    partition = gpu_partition(settings) or listed[1]
    kinds = [k for k in listed[0] if k.partition == partition]
    wanted = constraint(settings.extra_sbatch_args)
    return [k for k in kinds if wanted in k.features] if wanted else kinds


def constraint(sbatch_args) -> str | None:
    """The node feature a plain ``--constraint=F`` (``-C F``) asks for; None without one, or for an expression."""
    args = [str(a) for a in sbatch_args]
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in ("--constraint", "-C"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            return value if re.fullmatch(r"[\w.-]+", value) else None
    return None


# The --time formats sbatch takes (man sbatch): minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; and no limit.
SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|infinite|unlimited", re.IGNORECASE)


def slurm_time_ok(value) -> bool:
    """Whether sbatch takes ``value`` as --time (an integer: minutes)."""
    return (isinstance(value, int) and value >= 0) or (isinstance(value, str) and bool(SLURM_TIME.fullmatch(value)))


def check_gpu_partition(settings: SlurmSettings, gpus: int) -> str | None:
    """Where the GPU jobs go, checked before any job. Refuses (ConfigError) a GPU partition ``sinfo`` does
    not list, and GPU jobs without a GPU partition where $SBATCH_PARTITION is set (sbatch would queue them
    there, and on a login node it usually names a CPU partition). Returns a line for the log: the partition,
    or, with none set, that the cluster's default takes them."""
    if not gpus:
        return None
    partition, listed = gpu_partition(settings), cluster_partitions()
    key = "server.slurm.partition" if settings.partition else "$EAGLENEST_GPU_PARTITION"
    if partition is not None:
        if listed is not None and partition not in listed[0]:
            raise ConfigError(f"{key} is {partition!r}, which is not a partition of this cluster (sinfo lists "
                              f"{', '.join(listed[0]) or 'none'}); set it to the partition of your GPU nodes")
        return f"GPU jobs go to partition {partition} ({key}{', listed by sinfo' if listed else ''})"
    if os.environ.get("SBATCH_PARTITION"):
        raise ConfigError(f"server.mode is slurm and no GPU partition is set: the GPU jobs would go to "
                          f"$SBATCH_PARTITION ({os.environ['SBATCH_PARTITION']}). Set server.slurm.partition (or "
                          f"$EAGLENEST_GPU_PARTITION) to the partition of your GPU nodes")
    default = f"the cluster's default partition, {listed[1]} (sinfo)" if listed and listed[1] else \
        "the cluster's default partition"
    return (f"no GPU partition set (server.slurm.partition, $EAGLENEST_GPU_PARTITION): GPU jobs go to {default}; "
            f"set one if that is not where your GPU nodes are")


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


def _slurm(args: list[str], *, input: str | None = None, env: dict | None = None,
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
    out = _slurm(["squeue", "--me", "--noheader", "--name", name, "--format", SQUEUE_FORMAT])
    return [j for j in _parse_squeue(out.stdout) if j["state"] in ALIVE]


def job_info(job_id: str) -> dict | None:
    """The job's state (also for a job that ended less than MinJobAge ago); None once SLURM forgot it."""
    out = _slurm(["squeue", "--noheader", "--states=all", "--jobs", str(job_id), "--format", SQUEUE_FORMAT],
                 check=False)
    jobs = [j for j in _parse_squeue(out.stdout) if j["job_id"] == str(job_id)]
    return jobs[0] if jobs else None


def _scontrol_fields(kind: str, ident: str) -> dict:
    out = _slurm(["scontrol", "--oneliner", "show", kind, str(ident)], check=False)
    fields = {}
    for token in out.stdout.split():
        key, sep, value = token.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


def node_address(node: str) -> str:
    """The address other nodes reach `node` at (NodeAddr; it can differ from the node's name)."""
    return _scontrol_fields("node", node).get("NodeAddr") or node


def _end_summary(job_id: str, info: dict | None) -> str:
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
            _slurm(["scancel", found["job_id"]], check=False)
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
        out = _slurm(args, input=batch_script(cfg, paths), env=env, check=False)
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


# ---------------------------------------------------------------------------------------------
# Cancelling


def cancel_server(paths: SlurmPaths, grace_s: float = CANCEL_GRACE_S, log=say) -> bool:
    """scancel the server job this workflow submitted; True if it was still queued or running.

    Waits up to `grace_s` for the job to leave RUNNING, so GPUs are free when this returns."""
    record = read_record(paths)
    if record is None:
        return False
    job_id = record["job_id"]
    info = job_info(job_id)
    was_alive = info is not None and info["state"] in ALIVE
    if was_alive:
        _slurm(["scancel", job_id], check=False)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            info = job_info(job_id)
            if info is None or info["state"] not in ALIVE | {"COMPLETING"}:
                break
            time.sleep(0.5)
        log(f"cancelled the server's SLURM job {job_id}")
    if record.get("watchdog_pid") and record["watchdog_pid"] != os.getpid():
        signal_group(record["watchdog_pid"], signal.SIGTERM)
    paths.record.unlink(missing_ok=True)
    if record.get("sentinel"):
        Path(record["sentinel"]).unlink(missing_ok=True)
    return was_alive


class SlurmServer(Backend):
    """The server job this workflow submits (`submit_server`, `cancel_server`). Queue time is unbounded
    (reported every 30 s with SLURM's reason, fatal when the reason says the job can never start);
    `server.ready_timeout` counts from the moment the job runs. A job that leaves the queue (FAILED,
    CANCELLED, TIMEOUT, ...) fails within one poll, with its log's tail."""

    mode = "slurm"
    REPORT_EVERY_S = 30.0

    def __init__(self, cfg: ServerConfig | None, paths: SlurmPaths):
        super().__init__(cfg)
        self.paths = paths
        self.record, self.running_since, self.queued_s, self.last_report = None, None, 0.0, -self.REPORT_EVERY_S

    def start(self, *, sentinel=None, workflow_pid=None, log=say) -> None:
        submit_server(self.cfg, self.cfg.slurm, self.paths, sentinel=sentinel, workflow_pid=workflow_pid, log=log)

    def stop(self, log=say) -> bool:
        return cancel_server(self.paths, log=log)

    def begin_wait(self) -> float:
        self.record = read_record(self.paths)
        if self.record is None:
            raise ServerError(f"no server job record at {self.paths.record}: submit the server first (submit_server)")
        return self.record["submitted_at"]

    def poll(self, log):
        record, job_id = self.record, self.record["job_id"]
        info = job_info(job_id)
        port = self.port_record(job_id)
        if port.get("error"):
            _slurm(["scancel", job_id], check=False)
            self.paths.record.unlink(missing_ok=True)
            raise ServerError(f"the vLLM server job {job_id} could not start: {port['error']} (log: {record['log']})")
        if info is None or info["state"] not in ALIVE:
            self.paths.record.unlink(missing_ok=True)
            raise ServerError(f"the vLLM server job {job_id} ({record['name']}) ended before it served "
                              f"'{self.cfg.model_id}': {_end_summary(job_id, info)}. Last lines of {record['log']}:\n"
                              f"{log_tail(record['log'])}")
        now = time.monotonic()
        if info["state"] != "RUNNING":
            if info["reason"] in NEVER_STARTS:
                _slurm(["scancel", job_id], check=False)
                self.paths.record.unlink(missing_ok=True)
                raise ServerError(f"SLURM will never start the server job {job_id}: {info['reason']}. Fix "
                                  f"server.slurm (partition, account, time, gpus, extra_sbatch_args) and rerun")
            if now - self.last_report >= self.REPORT_EVERY_S:
                why = f" ({info['reason']})" if info["reason"] not in ("", "None") else ""
                log(f"SLURM job {job_id} is {info['state']}{why} after {now - self.wait_started:.0f} s")
                self.last_report = now
            return None
        if self.running_since is None or info["node"] != record.get("node"):  # started, or requeued elsewhere
            self.running_since, self.queued_s = now, now - self.wait_started
            record.update(node=info["node"], address=node_address(info["node"]), url=None)
            log(f"SLURM job {job_id} runs on {info['node']}; waiting for its port record ({self.paths.port_record})")
        # The launcher may pick again (a port taken before vLLM bound it): follow the record.
        url = f"http://{record['address']}:{port['port']}" if port.get("port") else None
        if url != record.get("url"):
            record["url"] = url
            write_atomic(self.paths.record, record, indent=1)
            if url:
                log(f"SLURM job {job_id} serves on port {port['port']} of {info['node']}; waiting for {url}")
        return ([url] if url else []), self.running_since

    def port_record(self, job_id: str) -> dict:
        """The port record the job's launcher wrote on its node ({} until it has, or one of another job)."""
        port = read_port_record(self.paths.port_record) or {}
        return port if str(port.get("job_id")) == str(job_id) else {}

    def where(self) -> str:
        return f" (SLURM job {self.record['job_id']} on {self.record.get('node')})"

    def progress_note(self) -> str:
        return " since the SLURM job started"

    def timeout_note(self) -> str:
        return f" of starting. Last lines of {self.record['log']}:\n{log_tail(self.record['log'])}"

    def ready_facts(self) -> dict:
        r = self.record
        return {"seconds_queued": round(self.queued_s, 1), "slurm_job_id": r["job_id"], "node": r["node"], "log": r["log"]}

    def running(self, ident: str) -> bool:
        try:
            info = job_info(ident)
        except ServerError:
            return True  # slurmctld briefly unreachable: look again later
        return info is not None and info["state"] in ALIVE

    def owns(self, ident: str) -> bool:
        record = read_record(self.paths)
        return bool(record) and record["job_id"] == ident

    def stop_orphan(self, ident: str) -> None:
        _slurm(["scancel", ident], check=False)
