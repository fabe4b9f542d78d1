"""What the cluster offers the server's and the GPU rules' jobs, as sinfo lists it: the partitions and their node
kinds, the GPU partition (server.slurm.partition), and the times sbatch takes. Read by the checks before any job
(eaglenest.checks) and by the SLURM backend (serving.slurm)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from ..errors import ConfigError
from .settings import SlurmSettings


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
