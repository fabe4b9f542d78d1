"""Each stage's time and the GPUs it holds meanwhile (``stage_hours``), and what each stage holds in words
(``stage_plan``), from the plan's figures and the stated, measured or assumed rates."""

from __future__ import annotations

from .figures import Plan, StageTime
from .run import RunSettings, gpus_text, server_gpus, stage_gpus


def stage_hours(run: RunSettings, plan: Plan, has_gpu: bool) -> dict:
    """``{stage: StageTime}``: each stage's time (an upper bound: every answer runs to generation.max_tokens, every
    sequence to the plan's longest) from the measured trace rate or the stated or assumed rates, and the GPUs it
    holds meanwhile, for its GPU-hours."""
    training = training_stage(run, plan, has_gpu)
    return {"generation": generation_stage(run, plan, has_gpu), "extraction": extraction_stage(run, plan, has_gpu, training),
            "training": training, "validation": validation_stage(run, plan, has_gpu)}


def generation_stage(run: RunSettings, plan: Plan, has_gpu: bool) -> StageTime:
    """The trace servers (every replica) from their start until the last answer: the rest at the measured rate,
    else every prompt at plan.generate_tokens_per_s, else at the assumed rate (plan.assumed)."""
    p, s = run.plan, run.server
    held = s.replicas * server_gpus(run) if s.mode != "external" else 0
    if plan.measured:
        return StageTime(plan.measured["remaining_s"], held, "the rest, at the measured trace rate")
    if p.generate_tokens_per_s:
        rate, how = p.generate_tokens_per_s, f"plan.generate_tokens_per_s {p.generate_tokens_per_s:g}"
    elif plan.assumed:
        rate, how = plan.assumed["rate"], f"the assumed {plan.assumed['rate']:,.0f} tokens/s"
    else:
        return StageTime(None, held, f"set plan.generate_tokens_per_s ({no_assumed_rate(run, plan, has_gpu)}), or "
                         "wait for a finished trace shard")
    if plan.generated_tokens is None:
        return StageTime(None, held, "the prompts are unknown: set dataset.limit")
    return StageTime(p.server_start_s + plan.generated_tokens / (rate * s.replicas), held,
                     f"{plan.generated_tokens:,} tokens at {how} a replica x {s.replicas}, after one start")


def no_assumed_rate(run: RunSettings, plan: Plan, has_gpu: bool) -> str:
    """Why the plan assumes no generation rate (assumed_generation gave none), in words."""
    if plan.weights_bytes is None:
        return "or plan.weights_gb for an assumed one"
    if run.server.mode == "external":
        return "no rate is assumed for external servers"
    if run.server.mode == "slurm":
        return "no rate is assumed for vLLM on a CPU (server.slurm.gpus 0)"
    return "no rate is assumed for vLLM on this machine's CPU"


def training_stage(run: RunSettings, plan: Plan, has_gpu: bool) -> StageTime:
    """train_draft: every epoch's tokens at plan.train_tokens_per_s a process; in stream mode no faster than the
    one extraction server computes them (plan.extract_tokens_per_s, where set)."""
    p, t = run.plan, run.train
    gpus = stage_gpus(run, "train", has_gpu)
    if not (p.train_tokens_per_s and plan.state_tokens):
        return StageTime(None, gpus, "set plan.train_tokens_per_s")
    tokens, procs = plan.state_tokens * t.epochs, t.nproc or max(1, gpus)  # one process a GPU
    seconds = tokens / (p.train_tokens_per_s * procs)
    how = f"{t.epochs:g} epoch(s) at plan.train_tokens_per_s {p.train_tokens_per_s:g} a process x {procs}"
    extract = p.extract_tokens_per_s
    if run.hidden.mode == "stream" and extract and tokens / extract > seconds:
        seconds, how = tokens / extract, how + f", held back to the extraction server's plan.extract_tokens_per_s {extract:g}"
    return StageTime(seconds, gpus, how + (" (train.max_steps may stop it sooner)" if t.max_steps else ""))


def extraction_stage(run: RunSettings, plan: Plan, has_gpu: bool, training: StageTime) -> StageTime:
    """Files mode: every state token at plan.extract_tokens_per_s a server (each replica, vLLM backend), after one
    start. Stream mode: one extraction server, held from its start until training ends; only its start adds to
    the wall time."""
    p, h, s = run.plan, run.hidden, run.server
    if h.mode == "stream":
        held = None if training.seconds is None else p.server_start_s + training.seconds
        return StageTime(held, server_gpus(run), "hidden.mode stream: one extraction server, its start and then "
                         "held while training runs", overlap_s=training.seconds or 0.0)
    servers = s.replicas if h.backend == "vllm" else 1
    gpus = servers * server_gpus(run) if h.backend == "vllm" else stage_gpus(run, "hidden", has_gpu)
    rate = p.extract_tokens_per_s
    if not (rate and plan.state_tokens):
        return StageTime(None, gpus, "set plan.extract_tokens_per_s")
    return StageTime(p.server_start_s + plan.state_tokens / (rate * servers), gpus,
                     f"plan.extract_tokens_per_s {rate:g} a server x {servers}, after one start")


def validation_stage(run: RunSettings, plan: Plan, has_gpu: bool) -> StageTime:
    """validate_draft and the learning curve's starts (validation_time), on validate.gpus."""
    v, gpus = plan.validation, stage_gpus(run, "validate", has_gpu)
    curve = v["per_point_s"] * v["curve_points"] if v and v.get("per_point_s") is not None else None
    seconds = v["seconds"] + (curve or 0) if v and v["seconds"] else None
    return StageTime(seconds, gpus, "the validation time and the learning curve's starts above" if seconds
                     else "set plan.decode_tokens_per_s")


def stage_plan(run: RunSettings, has_gpu: bool) -> dict:
    """What each stage holds, in words: servers (replicas x GPUs, SLURM jobs) and the rules' GPUs."""
    s, h = run.server, run.hidden

    def servers(what, n):
        per = server_gpus(run)
        if s.mode == "external":
            return f"{len(s.urls)} external {what}(s) at server.urls, none started here"
        where = "SLURM job" if s.mode == "slurm" else "local " + what
        cpu = "" if has_gpu or s.mode == "slurm" else " (no GPU on this machine: vLLM runs on its CPU)"
        return f"{n} {where}(s) x {gpus_text(per)} = {gpus_text(n * per)}{cpu}"

    if h.backend != "vllm":
        extraction = f"{gpus_text(stage_gpus(run, 'hidden', has_gpu))} per extract_hidden job (transformers)"
    elif h.mode == "stream":  # states/extract.py: stream mode reads from one server, whatever server.replicas
        extraction = servers("extraction server", 1) + ", while train_draft runs (hidden.mode stream: one server)"
    else:
        extraction = servers("extraction server", s.replicas)
    return {"generate_traces": servers("server", s.replicas), "extract_hidden": extraction,
            "train_draft": gpus_text(stage_gpus(run, 'train', has_gpu)),
            "validate_draft": f"{gpus_text(stage_gpus(run, 'validate', has_gpu))} (one server at a time)"}
