"""The GPU checks: each job's GPUs against what one server uses and what one node has, the GPU a config was sized
for against the partition's, and the target's weights against one server's GPUs."""

from __future__ import annotations

import math

from ..errors import ConfigError
from ..gpus import GPU_MEMORY_GIB, known_gpu, machine_gpus
from ..plan import RunSettings, server_gpus, stage_gpus
from ..plan.run import section_gpus
from ..serving.slurm_cluster import check_gpu_partition, partition_nodes, sinfo_nodes
from ..serving.vllm import server_parallel
from ..states.preflight import gpu_memory_gib, weights_bytes
from .review import Review


def parallel_text(sizes: dict) -> str:
    """How a server's GPUs multiply: "tensor_parallel_size 8", "... x pipeline-parallel 2"."""
    text = f"server.tensor_parallel_size {sizes['tensor']}"
    return text + "".join(f" x {kind}-parallel {n} (server.extra_args)" for kind, n in sizes.items()
                          if kind != "tensor" and n > 1)


def check_server_gpus(run: RunSettings, need: int, sizes: dict) -> list[str]:
    """A server's job (server.slurm.gpus) and the validation jobs (validate.gpus, where set) hold the GPUs one
    vLLM server uses (``need``), or vLLM fails at its start. 0 GPUs: a CPU server, nothing to compare."""
    errors, s = [], run.server
    job, validate = run.slurm.gpus, run.plan.validate_gpus
    if s.mode == "slurm" and job and job < need:
        errors.append(f"{parallel_text(sizes)} needs {need} GPUs a server, but the server's SLURM job asks for {job} "
                      f"(server.slurm.gpus {job}): vLLM would fail at its start; set server.slurm.gpus to {need} (or "
                      f"null: the GPUs a server uses), or lower server.tensor_parallel_size to {job}")
    if validate and validate < need:
        errors.append(f"validate.gpus {validate} is fewer than the {need} GPUs a validation server uses "
                      f"({parallel_text(sizes)}: validate_draft and curve_point start the target's server in their job); "
                      f"set validate.gpus to {need} (or null: the server's)")
    return errors


def node_capacity(run: RunSettings, nodes, has_gpu: bool) -> tuple[int | None, str]:
    """(the most GPUs one job may hold, where that figure comes from): under server.mode slurm the GPU partition's
    largest node (sinfo's ``nodes``), else server.slurm.node_gpus; elsewhere this machine's (nvidia-smi). None
    where not known, with why."""
    s = run.server
    if s.mode != "slurm":
        n = machine_gpus() if has_gpu else 0
        return (n, f"this machine's {n} GPUs (nvidia-smi)") if n else (None, "")
    if nodes and any(k.gpus for k in nodes):
        top = max(nodes, key=lambda k: k.gpus)
        return top.gpus, f"a node of partition {top.partition} has at most {top.gpus} (sinfo gres {top.gres})"
    if run.slurm.node_gpus:
        return run.slurm.node_gpus, f"a node has {run.slurm.node_gpus} (server.slurm.node_gpus)"
    why = "sinfo does not answer here" if nodes is None else "sinfo lists no GPU gres in the GPU partition"
    return None, (f"GPUs a node has not known: {why} and server.slurm.node_gpus is null; the jobs' GPU counts are "
                  "not checked against a node")


def job_gpus(run: RunSettings, need: int, has_gpu: bool) -> list[tuple[str, str, int]]:
    """``[(what asks, the key to change, GPUs)]`` of what holds GPUs on one node: one server (``need``), the server's job, this
    machine's servers, and the rules' GPUs where set (unset, they follow the server's)."""
    s = run.server
    jobs = [(parallel_text(server_parallel(s)), "server.tensor_parallel_size", need)]
    if s.mode == "slurm" and run.slurm.gpus not in (None, need):
        jobs.append((f"server.slurm.gpus {run.slurm.gpus}", "server.slurm.gpus", run.slurm.gpus))
    if s.mode == "local" and s.replicas > 1:
        jobs.append((f"server.replicas {s.replicas} x {need} GPUs a server", "server.replicas", s.replicas * need))
    sections = ["train", "validate"] + (["hidden"] if run.hidden.backend == "transformers" else [])
    gpus = section_gpus(run)
    return jobs + [(f"{sec}.gpus {gpus[sec]}", f"{sec}.gpus", stage_gpus(run, sec, has_gpu))
                   for sec in sections if gpus[sec] is not None]


def partition_gpu(nodes) -> tuple | None:
    """``(node kind, model, GiB)`` of the GPU partition's largest known GPU (gres type, else node features)."""
    found = [(k, known_gpu(k.gpu_type) or known_gpu(" ".join(k.features))) for k in nodes or () if k.gpus]
    found = [(k, *g) for k, g in found if g]
    return max(found, key=lambda f: f[2]) if found else None


def sized_for(run: RunSettings) -> tuple[str, str, float] | None:
    """``(key and value, GPU, GiB)`` of the GPU a config states it was sized for: server.slurm.gpu_type, else the
    memory hidden.vllm.gpu_memory_gib states; None where it states neither."""
    stated, memory = run.slurm.gpu_type, run.hidden.gpu_memory_gib
    gpu = known_gpu(stated) if stated else None
    if gpu:
        return f"server.slurm.gpu_type {stated}", *gpu
    if memory and run.hidden.backend == "vllm":
        return f"hidden.vllm.gpu_memory_gib {memory:g}", f"{memory:g} GiB", memory
    return None


def check_gpu_type(run: RunSettings, nodes, need: int) -> tuple[str | None, str | None]:
    """(failure, skipped note) of the GPU a config was sized for (``sized_for``) against the GPU partition's, from
    sinfo's gres types and node features."""
    stated = run.slurm.gpu_type
    if stated and not known_gpu(stated):
        return (f"server.slurm.gpu_type {stated!r} is not a GPU eaglenest knows ({', '.join(GPU_MEMORY_GIB)}); name "
                "one of them, or null", None)
    sized = sized_for(run)
    if run.server.mode != "slurm" or sized is None:
        return None, None
    key, label, want = sized
    if nodes is None:
        return None, (f"the partition's GPUs not compared with the {label} GPUs this config was sized for ({key}): "
                      "sinfo does not answer here")
    found = partition_gpu(nodes)
    if found is None:
        gres = ", ".join(sorted({k.gres for k in nodes})) or "none"
        return None, f"the partition's GPU type not known (sinfo gres {gres}): not compared with {key}"
    kind, model, gib = found
    if gib >= want - 0.5:
        return None, None
    return (f"{key}: this config was sized for {label} GPUs ({want:g} GiB each, {need} a server: {need * want:,.0f} GiB), "
            f"but partition {kind.partition} has {model} ({gib:g} GiB each, sinfo gres {kind.gres}): {need} x {gib:g} "
            f"= {need * gib:,.0f} GiB; send the GPU jobs to {label} GPUs (server.slurm.partition, or --constraint in "
            f"server.slurm.extra_sbatch_args), or use a config sized for {model}", None)


def check_weights(run: RunSettings, need: int, nodes) -> tuple[str | None, str | None]:
    """(failure, skipped note): the target's weights (states.preflight.weights_bytes) within vLLM's share of one
    server's GPUs, on the partition's GPUs (sinfo), else the GPU the config was sized for, else this machine's."""
    s = run.server
    found, sized = partition_gpu(nodes), sized_for(run)
    gib, where = (found[2], f"partition {found[0].partition}'s {found[1]}") if found else \
        (sized[2], f"{sized[1]}, {sized[0]}") if sized else (gpu_memory_gib(), "this machine's (nvidia-smi)")
    if not gib or s.mode == "external":
        return None, None
    model = run.hidden.target
    weights = weights_bytes(model)
    if weights is None:
        return None, (f"the weights of {model} not compared with its GPUs: no model.safetensors(.index.json) here "
                      f"(a local directory or the Hugging Face cache; `hf download {model} model.safetensors.index.json`)")
    share = s.gpu_memory_utilization or 0.9
    room = need * gib * 2**30 * share
    if weights <= room:
        return None, None
    return (f"the weights of {model} ({weights / 1e9:,.0f} GB, its model.safetensors) do not fit one server's "
            f"{need} GPUs of {gib:g} GiB ({where}) at server.gpu_memory_utilization {share:g}: {need} x {gib:g} GiB x "
            f"{share:g} = {room / 1e9:,.0f} GB; raise server.tensor_parallel_size (and the GPUs it asks for), or use "
            "larger GPUs", None)


def check_gpus(run: RunSettings, has_gpu: bool, review: Review) -> None:
    """The GPU checks: a server's GPUs against its jobs', every job's against a node's, the GPU type; where
    server.mode slurm, the GPU partition itself (serving.slurm_cluster.check_gpu_partition)."""
    sizes = server_parallel(run.server)
    need = math.prod(sizes.values())
    review.add(*check_server_gpus(run, need, sizes))
    nodes = None
    if run.server.mode == "slurm":
        listed = sinfo_nodes()
        nodes = partition_nodes(run.slurm, listed) if listed else None
        held = server_gpus(run) + stage_gpus(run, "train", has_gpu) + stage_gpus(run, "validate", has_gpu)
        try:
            review.notes += [note for note in (check_gpu_partition(run.slurm, held),) if note]
        except ConfigError as e:
            review.add(str(e))
    cap, source = node_capacity(run, nodes, has_gpu)
    if cap is None and source:
        review.skipped.append(source)
    for what, key, n in job_gpus(run, need, has_gpu) if cap else []:
        if n > cap:
            review.add(f"{what} asks for more GPUs than one node has ({source}): a job runs on one node; lower {key} to "
                       f"fit {cap}")
    for failure, note in (check_gpu_type(run, nodes, need), check_weights(run, need, nodes)):
        review.add(failure)
        review.skipped += [note] if note else []
