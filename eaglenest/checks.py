"""Checks of a resolved config against the target, the disk, the GPUs and the cluster, before any job runs.

`review_config` runs every check, whatever fails, so all failures are reported together; the workflow calls it
at parse time (`snakemake -n` too) and `python -m eaglenest.plan` through `check_config`. Each failure is one
line naming the key, its value, the limit and what to do. A check that needs what is not here (the target's
config.json, where neither a local directory, the Hugging Face cache nor the hub gives it; sinfo, off a
cluster; nvidia-smi) is skipped, and the plan says so in one line.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from .data.datasets import columns_refusal, is_local_dataset
from .data.prompts import same_prompts
from .errors import ConfigError
from .gpus import GPU_MEMORY_GIB, known_gpu, machine_gpus
from .plan import human_bytes, server_gpus, stage_gpus, validation_refusal
from .serving.settings import ServerConfig
from .serving.slurm import SlurmSettings, check_gpu_partition, partition_nodes, sinfo_nodes, slurm_time_ok
from .serving.vllm import server_parallel
from .settings import HiddenSettings
from .states.preflight import (STREAM_CACHE_DIR, gpu_memory_gib, preflight_logits_memory, states_file_bytes,
                               target_config, weights_bytes)
from .util import is_local_path
from .vllm_facts import NO_AUX_ID_0_MODEL_TYPES, check_aux_layers, default_aux_layers


@dataclass
class Review:
    """What the checks of a config found: the failures (one line each, key, value, limit and fix), the checks
    that could not run here (one line each, why), and lines for the log of checks that passed."""

    errors: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def add(self, *failures) -> None:
        self.errors += [f for f in failures if f]


def find_target_config(model: str, workdir: Path) -> dict | None:
    """The target's config.json, a directory relative to ``workdir`` or a hub name in the HF cache; a hub name
    not in the cache is fetched into it where the hub answers (``fetch_config``)."""
    local = workdir / model
    if (local / "config.json").is_file():
        return target_config(str(local))
    cfg = target_config(model)
    if cfg is None and "/" in model and not is_local_path(model, workdir) and fetch_config(model):
        cfg = target_config(model)
    return cfg


HUB_PROBE_S = 3.0  # a hub that does not answer within this is offline for the plan (no retries, no waiting)


def fetch_config(model: str) -> bool:
    """Download a hub target's config.json (one small file) into the Hugging Face cache, so the checks run
    before any job: only where HF_HUB_OFFLINE is unset and the hub answers within HUB_PROBE_S (an offline
    login node costs one failed lookup, not the hub client's minute of retries). False where it could not."""
    import requests

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    from huggingface_hub import constants, hf_hub_download

    try:
        requests.head(constants.ENDPOINT, timeout=HUB_PROBE_S)
        hf_hub_download(model, "config.json", etag_timeout=HUB_PROBE_S)
    except Exception:  # offline, gated without a token, no such repo: the checks that need it are skipped, said so
        return False
    return True


def _text_key(cfg: dict, key: str):
    """A key of the language model: a multimodal wrapper (Kimi-K2.5) keeps it under text_config."""
    text = cfg.get("text_config") or {}
    return text.get(key) if text.get(key) is not None else cfg.get(key)


def check_aux_ids(config: dict, model: str, cfg: dict) -> str | None:
    layers = _text_key(cfg, "num_hidden_layers")
    if not layers:
        return None
    ids = config["draft"]["aux_layers"]
    types = {cfg.get("model_type"), (cfg.get("text_config") or {}).get("model_type")}
    model_type = next((t for t in types if t in NO_AUX_ID_0_MODEL_TYPES), _text_key(cfg, "model_type"))
    try:
        default = list(default_aux_layers(layers))
    except ValueError:
        default = None
    try:
        if ids is None:
            if default is None:
                return (f"draft.aux_layers null: {model} has {layers} layers (num_hidden_layers in its config.json), "
                        "too few for vLLM's default (2, N//2, N-3); set draft.aux_layers to 3 distinct ids")
            return None
        check_aux_layers(ids, layers, cfg.get("architectures") or (), model_type)
    except ValueError as e:
        hint = f", e.g. {default} (vLLM's default), or null for that default" if default else ""
        return (f"draft.aux_layers: {e} ({model}'s config.json: num_hidden_layers {layers}); set draft.aux_layers "
                f"to 3 distinct ids from 1 to {layers - 1}{hint}")
    return None


def check_vocab(config: dict, model: str, cfg: dict) -> str | None:
    vocab, draft = _text_key(cfg, "vocab_size"), config["draft"]["vocab_size"]
    if vocab and draft > vocab:
        return (f"draft.vocab_size {draft:,} is larger than the vocabulary of {model} ({vocab:,}, vocab_size in its "
                f"config.json), which would be silently clipped; set draft.vocab_size to {vocab} or less")
    return None


def check_heads(config: dict, model: str, cfg: dict) -> str | None:
    heads, tp = _text_key(cfg, "num_attention_heads"), config["server"]["tensor_parallel_size"]
    if heads and heads % tp:
        fits = [n for n in range(1, min(heads, 16) + 1) if heads % n == 0]
        return (f"server.tensor_parallel_size {tp} does not divide the {heads} attention heads of {model} "
                f"(num_attention_heads in its config.json); set it to a divisor of {heads}, e.g. one of {fits}")
    return None


def check_context(config: dict, model: str, cfg: dict) -> str | None:
    """server.max_model_len within the target's context (max_position_embeddings): vLLM refuses more."""
    context, limit = _text_key(cfg, "max_position_embeddings"), config["server"]["max_model_len"]
    if context and limit and limit > context:
        return (f"server.max_model_len {limit:,} is above the {context:,} tokens {model} holds "
                f"(max_position_embeddings in its config.json), which vLLM refuses; set it to {context} or less")
    return None


def check_lengths(config: dict, cfg: dict | None = None) -> list[str]:
    """Answers and hidden-state sequences within server.max_model_len (null: the target's own context,
    max_position_embeddings in ``cfg``, as vLLM takes it). The longest prompt is not known before the
    traces tokenize it, so max_tokens alone must leave room for one."""
    limit = config["server"]["max_model_len"]
    what = f"server.max_model_len {limit:,}" if limit else None
    if not limit:
        limit = _text_key(cfg or {}, "max_position_embeddings")
        what = f"the target's context of {limit:,} tokens (server.max_model_len null: its max_position_embeddings)" \
            if limit else None
    errors = []
    if not limit:
        return errors
    max_tokens, max_length = config["generation"]["max_tokens"], config["hidden"]["max_length"]
    if max_tokens >= limit:
        errors.append(f"generation.max_tokens {max_tokens:,} leaves no room for a prompt within {what} "
                      f"(prompt + answer); set generation.max_tokens below {limit}, or raise server.max_model_len")
    if max_length > limit:
        errors.append(f"hidden.max_length {max_length:,} is above {what}, the longest sequence the servers hold; "
                      f"set hidden.max_length to {limit} or less")
    return errors


def check_longest_prompt(config: dict, model: str, cfg: dict | None, workdir: Path) -> str | None:
    """Once prepare_prompts has run for this config: its longest prompt (data/prompts/stats.json), in the target's
    chat template, plus generation.max_tokens within server.max_model_len (null: the target's context); vLLM
    refuses a longer request (HTTP 400, counted as an error). Needs the target's tokenizer here; else skipped."""
    import json

    stats = workdir / "data" / "prompts" / "stats.json"
    limit = config["server"]["max_model_len"] or _text_key(cfg or {}, "max_position_embeddings")
    if not limit or not stats.is_file():
        return None
    made = json.loads(stats.read_text())
    longest = made.get("longest_prompt")
    if not longest or not same_prompts(made, config):
        return None
    n = _prompt_tokens(longest["messages"], model, config["generation"]["chat_template_kwargs"], workdir, stats)
    if n is None:
        return None  # no tokenizer here: nothing to count with
    max_tokens = config["generation"]["max_tokens"]
    if n + max_tokens <= limit:
        return None
    return (f"the longest prompt ({longest['id']} in {stats.parent}, {n:,} tokens in the chat template) plus "
            f"generation.max_tokens {max_tokens:,} is {n + max_tokens:,} tokens, above the {limit:,} vLLM holds "
            f"(server.max_model_len, else the target's context): vLLM would refuse it; raise server.max_model_len, "
            f"lower generation.max_tokens, or lower dataset.max_prompt_chars")


def _prompt_tokens(messages, model: str, template_kwargs, workdir: Path, stats: Path) -> int | None:
    """Tokens of ``messages`` in the target's chat template, or None without its tokenizer here. Kept beside
    stats.json (longest_prompt.tokens.json, keyed by what decides it), so only the first plan after
    prepare_prompts pays for loading a tokenizer (seconds on every later start otherwise)."""
    import hashlib
    import json

    from .util import write_atomic

    key = hashlib.sha256(json.dumps([stats.read_text(), model, template_kwargs], default=str).encode()).hexdigest()
    cache = stats.with_name("longest_prompt.tokens.json")
    try:
        kept = json.loads(cache.read_text())
        if kept.get("key") == key:
            return kept["tokens"]
    except (OSError, ValueError, AttributeError):
        pass
    try:
        from transformers import AutoTokenizer

        from .states.target import chat_prompt_ids

        local = workdir / model
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.is_dir() else model, local_files_only=True)
        n = len(chat_prompt_ids(tokenizer, messages, template_kwargs))
    except (OSError, ValueError):
        return None
    try:
        write_atomic(cache, {"key": key, "tokens": n})
    except OSError:
        pass  # a read-only working directory: counted again next time
    return n


def check_datasets(config: dict, workdir: Path) -> list[str]:
    """Local dataset paths (dataset.path, validate.datasets[i].path) exist; a hub name is not checked."""
    generated = config["dataset"]["generate"]["questions"]  # then dataset.path is not read
    paths = [("dataset.path", config["dataset"]["path"])] * (not generated) + [
        (f"validate.datasets[{i}].path ({d['name']})", d["path"]) for i, d in enumerate(config["validate"]["datasets"])]
    errors = []
    for key, path in paths:
        if is_local_dataset(path, workdir) and not (workdir / Path(path).expanduser()).exists():
            errors.append(f"{key} {path}: no such file or directory (relative to the working directory "
                          f"{workdir.resolve()}); fix the path, or give a Hugging Face dataset name (org/name)")
    return errors


def check_columns(config: dict, workdir: Path) -> tuple[list[str], list[str]]:
    """(errors, notes): each local dataset (dataset.path, validate.datasets[i].path) yields a question from its first
    rows with its column mapping (dataset.columns, validate.datasets[i].columns), e.g. not a lone `text` column
    unmapped; a hub dataset is not read before a job, said in one note. A missing file is check_datasets'."""
    d = config["dataset"]
    sets = [("dataset.path", d["path"], d["columns"], "dataset.columns")] * (not d["generate"]["questions"]) + [
        (f"validate.datasets[{i}].path ({s['name']})", s["path"], s.get("columns"), f"validate.datasets[{i}].columns")
        for i, s in enumerate(config["validate"]["datasets"])]
    errors, hub = [], []
    for key, path, columns, columns_key in sets:
        local = workdir / Path(path).expanduser()
        if not is_local_dataset(path, workdir):
            hub.append(path)
        elif local.exists():
            errors += [e for e in (columns_refusal(str(local), columns, f"{key} {path}", key=columns_key),) if e]
    notes = [f"columns of the hub dataset(s) {', '.join(dict.fromkeys(hub))} not checked: only local files are read "
             "before a job (prepare_prompts and validate_draft check them)"] if hub else []
    return errors, notes


def check_stream_mode(config: dict) -> list[str]:
    """hidden.mode stream takes its states from the vLLM extraction server, placed where server.mode runs servers."""
    h, mode = config["hidden"], config["server"]["mode"]
    if h["mode"] != "stream":
        return []
    errors = []
    if h["backend"] != "vllm":
        errors.append("hidden.mode: stream takes the states from the vLLM extraction server: set hidden.backend: vllm "
                      "(or hidden.mode: files to use the transformers backend)")
    placement = h["stream"]["placement"]
    needs = {"node": "local", "slurm": "slurm"}[placement]
    if needs != mode:
        errors.append(f"hidden.stream.placement: {placement} needs server.mode: {needs} (it is {mode!r}): node runs the "
                      "extraction server beside the trainer, slurm as its own SLURM job; make the two agree")
    return errors


def check_logits_room(config: dict) -> tuple[str | None, str]:
    """(failure or None, the log's line) of the extraction server's room for its prompt logits (states.preflight)."""
    try:
        return None, preflight_logits_memory(config["server"], HiddenSettings.from_config(config))
    except ConfigError as e:
        return str(e), ""


def check_ttt(config: dict) -> str | None:
    """The draft proposes validate.num_speculative_tokens tokens a step; training unrolls it train.ttt_length times."""
    k, ttt = config["validate"]["num_speculative_tokens"], config["train"]["ttt_length"]
    if k <= ttt:
        return None
    return (f"validate.num_speculative_tokens {k} is more than train.ttt_length {ttt}, the draft tokens training teaches "
            f"the draft to propose (k drafts need ttt_length >= k); set validate.num_speculative_tokens to {ttt} or less, "
            f"or train.ttt_length to {k} or more")


def check_drafts(config: dict, workdir: Path) -> list[str]:
    """Each of validate.drafts an exported draft directory with its config.json (relative paths: to the working
    directory), so validation does not find it missing after the hours before it."""
    errors = []
    for draft in config["validate"]["drafts"]:
        path = workdir / draft["path"]
        if not (path / "config.json").is_file():
            what = "has no config.json" if path.is_dir() else "is not a directory"
            errors.append(f"validate.drafts '{draft['name']}': {path} {what}; point path at an exported draft "
                          f"directory (another run's draft/checkpoint)")
    return errors


def check_stream_disk(config: dict, plan, workdir: Path) -> list[str]:
    """Stream mode's disk budget: at least one per-request file of the longest sequence (what train_draft checks
    again with the traces' own lengths), and no more than the working directory's disk has free."""
    if plan.mode != "stream":
        return []
    errors, budget = [], config["hidden"]["stream"]["max_disk_gb"]
    layers = len(config["draft"]["aux_layers"] or range(3)) + 1  # the aux layers and the last
    if plan.hidden_size and plan.sequence_tokens:
        least = states_file_bytes(plan.sequence_tokens, layers, plan.hidden_size)
        if plan.stream_bytes < least:
            errors.append(f"hidden.stream.max_disk_gb {budget:g} is below one per-request file of the longest sequence "
                          f"({plan.sequence_tokens:,} tokens x {layers} layers x hidden size {plan.hidden_size} x 4 bytes "
                          f"= {least / 1e9:.3g} GB); raise hidden.stream.max_disk_gb to {least / 1e9:.3g} or more, or "
                          "lower hidden.max_length")
    # what an earlier run's per-request files and cache hold is the budget's own: a rerun clears them
    held = sum(f.stat().st_size for d in (config["hidden"]["vllm"]["states_dir"], STREAM_CACHE_DIR)
               for f in (workdir / d).rglob("*") if f.is_file())
    if plan.free_bytes is not None and plan.stream_bytes > plan.free_bytes + held:
        errors.append(f"hidden.stream.max_disk_gb {budget:g} is more than the working directory's disk has free "
                      f"({human_bytes(plan.free_bytes + held)}); lower it to what the disk holds, or free disk")
    return errors


def check_slurm_time(config: dict) -> str | None:
    """server.slurm.time in a form sbatch takes (serving.slurm.SLURM_TIME): sbatch refuses any other at submission."""
    value = config["server"]["slurm"]["time"]
    if config["server"]["mode"] != "slurm" or slurm_time_ok(value):
        return None
    return (f"server.slurm.time {value!r} is not a time sbatch takes: minutes, minutes:seconds, hours:minutes:seconds, "
            "days-hours, days-hours:minutes or days-hours:minutes:seconds (an integer is minutes); e.g. "
            "\"2-00:00:00\" for two days")


def check_local_server(config: dict, executor: str | None, sources=()) -> str | None:
    """A cluster executor (``executor``: its name; None where jobs run on this machine) with server.mode local would
    run vLLM where Snakemake runs (a login node, on its CPU) and send the GPU rules to the cluster; refused, naming
    the preset that runs the servers as SLURM jobs."""
    if executor is None or config["server"]["mode"] != "local":
        return None
    stems = [s[: -len(".yaml")] for s in map(str, sources) if s.endswith(".yaml") and not s.endswith(".slurm.yaml")]
    sibling = next((f"{s}.slurm.yaml" for s in stems if os.path.exists(f"{s}.slurm.yaml")), None)
    fix = f"--configfile {sibling}" if sibling else "with server.mode: slurm (and server.slurm's partition, GPUs and time)"
    return (f"server.mode: local under the {executor} executor would start vLLM on this machine ({os.uname().nodename}) "
            f"while the rules' jobs go to the cluster: run {fix}, or drop the cluster profile to run everything on "
            "this machine")


# ---------------------------------------------------------------------------------------------
# GPUs: each job's against what one server uses and what one node has, and the GPU a config was sized for


def parallel_text(sizes: dict) -> str:
    """How a server's GPUs multiply: "tensor_parallel_size 8", "... x pipeline-parallel 2"."""
    text = f"server.tensor_parallel_size {sizes['tensor']}"
    return text + "".join(f" x {kind}-parallel {n} (server.extra_args)" for kind, n in sizes.items()
                          if kind != "tensor" and n > 1)


def check_server_gpus(config: dict, need: int, sizes: dict) -> list[str]:
    """A server's job (server.slurm.gpus) and the validation jobs (validate.gpus, where set) hold the GPUs one
    vLLM server uses (``need``), or vLLM fails at its start. 0 GPUs: a CPU server, nothing to compare."""
    errors, s = [], config["server"]
    job, validate = s["slurm"]["gpus"], config["validate"]["gpus"]
    if s["mode"] == "slurm" and job and job < need:
        errors.append(f"{parallel_text(sizes)} needs {need} GPUs a server, but the server's SLURM job asks for {job} "
                      f"(server.slurm.gpus {job}): vLLM would fail at its start; set server.slurm.gpus to {need} (or "
                      f"null: the GPUs a server uses), or lower server.tensor_parallel_size to {job}")
    if validate and validate < need:
        errors.append(f"validate.gpus {validate} is fewer than the {need} GPUs a validation server uses "
                      f"({parallel_text(sizes)}: validate_draft and curve_point start the target's server in their job); "
                      f"set validate.gpus to {need} (or null: the server's)")
    return errors


def node_capacity(config: dict, nodes, has_gpu: bool) -> tuple[int | None, str]:
    """(the most GPUs one job may hold, where that figure comes from): under server.mode slurm the GPU partition's
    largest node (sinfo's ``nodes``), else server.slurm.node_gpus; elsewhere this machine's (nvidia-smi). None
    where not known, with why."""
    s = config["server"]
    if s["mode"] != "slurm":
        n = machine_gpus() if has_gpu else 0
        return (n, f"this machine's {n} GPUs (nvidia-smi)") if n else (None, "")
    if nodes and any(k.gpus for k in nodes):
        top = max(nodes, key=lambda k: k.gpus)
        return top.gpus, f"a node of partition {top.partition} has at most {top.gpus} (sinfo gres {top.gres})"
    if s["slurm"]["node_gpus"]:
        return s["slurm"]["node_gpus"], f"a node has {s['slurm']['node_gpus']} (server.slurm.node_gpus)"
    why = "sinfo does not answer here" if nodes is None else "sinfo lists no GPU gres in the GPU partition"
    return None, (f"GPUs a node has not known: {why} and server.slurm.node_gpus is null; the jobs' GPU counts are "
                  "not checked against a node")


def job_gpus(config: dict, need: int, has_gpu: bool) -> list[tuple[str, str, int]]:
    """``[(what asks, the key to change, GPUs)]`` of what holds GPUs on one node: one server (``need``), the server's job, this
    machine's servers, and the rules' GPUs where set (unset, they follow the server's)."""
    s = config["server"]
    jobs = [(parallel_text(server_parallel_of(s)), "server.tensor_parallel_size", need)]
    if s["mode"] == "slurm" and s["slurm"]["gpus"] not in (None, need):
        jobs.append((f"server.slurm.gpus {s['slurm']['gpus']}", "server.slurm.gpus", s["slurm"]["gpus"]))
    if s["mode"] == "local" and s["replicas"] > 1:
        jobs.append((f"server.replicas {s['replicas']} x {need} GPUs a server", "server.replicas", s["replicas"] * need))
    sections = ["train", "validate"] + (["hidden"] if config["hidden"]["backend"] == "transformers" else [])
    return jobs + [(f"{sec}.gpus {config[sec]['gpus']}", f"{sec}.gpus", stage_gpus(config, sec, has_gpu))
                   for sec in sections if config[sec]["gpus"] is not None]


def server_parallel_of(server: dict) -> dict:
    """serving.vllm.server_parallel of the config's server: section."""
    return server_parallel(ServerConfig.from_dict(server))


def partition_gpu(nodes) -> tuple | None:
    """``(node kind, model, GiB)`` of the GPU partition's largest known GPU (gres type, else node features)."""
    found = [(k, known_gpu(k.gpu_type) or known_gpu(" ".join(k.features))) for k in nodes or () if k.gpus]
    found = [(k, *g) for k, g in found if g]
    return max(found, key=lambda f: f[2]) if found else None


def sized_for(config: dict) -> tuple[str, str, float] | None:
    """``(key and value, GPU, GiB)`` of the GPU a config states it was sized for: server.slurm.gpu_type, else the
    memory hidden.vllm.gpu_memory_gib states; None where it states neither."""
    stated, memory = config["server"]["slurm"]["gpu_type"], config["hidden"]["vllm"]["gpu_memory_gib"]
    gpu = known_gpu(stated) if stated else None
    if gpu:
        return f"server.slurm.gpu_type {stated}", *gpu
    if memory and config["hidden"]["backend"] == "vllm":
        return f"hidden.vllm.gpu_memory_gib {memory:g}", f"{memory:g} GiB", memory
    return None


def check_gpu_type(config: dict, nodes, need: int) -> tuple[str | None, str | None]:
    """(failure, skipped note) of the GPU a config was sized for (``sized_for``) against the GPU partition's, from
    sinfo's gres types and node features."""
    stated = config["server"]["slurm"]["gpu_type"]
    if stated and not known_gpu(stated):
        return (f"server.slurm.gpu_type {stated!r} is not a GPU eaglenest knows ({', '.join(GPU_MEMORY_GIB)}); name "
                "one of them, or null", None)
    sized = sized_for(config)
    if config["server"]["mode"] != "slurm" or sized is None:
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


def check_weights(config: dict, need: int, nodes) -> tuple[str | None, str | None]:
    """(failure, skipped note): the target's weights (states.preflight.weights_bytes) within vLLM's share of one
    server's GPUs, on the partition's GPUs (sinfo), else the GPU the config was sized for, else this machine's."""
    s = config["server"]
    found, sized = partition_gpu(nodes), sized_for(config)
    gib, where = (found[2], f"partition {found[0].partition}'s {found[1]}") if found else \
        (sized[2], f"{sized[1]}, {sized[0]}") if sized else (gpu_memory_gib(), "this machine's (nvidia-smi)")
    if not gib or s["mode"] == "external":
        return None, None
    model = config["hidden"]["target"] or s["model"]
    weights = weights_bytes(model)
    if weights is None:
        return None, (f"the weights of {model} not compared with its GPUs: no model.safetensors(.index.json) here "
                      f"(a local directory or the Hugging Face cache; `hf download {model} model.safetensors.index.json`)")
    share = s["gpu_memory_utilization"] or 0.9
    room = need * gib * 2**30 * share
    if weights <= room:
        return None, None
    return (f"the weights of {model} ({weights / 1e9:,.0f} GB, its model.safetensors) do not fit one server's "
            f"{need} GPUs of {gib:g} GiB ({where}) at server.gpu_memory_utilization {share:g}: {need} x {gib:g} GiB x "
            f"{share:g} = {room / 1e9:,.0f} GB; raise server.tensor_parallel_size (and the GPUs it asks for), or use "
            "larger GPUs", None)


def check_gpus(config: dict, has_gpu: bool, review: Review) -> None:
    """The GPU checks: a server's GPUs against its jobs', every job's against a node's, the GPU type; where
    server.mode slurm, the GPU partition itself (serving.slurm.check_gpu_partition)."""
    s = config["server"]
    sizes = server_parallel_of(s)
    need = math.prod(sizes.values())
    review.add(*check_server_gpus(config, need, sizes))
    nodes = None
    if s["mode"] == "slurm":
        settings, listed = SlurmSettings.from_dict(s["slurm"]), sinfo_nodes()
        nodes = partition_nodes(settings, listed) if listed else None
        held = server_gpus(config) + stage_gpus(config, "train", has_gpu) + stage_gpus(config, "validate", has_gpu)
        try:
            review.notes += [note for note in (check_gpu_partition(settings, held),) if note]
        except ConfigError as e:
            review.add(str(e))
    cap, source = node_capacity(config, nodes, has_gpu)
    if cap is None and source:
        review.skipped.append(source)
    for what, key, n in job_gpus(config, need, has_gpu) if cap else []:
        if n > cap:
            review.add(f"{what} asks for more GPUs than one node has ({source}): a job runs on one node; lower {key} to "
                       f"fit {cap}")
    for failure, note in (check_gpu_type(config, nodes, need), check_weights(config, need, nodes)):
        review.add(failure)
        review.skipped += [note] if note else []


def check_target(config: dict, workdir: Path, review: Review) -> dict | None:
    """The checks against the target's config.json (returned, None where it is not here) and the lengths."""
    model = config["hidden"]["target"] or config["server"]["model"]
    cfg = find_target_config(model, workdir)
    if cfg is None:
        review.skipped.append(f"aux layer ids, draft vocabulary and tensor_parallel_size not checked: no config.json for "
                              f"{model} here (a local directory or the Hugging Face cache) and the hub did not give it "
                              f"(offline, or gated without HF_TOKEN); fetch it first where the hub answers, e.g. "
                              f"`hf download {model} config.json`")
    else:
        review.add(check_aux_ids(config, model, cfg), check_vocab(config, model, cfg), check_heads(config, model, cfg),
                   check_context(config, model, cfg))
    if config["server"]["max_model_len"] or _text_key(cfg or {}, "max_position_embeddings"):
        review.add(*check_lengths(config, cfg))
    else:
        review.skipped.append("generation.max_tokens and hidden.max_length not checked: server.max_model_len is null "
                              "and the target's max_position_embeddings is not known here")
    review.add(check_longest_prompt(config, model, cfg, workdir))
    return cfg


def review_config(config: dict, plan, workdir: str | Path = ".", *, has_gpu: bool = False, executor: str | None = None,
                  validate_minutes: int | None = None, sources=()) -> Review:
    """Every check of a resolved config, all of them run, whatever fails. ``plan``: eaglenest.plan's Plan of this
    config (its figures and disk verdict). What Snakemake knows and the library does not: ``has_gpu`` (nvidia-smi
    here), ``executor`` (the cluster executor's name; None where jobs run here), ``validate_minutes`` (the
    profile's runtime of validate_draft) and ``sources`` (the config files)."""
    workdir, review = Path(workdir), Review()
    check_target(config, workdir, review)
    review.add(*check_datasets(config, workdir))
    review.add(*check_drafts(config, workdir))
    found, notes = check_columns(config, workdir)
    review.add(*found)
    review.skipped += notes
    if plan.mode == "files" and plan.files_bytes is None:
        review.skipped.append("files mode's disk not checked: the target's hidden size is unknown (set plan.hidden_size)")
    review.add(plan.disk_refusal(), *check_stream_mode(config), *check_stream_disk(config, plan, workdir), check_ttt(config),
               check_slurm_time(config), validation_refusal(plan, validate_minutes),
               check_local_server(config, executor, sources))
    if config["hidden"]["backend"] == "vllm":
        failure, note = check_logits_room(config)
        review.add(failure)
        (review.skipped if " not checked" in note else review.notes).extend([note] if note else [])
    check_gpus(config, has_gpu, review)
    return review


def check_config(config: dict, plan, workdir: str | Path = ".", **facts) -> list[str]:
    """``review_config``: raise ConfigError with one line per failure, else return the notes of the checks skipped
    (the plan prints them)."""
    review = review_config(config, plan, workdir, **facts)
    if review.errors:
        raise ConfigError("\n".join(review.errors))
    return review.skipped
