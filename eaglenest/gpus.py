"""Which GPUs a job may use, when Snakemake runs several GPU jobs side by side on one machine.

Snakemake's ``resources: gpu=N`` only counts GPUs: two ``extract_hidden`` jobs with ``gpu=1`` on a
2-GPU node would both start on device 0. ``claim_gpus`` gives each job its own devices: one lock file
per physical GPU, taken with ``flock`` (the kernel drops it when the holder exits, ``kill -9``
included, so a crashed job never strands a GPU), and ``CUDA_VISIBLE_DEVICES`` set to the claimed
indices for the job and every process it starts (torchrun, vLLM).

When the devices are already assigned (``CUDA_VISIBLE_DEVICES`` set by SLURM's gres, by the user, or
by an outer claim) the assignment is used as it is and nothing is locked. On a machine without
``nvidia-smi`` there is nothing to claim.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from .errors import GpuError
from .util import open_locked


def nvidia_smi(query: str) -> list[list[str]]:
    """Rows of ``nvidia-smi <query>`` as lists of fields; [] on a machine without NVIDIA GPUs."""
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return []
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def physical_gpus() -> list[int]:
    """Indices of this machine's NVIDIA GPUs, [] without one."""
    return [int(row[0]) for row in nvidia_smi("--query-gpu=index") if row[0].isdigit()]


def visible_devices(value: str | None) -> list[int]:
    """The device indices a ``CUDA_VISIBLE_DEVICES`` value names."""
    return [int(d) for d in (value or "").split(",") if d.strip().isdigit()]


class _Busy(Exception):
    """Another job holds this GPU's lock."""


def lock_dir() -> Path:
    """Machine-wide per user, so that two workflows of one user share the GPUs fairly too."""
    default = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"eaglenest-gpu-locks-{os.getuid()}"
    return Path(os.environ.get("EAGLENEST_GPU_LOCK_DIR") or default)


@contextlib.contextmanager
def claim_gpus(n: int, *, devices: list[int] | None = None, locks: Path | None = None, poll_s: float = 2.0,
               timeout_s: float | None = None, log=print):
    """Hold ``n`` GPUs of this machine for the body; yields their indices, with CUDA_VISIBLE_DEVICES set.

    ``devices`` (default: ``physical_gpus()``) lists the candidates. Waits while fewer than ``n``
    are free (another job holds them) and fails after ``timeout_s`` when given.
    """
    preset = os.environ.get("CUDA_VISIBLE_DEVICES")
    if n <= 0 or preset is not None:
        if n > 0:
            log(f"GPUs: using the assigned CUDA_VISIBLE_DEVICES={preset}")
        yield visible_devices(preset)
        return
    devices = physical_gpus() if devices is None else list(devices)
    if not devices:
        yield []
        return
    if n > len(devices):
        raise GpuError(f"a job asks for {n} GPUs but this machine has {len(devices)} ({devices}): "
                           f"lower hidden.gpus / train.gpus, or run it where more GPUs are")
    locks = lock_dir() if locks is None else Path(locks)
    locks.mkdir(parents=True, exist_ok=True, mode=0o700)
    held: dict[int, int] = {}
    start, said = time.monotonic(), False
    try:
        while True:
            for d in devices:
                if len(held) == n:
                    break
                if d in held:
                    continue
                try:
                    fd = open_locked(locks / f"gpu{d}.lock", _Busy())
                except _Busy:
                    continue
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                held[d] = fd
            if len(held) == n:
                break
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise GpuError(f"waited {timeout_s:.0f} s for {n} free GPUs of {devices} (locks in {locks}); "
                                   f"holding {sorted(held)}: other jobs still hold the rest")
            if not said:
                log(f"GPUs: waiting for {n - len(held)} more of {devices} (held by other jobs, locks in {locks})")
                said = True
            time.sleep(poll_s)
        ids = sorted(held)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
        log(f"GPUs: claimed {ids} (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})")
        yield ids
    finally:
        if held:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        for fd in held.values():
            os.close(fd)  # closing the descriptor releases the flock


def hold_gpus(n: int, log=print) -> list[int]:
    """``claim_gpus`` for the rest of this process (a rule script): the locks go when it exits."""
    claim = claim_gpus(n, log=log)
    ids = claim.__enter__()
    _held.append(claim)  # keeps the descriptors, so the locks, alive
    return ids


_held: list = []


def device_groups(n: int, size: int, devices: list[int]) -> list[list[int]]:
    """``n`` disjoint groups of ``size`` devices each, in order (server replicas of tensor-parallel
    ``size``); [] per group where ``devices`` is empty (a CPU machine). GpuError when too few."""
    if not devices:
        return [[] for _ in range(n)]
    if n * size > len(devices):
        raise GpuError(f"server.replicas={n} x tensor_parallel_size={size} needs {n * size} GPUs, but "
                       f"{len(devices)} are there ({devices}): lower server.replicas or run where more GPUs are")
    return [devices[i * size:(i + 1) * size] for i in range(n)]


def lock_devices(devices: list[int], locks: Path | None = None) -> list[int]:
    """Take the lock of each of ``devices`` at once (claim_gpus' lock files), for a process that hands the
    descriptors to a long-lived child (a vLLM server, ``pass_fds``), which then holds them until it
    exits. GpuError, holding nothing, when another job holds one."""
    locks = lock_dir() if locks is None else Path(locks)
    locks.mkdir(parents=True, exist_ok=True, mode=0o700)
    fds = []
    try:
        for d in devices:
            fd = open_locked(locks / f"gpu{d}.lock", GpuError(
                f"GPU {d} is claimed by another job of this user (lock {locks / f'gpu{d}.lock'}): wait for it, "
                f"or give this server other GPUs (CUDA_VISIBLE_DEVICES in server.env)"))
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            fds.append(fd)
    except GpuError:
        for fd in fds:
            os.close(fd)
        raise
    return fds


# One GPU's memory (GiB) as nvidia-smi reports it (memory.total), by model; a variant that differs from its
# model's usual memory is its own entry. The checks before any job read a partition's GPUs from the names
# SLURM gives them (gres types such as "h100" or "nvidia_h100_80gb_hbm3", node features) and compare them
# with the GPU a config was sized for (server.slurm.gpu_type).
GPU_MEMORY_GIB = {"B200": 179.1, "H200": 140.4, "GH200": 95.6, "H100": 79.6, "H100 NVL": 93.6, "H100 94GB": 93.6,
                  "A100": 80.0, "A100 40GB": 40.0, "L40S": 45.0, "L40": 45.0, "L4": 22.5, "A10": 22.5, "A10G": 22.5,
                  "V100": 31.7, "V100 16GB": 15.8}


def known_gpu(text: str | None) -> tuple[str, float] | None:
    """``(model, GiB)`` of the GPU ``text`` names ("H200", "nvidia_h100_80gb_hbm3", "a100-sxm4-40gb"), the most
    specific entry of GPU_MEMORY_GIB whose words all appear in it; None for a name not there."""
    words = set(re.split(r"[^a-z0-9]+", (text or "").lower()))
    for name in sorted(GPU_MEMORY_GIB, key=len, reverse=True):
        if set(name.lower().split()) <= words:
            return name, GPU_MEMORY_GIB[name]
    return None


def machine_gpus() -> int:
    """This machine's NVIDIA GPUs (nvidia-smi); 0 without one."""
    return len(physical_gpus())
