"""The tests' own one-node SLURM cluster (ci/slurm.sh, started by conftest.slurm_cluster) and the
client commands the tests send it."""
import os
import subprocess

from tests.support.config import ROOT
from tests.support.scheduling import SESSION_CPUS

SLURM_SCRIPT = ROOT / "ci" / "slurm.sh"


def slurm_script(command: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`ci/slurm.sh COMMAND` (up, down or env); its progress and errors are on stderr. The cluster is the
    machine's, not this test process's: it runs on every CPU the session had (`slurmd -C` sizes the node
    by the CPUs it may use), whatever share of them this process has."""
    return subprocess.run(["bash", str(SLURM_SCRIPT), command], capture_output=True, text=True, timeout=timeout,
                          env=env, preexec_fn=lambda: os.sched_setaffinity(0, SESSION_CPUS))


def script_values(out: subprocess.CompletedProcess) -> dict:
    """The KEY=VALUE lines `ci/slurm.sh up` prints on stdout (SLURM_CONF, STARTED)."""
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def slurm_command(args, **kw) -> subprocess.CompletedProcess:
    """A SLURM client command (scancel, scontrol, squeue, ...) against the tests' cluster, within a minute."""
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kw)


def scontrol_job(job_id) -> str:
    """`scontrol show job` of `job_id` on one line (empty once SLURM has forgotten it)."""
    return slurm_command(["scontrol", "--oneliner", "show", "job", job_id]).stdout
