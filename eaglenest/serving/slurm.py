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

import os
import signal
import time
from pathlib import Path

from ..errors import ServerError
from ..util import say, write_atomic
from .backend import Backend, log_tail, signal_group
from .port import read_port_record
from .settings import ServerConfig
from .slurm_jobs import (ALIVE, CANCEL_GRACE_S, NEVER_STARTS, SlurmPaths, end_summary, job_info, node_address,
                         read_record, run_slurm, submit_server)


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
        run_slurm(["scancel", job_id], check=False)
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
            run_slurm(["scancel", job_id], check=False)
            self.paths.record.unlink(missing_ok=True)
            raise ServerError(f"the vLLM server job {job_id} could not start: {port['error']} (log: {record['log']})")
        if info is None or info["state"] not in ALIVE:
            self.paths.record.unlink(missing_ok=True)
            raise ServerError(f"the vLLM server job {job_id} ({record['name']}) ended before it served "
                              f"'{self.cfg.model_id}': {end_summary(job_id, info)}. Last lines of {record['log']}:\n"
                              f"{log_tail(record['log'])}")
        now = time.monotonic()
        if info["state"] != "RUNNING":
            if info["reason"] in NEVER_STARTS:
                run_slurm(["scancel", job_id], check=False)
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
        run_slurm(["scancel", ident], check=False)
