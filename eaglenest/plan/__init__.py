"""What a run will cost, from the config and the dataset's size alone, before any job runs.

`make_plan` computes the figures (prompts, the answers each costs: a conversation of N turns costs N
requests and their tokens; the upper bound on tokens, the hidden states' disk in
`files` mode against `stream` mode's budget, the GPUs each stage holds and the servers' replicas, each
stage's time and GPU-hours, and the run's total: wall time, GPU-hours and peak disk with the target's own
weights); generation's time comes from the measured rate once trace shards have finished, else from
plan.generate_tokens_per_s, else from a rate assumed from the GPU kind and the weights' size, said so;
`format_plan` writes them as the lines the workflow logs at every start (dry-runs included) and
`python -m eaglenest.checks` (`make plan`) prints. Nothing here downloads anything or starts a job.

The settings it reads are each stage's (``RunSettings``, built once from the config); the figures are
`figures`', the stages' times `times`', what it knows of the target `target`'s and the text `text`'s.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from ..states.preflight import bytes_per_token
from .figures import (Plan, StageTime, answers_fingerprints, answers_per_prompt, human_bytes, human_seconds,
                      measured_rate, training_prompts, validation_refusal, validation_time)
from .run import RunSettings, server_gpus, stage_gpus
from .target import assumed_generation, target_hidden_size, target_weights
from .text import format_plan
from .times import stage_hours, stage_plan

__all__ = ["Plan", "RunSettings", "StageTime", "answers_fingerprints", "format_plan", "human_bytes",
           "human_seconds", "make_plan", "server_gpus", "stage_gpus", "target_hidden_size", "target_weights",
           "validation_refusal"]


def make_plan(config: dict, workdir: str | Path = ".", has_gpu: bool | None = None) -> Plan:
    """The plan of a resolved config (schema defaults filled in) in working directory ``workdir``: its settings are
    read once, as each stage's (RunSettings)."""
    run, workdir = RunSettings.from_config(config), Path(workdir)
    has_gpu = bool(shutil.which("nvidia-smi")) if has_gpu is None else has_gpu
    s, g, h = run.server, run.generation, run.hidden
    prompts, source = training_prompts(run, workdir)
    measured = measured_rate(workdir, prompts, answers_fingerprints(run))
    turns, turns_source = answers_per_prompt(run, measured)
    # a conversation's sequence grows turn by turn: each turn's prompt and answer at most
    per_turn = run.prompts.max_prompt_chars + g.max_tokens
    limits = [h.max_length, s.max_model_len, run.generation.max_context_tokens,
              per_turn * max(1, math.ceil(turns))]
    seq = min(x for x in limits if x)
    hidden_size, hsource = target_hidden_size(run)
    # each answer's chain its own sequence at most (a template that re-renders earlier answers otherwise)
    requests = math.ceil(prompts * turns) if prompts is not None else None
    state_tokens = requests * seq if requests is not None else None
    free = shutil.disk_usage(workdir if workdir.exists() else ".").free
    plan = Plan(prompts=prompts, prompts_source=source, max_tokens=g.max_tokens, turns=turns, turns_source=turns_source,
                requests=requests, sequence_tokens=seq,
                generated_tokens=requests * g.max_tokens if requests is not None else None,
                state_tokens=state_tokens, hidden_size=hidden_size, hidden_size_source=hsource,
                files_bytes=state_tokens * bytes_per_token(hidden_size) if state_tokens and hidden_size else None,
                stream_bytes=int(h.max_disk_gb * 1e9), free_bytes=free, mode=h.mode,
                replicas=s.replicas, server_mode=s.mode, measured=measured, validation=validation_time(run))
    plan.weights_bytes, plan.weights_source = target_weights(run)
    plan.assumed = assumed_generation(run, plan.weights_bytes, has_gpu)
    plan.gpus = stage_plan(run, has_gpu)
    plan.stages = stage_hours(run, plan, has_gpu)
    return plan
