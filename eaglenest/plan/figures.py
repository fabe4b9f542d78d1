"""The plan's figures (``Plan``, which ``make_plan`` fills): the prompts and the answers each costs, the measured
trace rate, validation's time, and the units the plan writes them in."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..validation.matrix import matrix_temperatures
from ..data.prompts import same_prompts
from .run import RunSettings
from .target import dataset_rows

# files mode needs more than this, or more than the free disk: the plan suggests stream mode.
SUGGEST_STREAM_BYTES = 10**12


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return ""


def human_seconds(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


class StageTime(NamedTuple):
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
    stages: dict = field(default_factory=dict)  # stage_hours: stage -> StageTime
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


def training_prompts(run: RunSettings, workdir: Path) -> tuple[int | None, str]:
    """How many prompts the traces answer: data/prompts/stats.json once prepare_prompts has run, else
    the local dataset's rows less the held-out ones (capped by dataset.limit), else dataset.limit."""
    stats, other = workdir / "data" / "prompts" / "stats.json", ""
    if stats.is_file():
        made = json.loads(stats.read_text())
        if same_prompts(made, run.prompts):
            return made["train"], str(stats)
        other = f"; {stats} is another dataset's or setting's, not used"
    n, source = _expected_prompts(run)
    return n, source + other


def _expected_prompts(run: RunSettings) -> tuple[int | None, str]:
    d = run.prompts
    if run.questions.questions:
        n = max(0, run.questions.questions - d.heldout)
        return (min(n, d.limit) if d.limit else n), "dataset.generate.questions less the held-out, at most"
    rows = dataset_rows(d.path)
    if rows is not None:
        n = max(0, rows - d.heldout)
        return (min(n, d.limit) if d.limit else n), f"{d.path}: {rows} rows, at most"
    if d.limit:
        return d.limit, "dataset.limit, at most"
    return None, f"{d.path} (a hub dataset without dataset.limit: its size is not known before it is read)"


def validation_time(run: RunSettings) -> dict:
    """Validation's time, from the config: every validation run (the target alone, EAGLE-3 in each export
    format, n-gram) is one server start that sends the held-out set one request at a time (the headline), then
    the matrix's other cells one request at a time (validate.matrix_prompts of each set at each temperature),
    and the held-out set again at validate.concurrency. Upper bound: every answer runs to validate.max_tokens.
    ``seconds`` is None without plan.decode_tokens_per_s or where a set's size is unknown."""
    p, heldout, evalsets = run.plan, run.prompts.heldout, run.questions.evalsets
    max_tokens = p.validate_max_tokens or run.generation.max_tokens
    starts = 2 + (2 if run.export.format == "both" else 1)
    sizes = [heldout] + [s.get("limit") or dataset_rows(s["path"]) for s in evalsets]
    mp, one_at_a_time, unknown = p.matrix_prompts, heldout, []
    for i, n in enumerate(sizes):
        for t in matrix_temperatures(p.temperatures, run.generation.temperature):
            if i == 0 and t == 0:
                continue  # the headline, counted above
            cell = min(n, mp) if n is not None and mp else n if n is not None else mp
            if cell is None:
                unknown.append(evalsets[i - 1]["name"])
            else:
                one_at_a_time += cell
    tokens = one_at_a_time * max_tokens
    rate = p.decode_tokens_per_s
    per_start = None
    # the held-out set at validate.concurrency: at best concurrency x faster
    concurrent = heldout * max_tokens / (rate * max(1, p.validate_concurrency)) if rate else None
    if rate and not unknown:
        per_start = p.server_start_s + tokens / rate + concurrent
    # The learning curve: each draft kept along training (train.snapshots) is one more start (rule curve_point)
    # that sends the held-out set once at validate.concurrency.
    points = run.train.snapshots
    per_point = (p.server_start_s + concurrent) if rate else None
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


def answers_fingerprints(run: RunSettings) -> tuple[str, str]:
    """The fingerprints trace shards of this config carry (its served model and answer settings): a shard of
    single questions', and a shard of conversations', whose key adds the conversation limits (data.traces.answers_key)."""
    from ..data.traces import answers_key

    return answers_key(run.generation), answers_key(run.generation, conversations=True)


def measured_rate(workdir: Path, prompts: int | None, fingerprints: tuple[str, ...] | None = None) -> dict | None:
    """From the finished trace shards' stats: records done, their answers (a conversation's turns each), requests
    per second over their runs, and the seconds the rest would take at that rate, each record costing as many
    requests as the done ones did on average. None before any shard has stats. ``fingerprints``: only shards
    answered by this target with these answer settings count (``answers_fingerprints``)."""
    done = answers = answered = 0
    wall = 0.0
    for f in sorted((workdir / "traces").glob("shard_*.stats.json")):
        s = json.loads(f.read_text())
        if fingerprints is not None and s.get("fingerprint") not in fingerprints:
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


def answers_per_prompt(run: RunSettings, measured: dict | None) -> tuple[float, str]:
    """The answers (requests to the trace server) one training prompt costs, and whence: a conversation of N
    turns costs N. With dataset.max_turns 1, one; once trace shards have finished, their mean; with questions
    the target writes, at most dataset.generate.turns; else at most dataset.max_turns."""
    max_turns = run.prompts.max_turns
    if max_turns == 1:
        return 1, "dataset.max_turns 1"
    if measured:
        return measured["answers_per_record"], "the mean of the finished trace shards"
    q = run.questions
    if q.questions:
        return min(max_turns, q.turns), f"dataset.generate.turns {q.turns}, dataset.max_turns {max_turns}: at most"
    return max_turns, "dataset.max_turns: at most"
