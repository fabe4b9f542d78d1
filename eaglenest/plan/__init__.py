"""What a run will cost, from the config and the dataset's size alone, before any job runs.

`make_plan` computes the figures (prompts, the answers each costs: a conversation of N turns costs N
requests and their tokens; the upper bound on tokens, the hidden states' disk in
`files` mode against `stream` mode's budget, the GPUs each stage holds and the servers' replicas, each
stage's time and GPU-hours, and the run's total: wall time, GPU-hours and peak disk with the target's own
weights); generation's time comes from the measured rate once trace shards have finished, else from
plan.generate_tokens_per_s, else from a rate assumed from the GPU kind and the weights' size, said so;
`format_plan` writes them as the lines the workflow logs at every start (dry-runs included) and
`python -m eaglenest.plan` (`make plan`) prints. Nothing here downloads anything or starts a job.
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..data.prompts import same_prompts
from ..gguf import is_gguf
from ..gpus import GPU_MEMORY_GIB, known_gpu, nvidia_smi
from ..serving.settings import ServerConfig
from ..serving.slurm import SlurmSettings
from ..serving.slurm import server_gpus as slurm_server_gpus
from ..states.preflight import bytes_per_token, target_config
from ..validation.matrix import matrix_temperatures

# files mode needs more than this, or more than the free disk: the plan suggests stream mode.
SUGGEST_STREAM_BYTES = 10**12
# The GPUs the assumed generation rate knows, by the name nvidia-smi gives them: memory in GiB (as nvidia-smi
# reports it, to match hidden.vllm.gpu_memory_gib) and memory bandwidth in TB/s (the vendor's figure).
# Memory bandwidth (TB/s) of the GPUs the assumed generation rate knows; their memory is gpus.GPU_MEMORY_GIB's.
GPU_BANDWIDTH_TBS = {"B200": 8.0, "H200": 4.8, "H100": 3.35, "A100": 2.04, "L40S": 0.864}
DEFAULT_GPU = "H100"  # where neither nvidia-smi nor hidden.vllm.gpu_memory_gib says
# The assumed generation rate: one decode step of a replica's whole batch takes this many times as long as one
# read of its weights at its GPUs' memory bandwidth (the KV cache's reads, the compute, the all-reduces), and no
# less than MIN_STEP_S (vLLM's scheduling, sampling and kernel launches, which dominate for small models).
STEP_PER_WEIGHT_READ = 10
MIN_STEP_S = 0.02
# A trace on disk, a token: its id in JSON (up to 7 B with the comma) and its text (about 4 B).
TRACE_BYTES_PER_TOKEN = 12


def gpus_text(n: int) -> str:
    """``n`` GPU(s) in words: "1 GPU", "8 GPUs"."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def stage_gpus(config: dict, section: str, has_gpu: bool) -> int:
    """GPUs of one job of a config section (hidden, train, validate): `<section>.gpus` when set.
    Unset, under server.mode slurm they follow the server job's GPUs (server.slurm.gpus, else
    tensor_parallel_size), never the submitting node, a login node without GPUs; elsewhere the GPUs of
    this machine. Validation starts the target's servers, so it takes the server's count; the others one."""
    n = config[section]["gpus"]
    if n is not None:
        return n
    server = server_gpus(config) if config["server"]["mode"] == "slurm" else (
        config["server"]["tensor_parallel_size"] if has_gpu else 0)
    return server if section == "validate" else min(1, server)


def server_gpus(config: dict) -> int:
    """GPUs of one server (one replica): under SLURM its job's (serving.slurm.server_gpus); elsewhere
    tensor_parallel_size."""
    s = config["server"]
    if s["mode"] == "slurm":
        return slurm_server_gpus(ServerConfig.from_dict(s), SlurmSettings.from_dict(s["slurm"]))
    return s["tensor_parallel_size"]


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


def target_hidden_size(config: dict) -> tuple[int | None, str]:
    """The target's hidden size and where it was read: the target's config.json (a local directory or the
    Hugging Face cache) or GGUF metadata, else `plan.hidden_size` (a stand-in until the target's is here)."""
    model = config["hidden"]["target"] or config["server"]["model"]
    cfg = target_config(model) or {}
    h = cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size")
    if h:  # the target's own figure wins over the config's stand-in
        return h, f"{model}'s {'GGUF metadata' if is_gguf(model) else 'config.json'}"
    return config["plan"]["hidden_size"], "plan.hidden_size"


def gpu_kind(config: dict, has_gpu: bool) -> tuple[str, str]:
    """The GPU the target's servers run on, as GPU_BANDWIDTH_TBS names it, and how the plan knows: nvidia-smi's name
    here (server.mode local), else the GPU the config was sized for (server.slurm.gpu_type), else the kind whose
    memory is nearest hidden.vllm.gpu_memory_gib, else DEFAULT_GPU."""
    if has_gpu and config["server"]["mode"] == "local":
        names = " ".join(row[0] for row in nvidia_smi("--query-gpu=name") if row).upper()
        kind = next((k for k in GPU_BANDWIDTH_TBS if k in names), None)
        if kind:
            return kind, "nvidia-smi here"
    stated = known_gpu(config["server"]["slurm"]["gpu_type"])
    if stated and stated[0] in GPU_BANDWIDTH_TBS:
        return stated[0], f"server.slurm.gpu_type {config['server']['slurm']['gpu_type']}"
    gib = config["hidden"]["vllm"]["gpu_memory_gib"]
    if gib:
        kind = min(GPU_BANDWIDTH_TBS, key=lambda k: abs(GPU_MEMORY_GIB[k] - gib))
        return kind, f"hidden.vllm.gpu_memory_gib {gib:g} GiB is nearest its memory"
    return DEFAULT_GPU, "assumed: no nvidia-smi here, no hidden.vllm.gpu_memory_gib"


def target_weights(config: dict) -> tuple[int | None, str]:
    """Bytes of the target's weights on disk (server.model) and where the figure comes from: a local directory's
    files or a GGUF file; a hub name's safetensors in the Hugging Face cache; else plan.weights_gb. Nothing is
    downloaded."""
    model = config["server"]["model"]
    found = local_bytes(model) or cached_bytes(model)
    if found:
        return found
    if config["plan"]["weights_gb"]:
        return int(config["plan"]["weights_gb"] * 1e9), "plan.weights_gb"
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


def assumed_generation(config: dict, weights_bytes: int | None, has_gpu: bool) -> dict | None:
    """Output tokens a second of one replica, assumed where plan.generate_tokens_per_s is unset: its share of
    generation.concurrency in flight at each decode step, a step STEP_PER_WEIGHT_READ times one read of the weights
    at its GPUs' memory bandwidth (at least MIN_STEP_S). None where the setting is given, the weights' size is
    unknown, or the GPUs are not the plan's to know (an external server; one on a CPU, here or in a SLURM job)."""
    s = config["server"]
    on_cpu = s["mode"] == "local" and not has_gpu
    if config["plan"]["generate_tokens_per_s"] or not weights_bytes or on_cpu or s["mode"] == "external":
        return None
    gpus, in_flight = server_gpus(config), config["generation"]["concurrency"] / s["replicas"]
    if not gpus:  # a SLURM job of server.slurm.gpus 0: vLLM on the node's CPU
        return None
    kind, source = gpu_kind(config, has_gpu)
    step_s = max(MIN_STEP_S, STEP_PER_WEIGHT_READ * weights_bytes / (gpus * GPU_BANDWIDTH_TBS[kind] * 1e12))
    return {"rate": in_flight / step_s, "in_flight": in_flight, "step_s": step_s, "gpus": gpus, "kind": kind,
            "kind_source": source}


class Stage(NamedTuple):
    """One stage's time: it holds ``gpus`` GPUs for ``seconds`` (None: not estimated), of which ``overlap_s`` run
    during another stage (stream mode's extraction server, during training) and add nothing to the wall time."""
    seconds: float | None
    gpus: int
    how: str
    overlap_s: float = 0.0

    @property
    def wall_s(self) -> float | None:
        return None if self.seconds is None else self.seconds - self.overlap_s


@dataclass
class Plan:
    prompts: int | None          # training prompts (None: unknown, a hub dataset without limit)
    prompts_source: str
    max_tokens: int
    turns: float                 # answers (requests) a prompt costs: a conversation's turns (answers_per_prompt)
    turns_source: str
    requests: int | None          # answers over the run: prompts x turns
    sequence_tokens: int | None  # the longest sequence the hidden states hold
    generated_tokens: int | None  # upper bound over the run
    state_tokens: int | None      # upper bound of tokens in the hidden states
    hidden_size: int | None
    hidden_size_source: str
    files_bytes: int | None       # hidden.mode files: the shards
    stream_bytes: int             # hidden.mode stream: hidden.stream.max_disk_gb
    free_bytes: int | None
    mode: str
    replicas: int
    server_mode: str
    gpus: dict = field(default_factory=dict)  # stage -> words
    measured: dict | None = None  # from finished trace shards: done, rate, remaining seconds
    validation: dict | None = None  # validation_time: server starts, tokens and seconds per start, total
    stages: dict = field(default_factory=dict)  # stage_hours: stage -> Stage
    skipped: list = field(default_factory=list)  # checks.check_config's notes: checks it could not run
    weights_bytes: int | None = None  # the target's weights on disk (target_weights)
    weights_source: str = ""
    assumed: dict | None = None  # assumed_generation: the rate generation's time assumes, and from what

    def disk_refusal(self) -> str | None:
        """The plan's verdict binds: files mode whose shards cannot fit the free disk (checks.check_config stops there)."""
        if self.mode == "files" and self.files_bytes is not None and self.free_bytes is not None \
                and self.files_bytes > self.free_bytes:
            return (f"hidden.mode files: the shards need up to {human_bytes(self.files_bytes)} and "
                    f"the working directory's disk has {human_bytes(self.free_bytes)} free; set hidden.mode: stream (at most "
                    "hidden.stream.max_disk_gb on disk at once), or lower dataset.limit or hidden.max_length")
        return None

    @property
    def suggest_stream(self) -> bool:
        big = self.files_bytes is not None and (self.files_bytes >= SUGGEST_STREAM_BYTES or
                                                (self.free_bytes is not None and self.files_bytes > self.free_bytes))
        return self.mode == "files" and big


def training_prompts(config: dict, workdir: Path) -> tuple[int | None, str]:
    """How many prompts the traces answer: data/prompts/stats.json once prepare_prompts has run, else
    the local dataset's rows less the held-out ones (capped by dataset.limit), else dataset.limit."""
    stats, other = workdir / "data" / "prompts" / "stats.json", ""
    if stats.is_file():
        made = json.loads(stats.read_text())
        if same_prompts(made, config):
            return made["train"], str(stats)
        other = f"; {stats} is another dataset's or setting's, not used"
    n, source = _expected_prompts(config)
    return n, source + other


def _expected_prompts(config: dict) -> tuple[int | None, str]:
    d = config["dataset"]
    if d["generate"]["questions"]:
        n = max(0, d["generate"]["questions"] - d["heldout"])
        return (min(n, d["limit"]) if d["limit"] else n), "dataset.generate.questions less the held-out, at most"
    rows = dataset_rows(d["path"])
    if rows is not None:
        n = max(0, rows - d["heldout"])
        return (min(n, d["limit"]) if d["limit"] else n), f"{d['path']}: {rows} rows, at most"
    if d["limit"]:
        return d["limit"], "dataset.limit, at most"
    return None, f"{d['path']} (a hub dataset without dataset.limit: its size is not known before it is read)"


def validation_time(config: dict) -> dict:
    """Validation's time, from the config: every validation run (the target alone, EAGLE-3 in each export
    format, n-gram) is one server start that sends the held-out set one request at a time (the headline), then
    the matrix's other cells one request at a time (validate.matrix_prompts of each set at each temperature),
    and the held-out set again at validate.concurrency. Upper bound: every answer runs to validate.max_tokens.
    ``seconds`` is None without plan.decode_tokens_per_s or where a set's size is unknown."""
    v, d = config["validate"], config["dataset"]
    max_tokens = v["max_tokens"] or config["generation"]["max_tokens"]
    fmt = config["export"]["format"]
    starts = 2 + (2 if fmt == "both" else 1)
    sizes = [d["heldout"]] + [s.get("limit") or dataset_rows(s["path"]) for s in v["datasets"]]
    mp, one_at_a_time, unknown = v["matrix_prompts"], d["heldout"], []
    for i, n in enumerate(sizes):
        for t in matrix_temperatures(v["temperatures"], config["generation"]["temperature"]):
            if i == 0 and t == 0:
                continue  # the headline, counted above
            cell = min(n, mp) if n is not None and mp else n if n is not None else mp
            if cell is None:
                unknown.append(v["datasets"][i - 1]["name"])
            else:
                one_at_a_time += cell
    tokens = one_at_a_time * max_tokens
    rate = config["plan"]["decode_tokens_per_s"]
    per_start = None
    # the held-out set at validate.concurrency: at best concurrency x faster
    concurrent = d["heldout"] * max_tokens / (rate * max(1, v["concurrency"])) if rate else None
    if rate and not unknown:
        per_start = config["plan"]["server_start_s"] + tokens / rate + concurrent
    # The learning curve: each draft kept along training (train.snapshots) is one more start (rule curve_point)
    # that sends the held-out set once at validate.concurrency.
    points = config["train"]["snapshots"]
    per_point = (config["plan"]["server_start_s"] + concurrent) if rate else None
    return {"starts": starts, "tokens_per_start": tokens, "max_tokens": max_tokens, "rate": rate,
            "per_start_s": per_start, "seconds": per_start * starts if per_start else None, "unknown_sets": unknown,
            "curve_points": points, "per_point_s": per_point}


def validation_refusal(plan: "Plan", limit_minutes: int | None) -> str | None:
    """Validation that cannot finish within its SLURM time (``limit_minutes``), with the figures and the fixes."""
    v = plan.validation
    if not v or not v["seconds"] or not limit_minutes or v["seconds"] <= limit_minutes * 60:
        return None
    return (f"validation needs about {v['seconds'] / 3600:.1f} h ({v['starts']} server starts x "
            f"{v['per_start_s'] / 3600:.1f} h: {v['tokens_per_start']:,} tokens one request at a time at "
            f"plan.decode_tokens_per_s {v['rate']:g}), above validate_draft's SLURM time of {limit_minutes / 60:g} h; "
            f"lower validate.matrix_prompts, validate.max_tokens or validate.temperatures, or raise validate_draft's "
            f"runtime in the profile")


def answers_fingerprint(config: dict) -> str:
    """The fingerprint trace shards of this config carry: its served model and answer settings."""
    from ..data.traces import fingerprint

    return fingerprint(ServerConfig.from_dict(config["server"]).model_id, config["generation"])


def measured_rate(workdir: Path, prompts: int | None, fingerprint: str | None = None) -> dict | None:
    """From the finished trace shards' stats: records done, their answers (a conversation's turns each), requests
    per second over their runs, and the seconds the rest would take at that rate, each record costing as many
    requests as the done ones did on average. None before any shard has stats. ``fingerprint``: only shards
    answered by this target with these answer settings count (eaglenest.data.traces.fingerprint)."""
    done = answers = answered = 0
    wall = 0.0
    for f in sorted((workdir / "traces").glob("shard_*.stats.json")):
        s = json.loads(f.read_text())
        if fingerprint is not None and s.get("fingerprint") != fingerprint:
            continue  # another target's or another setting's traces: their rate says nothing of this run
        done += s.get("records", 0)
        conversations = s.get("conversations") or {}  # data.trace_stats: a shard of conversations' turns
        answers += s.get("records", 0) - conversations.get("records", 0) + conversations.get("turns", 0)
        answered += s.get("completed", 0)
        wall += s.get("wall_s") or 0.0
    if not answered or wall <= 0:
        return None
    rate = answered / wall
    per_record = answers / done if done else 1.0
    remaining = max(0, (prompts or done) - done)
    return {"done": done, "answers": answers, "answers_per_record": per_record, "rate": rate,
            "remaining_s": remaining * per_record / rate}


def answers_per_prompt(config: dict, measured: dict | None) -> tuple[float, str]:
    """The answers (requests to the trace server) one training prompt costs, and whence: a conversation of N
    turns costs N. With dataset.max_turns 1, one; once trace shards have finished, their mean; with questions
    the target writes, at most dataset.generate.turns; else at most dataset.max_turns."""
    # dataset.max_turns and dataset.generate.turns: 1 (first questions alone) in configs from before them
    max_turns = config["dataset"].get("max_turns", 1)
    if max_turns == 1:
        return 1, "dataset.max_turns 1"
    if measured:
        return measured["answers_per_record"], "the mean of the finished trace shards"
    generate = config["dataset"]["generate"]
    if generate["questions"]:
        turns = min(max_turns, generate.get("turns", 1))
        return turns, f"dataset.generate.turns {generate.get('turns', 1)}, dataset.max_turns {max_turns}: at most"
    return max_turns, "dataset.max_turns: at most"


def make_plan(config: dict, workdir: str | Path = ".", has_gpu: bool | None = None) -> Plan:
    """The plan of a resolved config (schema defaults filled in) in working directory ``workdir``."""
    workdir = Path(workdir)
    has_gpu = bool(shutil.which("nvidia-smi")) if has_gpu is None else has_gpu
    s, g, h = config["server"], config["generation"], config["hidden"]
    prompts, source = training_prompts(config, workdir)
    measured = measured_rate(workdir, prompts, answers_fingerprint(config))
    turns, turns_source = answers_per_prompt(config, measured)
    # a conversation's sequence grows turn by turn: each turn's prompt and answer at most
    per_turn = config["dataset"]["max_prompt_chars"] + g["max_tokens"]
    limits = [h["max_length"], s["max_model_len"], config["dataset"].get("max_context_tokens"),
              per_turn * max(1, math.ceil(turns))]
    seq = min(x for x in limits if x)
    hidden_size, hsource = target_hidden_size(config)
    # each answer's chain its own sequence at most (a template that re-renders earlier answers otherwise)
    requests = math.ceil(prompts * turns) if prompts is not None else None
    state_tokens = requests * seq if requests is not None else None
    free = shutil.disk_usage(workdir if workdir.exists() else ".").free
    plan = Plan(prompts=prompts, prompts_source=source, max_tokens=g["max_tokens"], turns=turns, turns_source=turns_source,
                requests=requests, sequence_tokens=seq,
                generated_tokens=requests * g["max_tokens"] if requests is not None else None,
                state_tokens=state_tokens, hidden_size=hidden_size, hidden_size_source=hsource,
                files_bytes=state_tokens * bytes_per_token(hidden_size) if state_tokens and hidden_size else None,
                stream_bytes=int(h["stream"]["max_disk_gb"] * 1e9), free_bytes=free, mode=h["mode"],
                replicas=s["replicas"], server_mode=s["mode"], measured=measured,
                validation=validation_time(config))
    plan.weights_bytes, plan.weights_source = target_weights(config)
    plan.assumed = assumed_generation(config, plan.weights_bytes, has_gpu)
    plan.gpus = stage_plan(config, has_gpu)
    plan.stages = stage_hours(config, plan, has_gpu)
    return plan


def stage_hours(config: dict, plan: Plan, has_gpu: bool) -> dict:
    """``{stage: Stage}``: each stage's time (an upper bound: every answer runs to generation.max_tokens, every
    sequence to the plan's longest) from the measured trace rate or the stated or assumed rates, and the GPUs it
    holds meanwhile, for its GPU-hours."""
    training = training_stage(config, plan, has_gpu)
    return {"generation": generation_stage(config, plan, has_gpu), "extraction": extraction_stage(config, plan, has_gpu, training),
            "training": training, "validation": validation_stage(config, plan, has_gpu)}


def generation_stage(config: dict, plan: Plan, has_gpu: bool) -> Stage:
    """The trace servers (every replica) from their start until the last answer: the rest at the measured rate,
    else every prompt at plan.generate_tokens_per_s, else at the assumed rate (plan.assumed)."""
    p, s = config["plan"], config["server"]
    held = s["replicas"] * server_gpus(config) if s["mode"] != "external" else 0
    if plan.measured:
        return Stage(plan.measured["remaining_s"], held, "the rest, at the measured trace rate")
    if p["generate_tokens_per_s"]:
        rate, how = p["generate_tokens_per_s"], f"plan.generate_tokens_per_s {p['generate_tokens_per_s']:g}"
    elif plan.assumed:
        rate, how = plan.assumed["rate"], f"the assumed {plan.assumed['rate']:,.0f} tokens/s"
    else:
        return Stage(None, held, f"set plan.generate_tokens_per_s ({no_assumed_rate(config, plan, has_gpu)}), or "
                     "wait for a finished trace shard")
    if plan.generated_tokens is None:
        return Stage(None, held, "the prompts are unknown: set dataset.limit")
    return Stage(p["server_start_s"] + plan.generated_tokens / (rate * s["replicas"]), held,
                 f"{plan.generated_tokens:,} tokens at {how} a replica x {s['replicas']}, after one start")


def no_assumed_rate(config: dict, plan: Plan, has_gpu: bool) -> str:
    """Why the plan assumes no generation rate (assumed_generation gave none), in words."""
    if plan.weights_bytes is None:
        return "or plan.weights_gb for an assumed one"
    if config["server"]["mode"] == "external":
        return "no rate is assumed for external servers"
    if config["server"]["mode"] == "slurm":
        return "no rate is assumed for vLLM on a CPU (server.slurm.gpus 0)"
    return "no rate is assumed for vLLM on this machine's CPU"


def training_stage(config: dict, plan: Plan, has_gpu: bool) -> Stage:
    """train_draft: every epoch's tokens at plan.train_tokens_per_s a process; in stream mode no faster than the
    one extraction server computes them (plan.extract_tokens_per_s, where set)."""
    p, t = config["plan"], config["train"]
    gpus = stage_gpus(config, "train", has_gpu)
    if not (p["train_tokens_per_s"] and plan.state_tokens):
        return Stage(None, gpus, "set plan.train_tokens_per_s")
    tokens, procs = plan.state_tokens * t["epochs"], t["nproc"] or max(1, gpus)  # one process a GPU
    seconds = tokens / (p["train_tokens_per_s"] * procs)
    how = f"{t['epochs']:g} epoch(s) at plan.train_tokens_per_s {p['train_tokens_per_s']:g} a process x {procs}"
    extract = p["extract_tokens_per_s"]
    if config["hidden"]["mode"] == "stream" and extract and tokens / extract > seconds:
        seconds, how = tokens / extract, how + f", held back to the extraction server's plan.extract_tokens_per_s {extract:g}"
    return Stage(seconds, gpus, how + (" (train.max_steps may stop it sooner)" if t["max_steps"] else ""))


def extraction_stage(config: dict, plan: Plan, has_gpu: bool, training: Stage) -> Stage:
    """Files mode: every state token at plan.extract_tokens_per_s a server (each replica, vLLM backend), after one
    start. Stream mode: one extraction server, held from its start until training ends; only its start adds to
    the wall time."""
    p, h, s = config["plan"], config["hidden"], config["server"]
    if h["mode"] == "stream":
        held = None if training.seconds is None else p["server_start_s"] + training.seconds
        return Stage(held, server_gpus(config), "hidden.mode stream: one extraction server, its start and then "
                     "held while training runs", overlap_s=training.seconds or 0.0)
    servers = s["replicas"] if h["backend"] == "vllm" else 1
    gpus = servers * server_gpus(config) if h["backend"] == "vllm" else stage_gpus(config, "hidden", has_gpu)
    rate = p["extract_tokens_per_s"]
    if not (rate and plan.state_tokens):
        return Stage(None, gpus, "set plan.extract_tokens_per_s")
    return Stage(p["server_start_s"] + plan.state_tokens / (rate * servers), gpus,
                 f"plan.extract_tokens_per_s {rate:g} a server x {servers}, after one start")


def validation_stage(config: dict, plan: Plan, has_gpu: bool) -> Stage:
    """validate_draft and the learning curve's starts (validation_time), on validate.gpus."""
    v, gpus = plan.validation, stage_gpus(config, "validate", has_gpu)
    curve = v["per_point_s"] * v["curve_points"] if v and v.get("per_point_s") is not None else None
    seconds = v["seconds"] + (curve or 0) if v and v["seconds"] else None
    return Stage(seconds, gpus, "the validation time and the learning curve's starts above" if seconds
                 else "set plan.decode_tokens_per_s")


def stage_plan(config: dict, has_gpu: bool) -> dict:
    """What each stage holds, in words: servers (replicas x GPUs, SLURM jobs) and the rules' GPUs."""
    s, h = config["server"], config["hidden"]

    def servers(what, n):
        per = server_gpus(config)
        if s["mode"] == "external":
            return f"{len(s['urls'])} external {what}(s) at server.urls, none started here"
        where = "SLURM job" if s["mode"] == "slurm" else "local " + what
        cpu = "" if has_gpu or s["mode"] == "slurm" else " (no GPU on this machine: vLLM runs on its CPU)"
        return f"{n} {where}(s) x {gpus_text(per)} = {gpus_text(n * per)}{cpu}"

    if h["backend"] != "vllm":
        extraction = f"{gpus_text(stage_gpus(config, 'hidden', has_gpu))} per extract_hidden job (transformers)"
    elif h["mode"] == "stream":  # states/extract.py: stream mode reads from one server, whatever server.replicas
        extraction = servers("extraction server", 1) + ", while train_draft runs (hidden.mode stream: one server)"
    else:
        extraction = servers("extraction server", s["replicas"])
    return {"generate_traces": servers("server", s["replicas"]), "extract_hidden": extraction,
            "train_draft": gpus_text(stage_gpus(config, 'train', has_gpu)),
            "validate_draft": f"{gpus_text(stage_gpus(config, 'validate', has_gpu))} (one server at a time)"}


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return ""


def human_seconds(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def format_plan(p: Plan) -> str:
    """The plan as a few lines of text."""
    n = f"{p.prompts:,}" if p.prompts is not None else "unknown"
    lines = ["plan:", f"  prompts: {n} ({p.prompts_source})"]
    if p.turns != 1:
        r = f": {p.requests:,} requests" if p.requests is not None else ""
        lines.append(f"  conversations: {p.turns:.3g} turns each ({p.turns_source}){r}, a request and its tokens a turn")
    if p.prompts is not None:
        asked = f"{n} x" if p.turns == 1 else f"{p.requests:,} requests x"
        each = "" if p.turns == 1 else ", a turn's chain each at most"
        lines.append(f"  tokens: at most {p.generated_tokens:,} generated ({asked} generation.max_tokens {p.max_tokens:,}); "
                     f"at most {p.state_tokens:,} in the hidden states ({p.sequence_tokens:,} a sequence{each})")
    if p.files_bytes is not None:
        per = bytes_per_token(p.hidden_size)
        lines.append(f"  hidden states, files mode: up to {human_bytes(p.files_bytes)} of shards ({per:,} B a token, "
                     f"hidden size {p.hidden_size} from {p.hidden_size_source}); free here: {human_bytes(p.free_bytes)}")
    else:
        lines.append(f"  hidden states, files mode: unknown (no hidden size: {p.hidden_size_source} not found; "
                     "set plan.hidden_size)")
    lines.append(f"  hidden states, stream mode: at most {human_bytes(p.stream_bytes)} at once (hidden.stream.max_disk_gb)")
    lines.append(f"  hidden.mode: {p.mode}" + ("  <- suggest hidden.mode: stream: files mode needs "
                                               f"{human_bytes(p.files_bytes)}" if p.suggest_stream else ""))
    lines.append(f"  replicas: {p.replicas} (server.replicas, server.mode {p.server_mode})")
    lines += [f"  GPUs, {stage}: {what}" for stage, what in p.gpus.items()]
    lines += generation_lines(p) + validation_lines(p.validation) + stage_lines(p)
    lines += [f"  skipped check: {note}" for note in p.skipped]
    return "\n".join(lines)


def generation_lines(p: Plan) -> list[str]:
    """The measured trace rate once a shard has finished, else the assumed one where no rate is stated."""
    if p.measured:
        m = p.measured
        return [f"  generation so far: {m['done']:,} traces at {m['rate']:.2f} requests/s; the rest "
                f"about {human_seconds(m['remaining_s'])} at that rate"]
    if not p.assumed:
        return []
    a = p.assumed
    return [f"  generation rate, assumed: {a['rate']:,.0f} tokens/s a replica: {a['in_flight']:g} requests in flight, "
            f"a decode step of {a['step_s'] * 1000:,.0f} ms ({STEP_PER_WEIGHT_READ} x one read of "
            f"{human_bytes(p.weights_bytes)} of weights from {p.weights_source} at {a['gpus']} x {a['kind']}'s "
            f"{GPU_BANDWIDTH_TBS[a['kind']]:g} TB/s, the GPU as {a['kind_source']}; at least {MIN_STEP_S * 1000:g} ms); "
            "a rough guess: set plan.generate_tokens_per_s to your server's (a finished trace shard's rate replaces it)"]


def validation_lines(v: dict | None) -> list[str]:
    """Validation's server starts and tokens, its time where plan.decode_tokens_per_s is set, and the curve's starts."""
    if not v:
        return []
    what = (f"{v['starts']} server starts x {v['tokens_per_start']:,} tokens one request at a time "
            f"(at most validate.max_tokens {v['max_tokens']:,} an answer)")
    if v["seconds"]:
        lines = [f"  validation time: about {human_seconds(v['seconds'])}: {what}, each start "
                 f"{human_seconds(v['per_start_s'])} at plan.decode_tokens_per_s {v['rate']:g}"]
    elif v["unknown_sets"]:
        lines = [f"  validation time: unknown (the size of {', '.join(v['unknown_sets'])}: set its limit "
                 f"or validate.matrix_prompts); {what.replace(' x ', ' x at least ')}"]
    else:
        lines = [f"  validation time: {what}; set plan.decode_tokens_per_s for the hours"]
    if v["curve_points"]:
        each = f", about {human_seconds(v['per_point_s'])} each" if v["per_point_s"] else ""
        lines.append(f"  learning curve: {v['curve_points']} more server start(s) (train.snapshots, rule curve_point: "
                     f"the held-out set once at validate.concurrency){each}")
    return lines


def stage_lines(p: Plan) -> list[str]:
    """Each stage's time and GPU-hours, then the total."""
    lines = []
    for stage, st in p.stages.items():
        if st.seconds is None:
            lines.append(f"  time, {stage}: not estimated ({gpus_text(st.gpus)}): {st.how}")
            continue
        wall = f" (adds {human_seconds(st.wall_s)} to the wall time)" if st.overlap_s else ""
        lines.append(f"  time, {stage}: about {human_seconds(st.seconds)}{wall}, {gpu_hours(st):,.1f} GPU-hours "
                     f"({gpus_text(st.gpus)}): {st.how}")
    return lines + ([total_line(p)] if p.stages else [])


def gpu_hours(st: Stage) -> float:
    return st.seconds * st.gpus / 3600


def total_line(p: Plan) -> str:
    """The run's wall time and GPU-hours (every stage's, stream mode's extraction counted while training runs)
    and its peak disk: the target's weights, the traces and the hidden states at their largest."""
    unknown = [stage for stage, st in p.stages.items() if st.seconds is None]
    if unknown:
        time = f"wall time and GPU-hours not estimated (no time for {', '.join(unknown)})"
    else:
        overlap = ", extraction during training" if any(st.overlap_s for st in p.stages.values()) else ""
        time = (f"about {human_seconds(sum(st.wall_s for st in p.stages.values()))} wall time, "
                f"{sum(gpu_hours(st) for st in p.stages.values()):,.1f} GPU-hours (upper bounds on the tokens; the stages "
                f"one after another{overlap})")
    parts = disk_parts(p)
    peak = sum(b for _, b, _ in parts if b is not None)
    bound = "about" if all(b is not None for _, b, _ in parts) else "at least"
    what = ", ".join(f"{name} {human_bytes(b) if b is not None else 'unknown'} ({how})" for name, b, how in parts)
    return f"  total: {time}; peak disk {bound} {human_bytes(peak)}: {what}; free here: {human_bytes(p.free_bytes)}"


def disk_parts(p: Plan) -> list[tuple[str, int | None, str]]:
    """What the run holds on disk at its peak, during training: (name, bytes or None, whence)."""
    traces = p.state_tokens * TRACE_BYTES_PER_TOKEN if p.state_tokens is not None else None
    hidden = ((p.files_bytes, "files mode's shards") if p.mode == "files" else
              (p.stream_bytes, "stream mode: hidden.stream.max_disk_gb"))
    return [("the target's weights", p.weights_bytes, p.weights_source),
            ("traces", traces, f"about {TRACE_BYTES_PER_TOKEN} B a token" if traces is not None else "the prompts are unknown"),
            ("hidden states", *hidden)]
