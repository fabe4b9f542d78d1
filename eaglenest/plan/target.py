"""What the plan knows of the target and its data before any job: the datasets' rows, the target's hidden size
and weights (here, nothing downloaded), the GPU its servers run on, and the generation rate assumed from them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ..gguf import is_gguf
from ..gpus import GPU_MEMORY_GIB, known_gpu, nvidia_smi
from ..states.preflight import target_config
from .run import RunSettings, server_gpus

# Memory bandwidth (TB/s) of the GPUs the assumed generation rate knows; their memory is gpus.GPU_MEMORY_GIB's.
GPU_BANDWIDTH_TBS = {"B200": 8.0, "H200": 4.8, "H100": 3.35, "A100": 2.04, "L40S": 0.864}
DEFAULT_GPU = "H100"  # where neither nvidia-smi nor hidden.vllm.gpu_memory_gib says
# The assumed generation rate: one decode step of a replica's whole batch takes this many times as long as one
# read of its weights at its GPUs' memory bandwidth (the KV cache's reads, the compute, the all-reduces), and no
# less than MIN_STEP_S (vLLM's scheduling, sampling and kernel launches, which dominate for small models).
STEP_PER_WEIGHT_READ = 10
MIN_STEP_S = 0.02


def dataset_rows(path: str) -> int | None:
    """Rows of a local dataset (jsonl and csv by lines, parquet from its metadata, json loaded; .gz
    read through); None for a hub name (nothing is downloaded); 0 for files of another kind (which the
    checks refuse: checks.check_columns)."""
    p = Path(path).expanduser()
    if not p.exists():
        return None
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    rows = 0
    for f in files:
        name = f.name.lower().removesuffix(".gz")
        opener = gzip.open if f.name.lower().endswith(".gz") else open
        if name.endswith(".jsonl"):
            with opener(f, "rb") as fh:
                rows += sum(1 for line in fh if line.strip())
        elif name.endswith(".csv"):
            with open(f, "rb") as fh:
                rows += max(0, sum(1 for _ in fh) - 1)
        elif name.endswith(".parquet"):
            import pyarrow.parquet as pq

            rows += pq.ParquetFile(f).metadata.num_rows
        elif name.endswith(".json"):
            with opener(f, "rt", encoding="utf-8") as fh:
                data = json.load(fh)
            rows += len(data) if isinstance(data, list) else 1
    return rows


def target_hidden_size(run: RunSettings) -> tuple[int | None, str]:
    """The target's hidden size and where it was read: the target's config.json (a local directory or the
    Hugging Face cache) or GGUF metadata, else `plan.hidden_size` (a stand-in until the target's is here)."""
    model = run.hidden.target
    cfg = target_config(model) or {}
    h = cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size")
    if h:  # the target's own figure wins over the config's stand-in
        return h, f"{model}'s {'GGUF metadata' if is_gguf(model) else 'config.json'}"
    return run.plan.hidden_size, "plan.hidden_size"


def gpu_kind(run: RunSettings, has_gpu: bool) -> tuple[str, str]:
    """The GPU the target's servers run on, as GPU_BANDWIDTH_TBS names it, and how the plan knows: nvidia-smi's name
    here (server.mode local), else the GPU the config was sized for (server.slurm.gpu_type), else the kind whose
    memory is nearest hidden.vllm.gpu_memory_gib, else DEFAULT_GPU."""
    if has_gpu and run.server.mode == "local":
        names = " ".join(row[0] for row in nvidia_smi("--query-gpu=name") if row).upper()
        kind = next((k for k in GPU_BANDWIDTH_TBS if k in names), None)
        if kind:
            return kind, "nvidia-smi here"
    stated = known_gpu(run.slurm.gpu_type)
    if stated and stated[0] in GPU_BANDWIDTH_TBS:
        return stated[0], f"server.slurm.gpu_type {run.slurm.gpu_type}"
    gib = run.hidden.gpu_memory_gib
    if gib:
        kind = min(GPU_BANDWIDTH_TBS, key=lambda k: abs(GPU_MEMORY_GIB[k] - gib))
        return kind, f"hidden.vllm.gpu_memory_gib {gib:g} GiB is nearest its memory"
    return DEFAULT_GPU, "assumed: no nvidia-smi here, no hidden.vllm.gpu_memory_gib"


def target_weights(run: RunSettings) -> tuple[int | None, str]:
    """Bytes of the target's weights on disk (server.model) and where the figure comes from: a local directory's
    files or a GGUF file; a hub name's safetensors in the Hugging Face cache; else plan.weights_gb. Nothing is
    downloaded."""
    model = run.server.model
    found = local_bytes(model) or cached_bytes(model)
    if found:
        return found
    if run.plan.weights_gb:
        return int(run.plan.weights_gb * 1e9), "plan.weights_gb"
    return None, f"{model} is not here (a local directory or the Hugging Face cache): set plan.weights_gb"


def local_bytes(model: str) -> tuple[int, str] | None:
    """A local file's size, or the sum of a local directory's files; None for anything else."""
    p = Path(model).expanduser()
    if p.is_file():
        return p.stat().st_size, f"{model}'s size"
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()), f"{model}'s files"
    return None


def cached_bytes(model: str) -> tuple[int, str] | None:
    """A hub name's safetensors as the Hugging Face cache knows them (the index's total_size, else the one
    model.safetensors), as vLLM downloads them; None where the cache has neither."""
    from huggingface_hub import try_to_load_from_cache

    try:
        index, single = (try_to_load_from_cache(model, f) for f in ("model.safetensors.index.json", "model.safetensors"))
    except ValueError:  # not a repo id either
        return None
    if isinstance(index, str):
        total = (json.loads(Path(index).read_text()).get("metadata") or {}).get("total_size")
        if total:
            return int(total), f"{model}'s model.safetensors.index.json in the Hugging Face cache"
    if isinstance(single, str):
        return Path(single).stat().st_size, f"{model}'s model.safetensors in the Hugging Face cache"
    return None


def assumed_generation(run: RunSettings, weights_bytes: int | None, has_gpu: bool) -> dict | None:
    """Output tokens a second of one replica, assumed where plan.generate_tokens_per_s is unset: its share of
    generation.concurrency in flight at each decode step, a step STEP_PER_WEIGHT_READ times one read of the weights
    at its GPUs' memory bandwidth (at least MIN_STEP_S). None where the setting is given, the weights' size is
    unknown, or the GPUs are not the plan's to know (an external server; one on a CPU, here or in a SLURM job)."""
    s = run.server
    on_cpu = s.mode == "local" and not has_gpu
    if run.plan.generate_tokens_per_s or not weights_bytes or on_cpu or s.mode == "external":
        return None
    gpus, in_flight = server_gpus(run), run.generation.concurrency / s.replicas
    if not gpus:  # a SLURM job of server.slurm.gpus 0: vLLM on the node's CPU
        return None
    kind, source = gpu_kind(run, has_gpu)
    step_s = max(MIN_STEP_S, STEP_PER_WEIGHT_READ * weights_bytes / (gpus * GPU_BANDWIDTH_TBS[kind] * 1e12))
    return {"rate": in_flight / step_s, "in_flight": in_flight, "step_s": step_s, "gpus": gpus, "kind": kind,
            "kind_source": source}
