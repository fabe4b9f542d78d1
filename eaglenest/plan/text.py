"""The plan as the lines the workflow logs at every start (``format_plan``): the figures, each stage's time and
GPU-hours, and the run's total."""

from __future__ import annotations

from ..states.preflight import bytes_per_token
from .figures import Plan, StageTime, human_bytes, human_seconds
from .run import gpus_text
from .target import GPU_BANDWIDTH_TBS, MIN_STEP_S, STEP_PER_WEIGHT_READ

# A trace on disk, a token: its id in JSON (up to 7 B with the comma) and its text (about 4 B).
TRACE_BYTES_PER_TOKEN = 12


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


def gpu_hours(st: StageTime) -> float:
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
