"""What a run will cost, from the config and the dataset's size alone, before any job runs.

`make_plan` computes the figures (prompts, the answers each costs: a conversation of N turns costs N
requests and their tokens; the upper bound on tokens, the hidden states' disk in
`files` mode against `stream` mode's budget, the GPUs each stage holds and the servers' replicas, each
stage's time and GPU-hours, and the run's total: wall time, GPU-hours and peak disk with the target's own
weights); generation's time comes from the measured rate once trace shards have finished, else from
plan.generate_tokens_per_s, else from a rate assumed from the GPU kind and the weights' size, said so;
`format_plan` writes them as the lines the workflow logs at every start (dry-runs included) and
`python -m eaglenest.plan` (`make plan`) prints. Nothing here downloads anything or starts a job.

The settings it reads are each stage's (``RunSettings``, built once from the config); the figures are
`figures`', the stages' times `times`', what it knows of the target `target`'s and the text `text`'s.
"""

from .figures import Plan, answers_fingerprint, make_plan, validation_refusal
from .run import RunSettings, gpus_text, server_gpus, stage_gpus
from .target import target_hidden_size, target_weights
from .text import format_plan, human_bytes, human_seconds
from .times import StageTime

__all__ = ["Plan", "RunSettings", "StageTime", "answers_fingerprint", "format_plan", "gpus_text", "human_bytes",
           "human_seconds", "make_plan", "server_gpus", "stage_gpus", "target_hidden_size", "target_weights",
           "validation_refusal"]
