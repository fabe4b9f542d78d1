"""What a run will cost, from the config and the dataset's size alone, before any job runs.

`make_plan` computes the figures (prompts, the upper bound on tokens, the hidden states' disk in
`files` mode against `stream` mode's budget, the GPUs each stage holds and the servers' replicas,
and, once trace shards have finished, the projected generation time from their measured rate);
`format_plan` writes them as the lines the workflow logs at every start (dry-runs included) and
`python -m eaglenest.plan` (`make plan`) prints. Nothing here downloads anything or starts a job.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .config import matrix_temperatures
from .data.prompts import same_prompts
from .gguf import is_gguf
from .serving.settings import ServerConfig
from .serving.slurm import SlurmSettings
from .serving.slurm import server_gpus as slurm_server_gpus
from .states.preflight import bytes_per_token, target_config

# files mode needs more than this, or more than the free disk: the plan suggests stream mode.
SUGGEST_STREAM_BYTES = 10**12


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


@dataclass
class Plan:
    prompts: int | None          # training prompts (None: unknown, a hub dataset without limit)
    prompts_source: str
    max_tokens: int
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
    stages: dict = field(default_factory=dict)  # stage_hours: stage -> (seconds or None, GPUs, how)
    skipped: list = field(default_factory=list)  # checks.check_config's notes: checks it could not run

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
    from .data.traces import fingerprint

    return fingerprint(ServerConfig.from_dict(config["server"]).model_id, config["generation"])


def measured_rate(workdir: Path, prompts: int | None, fingerprint: str | None = None) -> dict | None:
    """From the finished trace shards' stats: records done, requests per second over their runs, and
    the seconds the rest would take at that rate. None before any shard has stats. ``fingerprint``: only
    shards answered by this target with these answer settings count (eaglenest.data.traces.fingerprint)."""
    done = answered = 0
    wall = 0.0
    for f in sorted((workdir / "traces").glob("shard_*.stats.json")):
        s = json.loads(f.read_text())
        if fingerprint is not None and s.get("fingerprint") != fingerprint:
            continue  # another target's or another setting's traces: their rate says nothing of this run
        done += s.get("records", 0)
        answered += s.get("completed", 0)
        wall += s.get("wall_s") or 0.0
    if not answered or wall <= 0:
        return None
    rate = answered / wall
    remaining = max(0, (prompts or done) - done)
    return {"done": done, "rate": rate, "remaining_s": remaining / rate}


def make_plan(config: dict, workdir: str | Path = ".", has_gpu: bool | None = None) -> Plan:
    """The plan of a resolved config (schema defaults filled in) in working directory ``workdir``."""
    workdir = Path(workdir)
    has_gpu = bool(shutil.which("nvidia-smi")) if has_gpu is None else has_gpu
    s, g, h = config["server"], config["generation"], config["hidden"]
    prompts, source = training_prompts(config, workdir)
    limits = [h["max_length"], s["max_model_len"], config["dataset"]["max_prompt_chars"] + g["max_tokens"]]
    seq = min(x for x in limits if x)
    hidden_size, hsource = target_hidden_size(config)
    state_tokens = prompts * seq if prompts is not None else None
    free = shutil.disk_usage(workdir if workdir.exists() else ".").free
    plan = Plan(prompts=prompts, prompts_source=source, max_tokens=g["max_tokens"], sequence_tokens=seq,
                generated_tokens=prompts * g["max_tokens"] if prompts is not None else None,
                state_tokens=state_tokens, hidden_size=hidden_size, hidden_size_source=hsource,
                files_bytes=state_tokens * bytes_per_token(hidden_size) if state_tokens and hidden_size else None,
                stream_bytes=int(h["stream"]["max_disk_gb"] * 1e9), free_bytes=free, mode=h["mode"],
                replicas=s["replicas"], server_mode=s["mode"], measured=measured_rate(workdir, prompts, answers_fingerprint(config)),
                validation=validation_time(config))
    plan.gpus = stage_plan(config, has_gpu)
    plan.stages = stage_hours(config, plan, has_gpu)
    return plan


def stage_hours(config: dict, plan: Plan, has_gpu: bool) -> dict:
    """``{stage: (seconds or None, GPUs held, how)}``: each stage's time (an upper bound: every answer runs to
    generation.max_tokens, every sequence to the plan's longest) from the measured trace rate or the stated
    plan.*_tokens_per_s, and the GPUs it holds meanwhile, for its GPU-hours."""
    p, s = config["plan"], config["server"]
    replicas, per_server = s["replicas"], server_gpus(config)
    server_held = replicas * per_server if s["mode"] != "external" else 0
    out = {}
    if plan.measured:
        out["generation"] = (plan.measured["remaining_s"], server_held, "the rest, at the measured trace rate")
    elif p["generate_tokens_per_s"] and plan.generated_tokens:
        out["generation"] = (plan.generated_tokens / (p["generate_tokens_per_s"] * replicas), server_held,
                             f"plan.generate_tokens_per_s {p['generate_tokens_per_s']:g} a server")
    else:
        out["generation"] = (None, server_held, "set plan.generate_tokens_per_s, or wait for a finished trace shard")
    extract_gpus = server_held if config["hidden"]["backend"] == "vllm" else stage_gpus(config, "hidden", has_gpu)
    if p["extract_tokens_per_s"] and plan.state_tokens:
        out["extraction"] = (p["server_start_s"] + plan.state_tokens / p["extract_tokens_per_s"], extract_gpus,
                             f"plan.extract_tokens_per_s {p['extract_tokens_per_s']:g}")
    else:
        out["extraction"] = (None, extract_gpus, "set plan.extract_tokens_per_s")
    train_gpus = stage_gpus(config, "train", has_gpu)
    t = config["train"]
    if p["train_tokens_per_s"] and plan.state_tokens:
        tokens, procs = plan.state_tokens * t["epochs"], t["nproc"] or max(1, train_gpus)  # one process a GPU
        out["training"] = (tokens / (p["train_tokens_per_s"] * procs), train_gpus,
                           f"{t['epochs']:g} epoch(s) at plan.train_tokens_per_s {p['train_tokens_per_s']:g} a process "
                           f"x {procs}"
                           + (" (train.max_steps may stop it sooner)" if t["max_steps"] else ""))
    else:
        out["training"] = (None, train_gpus, "set plan.train_tokens_per_s")
    if config["hidden"]["mode"] == "stream":  # the extraction server serves training: held as long as it runs
        out["extraction"] = (out["training"][0], extract_gpus, "hidden.mode stream: the extraction server is held while "
                             "training runs (its time is training's)")
    v, validate_gpus = plan.validation, stage_gpus(config, "validate", has_gpu)
    curve = v["per_point_s"] * v["curve_points"] if v and v.get("per_point_s") is not None else None
    seconds = v["seconds"] + (curve or 0) if v and v["seconds"] else None
    out["validation"] = (seconds, validate_gpus, "the validation time and the learning curve's starts above"
                         if seconds else "set plan.decode_tokens_per_s")
    return out


def stage_plan(config: dict, has_gpu: bool) -> dict:
    """What each stage holds, in words: servers (replicas x GPUs, SLURM jobs) and the rules' GPUs."""
    s, h = config["server"], config["hidden"]

    def servers(what):
        per, n = server_gpus(config), s["replicas"]
        if s["mode"] == "external":
            return f"{len(s['urls'])} external {what}(s) at server.urls, none started here"
        where = "SLURM job" if s["mode"] == "slurm" else "local " + what
        cpu = "" if has_gpu or s["mode"] == "slurm" else " (no GPU on this machine: vLLM runs on its CPU)"
        return f"{n} {where}(s) x {gpus_text(per)} = {gpus_text(n * per)}{cpu}"

    extraction = (servers("extraction server") if h["backend"] == "vllm" else
                  f"{gpus_text(stage_gpus(config, 'hidden', has_gpu))} per extract_hidden job (transformers)")
    return {"generate_traces": servers("server"), "extract_hidden": extraction,
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
    if p.prompts is not None:
        lines.append(f"  tokens: at most {p.generated_tokens:,} generated ({n} x generation.max_tokens {p.max_tokens:,}); "
                     f"at most {p.state_tokens:,} in the hidden states ({p.sequence_tokens:,} a sequence)")
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
    if p.measured:
        m = p.measured
        lines.append(f"  generation so far: {m['done']:,} traces at {m['rate']:.2f} requests/s; the rest "
                     f"about {human_seconds(m['remaining_s'])} at that rate")
    else:
        lines.append("  generation time: projected once a trace shard has finished")
    v = p.validation
    if v:
        what = (f"{v['starts']} server starts x {v['tokens_per_start']:,} tokens one request at a time "
                f"(at most validate.max_tokens {v['max_tokens']:,} an answer)")
        if v["seconds"]:
            lines.append(f"  validation time: about {human_seconds(v['seconds'])}: {what}, each start "
                         f"{human_seconds(v['per_start_s'])} at plan.decode_tokens_per_s {v['rate']:g}")
        elif v["unknown_sets"]:
            lines.append(f"  validation time: unknown (the size of {', '.join(v['unknown_sets'])}: set its limit "
                         f"or validate.matrix_prompts); {what.replace(' x ', ' x at least ')}")
        else:
            lines.append(f"  validation time: {what}; set plan.decode_tokens_per_s for the hours")
        if v["curve_points"]:
            each = f", about {human_seconds(v['per_point_s'])} each" if v["per_point_s"] else ""
            lines.append(f"  learning curve: {v['curve_points']} more server start(s) (train.snapshots, rule curve_point: "
                         f"the held-out set once at validate.concurrency){each}")
    if p.stages:
        known = [(sec, gpus) for sec, gpus, _ in p.stages.values() if sec is not None]
        overlap = p.stages["extraction"][0] if p.mode == "stream" and p.stages["extraction"][0] else 0
        for stage, (sec, gpus, how) in p.stages.items():
            hours = f"about {human_seconds(sec)}, {sec * gpus / 3600:,.1f} GPU-hours ({gpus_text(gpus)})" if sec is not None \
                else f"not estimated ({gpus_text(gpus)})"
            lines.append(f"  time, {stage}: {hours}: {how}")
        if len(known) == len(p.stages):
            lines.append(f"  time, all stages: about {human_seconds(sum(s for s, _ in known) - overlap)}, "
                         f"{sum(s * g for s, g in known) / 3600:,.1f} GPU-hours (upper bounds; the stages run one after "
                         "another" + (", extraction during training)" if overlap else ")"))
    lines += [f"  skipped check: {note}" for note in p.skipped]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    import yaml

    from .config import validate_config

    p = argparse.ArgumentParser(prog="python -m eaglenest.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--configfile", default="config.yaml", help="the workflow config (default: config.yaml)")
    p.add_argument("--directory", "-d", default=".", help="the working directory (default: here)")
    args = p.parse_args(argv)
    from .checks import check_config
    from .errors import EaglenestError

    try:  # a config the user can fix: one line, no traceback
        config = validate_config(yaml.safe_load(Path(args.configfile).read_text()) or {}, source=args.configfile)
        plan = make_plan(config, args.directory)
        plan.skipped = check_config(config, plan, args.directory)
    except (EaglenestError, OSError) as e:
        sys.exit(f"{args.configfile}: {e}")
    print(format_plan(plan))


if __name__ == "__main__":
    main()
