"""Checks of a resolved config against the target, the disk, the GPUs and the cluster, before any job runs.

`review_config` runs every check, whatever fails, so all failures are reported together; the workflow calls it
at parse time (`snakemake -n` too) and `python -m eaglenest.checks` through `check_config`. Each failure is one
line naming the key, its value, the limit and what to do. A check that needs what is not here (the target's
config.json, where neither a local directory, the Hugging Face cache nor the hub gives it; sinfo, off a
cluster; nvidia-smi) is skipped, and the plan says so in one line.

The checks of the target are `target`'s, of the GPUs `gpus`', of the settings among themselves and the working
directory `settings_checks`'; each reads the stages' settings (eaglenest.plan.RunSettings).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..plan import RunSettings, validation_refusal
from .gpus import check_gpus
from .review import Review
from .settings_checks import (check_columns, check_datasets, check_drafts, check_local_server, check_logits_room,
                              check_slurm_time, check_stream_disk, check_stream_mode, check_ttt)
from .target import check_target, fetch_config

__all__ = ["Review", "check_config", "fetch_config", "review_config"]


def review_config(config: dict, plan, workdir: str | Path = ".", *, has_gpu: bool = False, executor: str | None = None,
                  validate_minutes: int | None = None, sources=()) -> Review:
    """Every check of a resolved config, all of them run, whatever fails. ``plan``: eaglenest.plan's Plan of this
    config (its figures and disk verdict). What Snakemake knows and the library does not: ``has_gpu`` (nvidia-smi
    here), ``executor`` (the cluster executor's name; None where jobs run here), ``validate_minutes`` (the
    profile's runtime of validate_draft) and ``sources`` (the config files)."""
    run, workdir, review = RunSettings.from_config(config), Path(workdir), Review()
    check_target(run, workdir, review)
    review.add(*check_datasets(run, workdir))
    review.add(*check_drafts(run, workdir))
    found, notes = check_columns(run, workdir)
    review.add(*found)
    review.skipped += notes
    if plan.mode == "files" and plan.files_bytes is None:
        review.skipped.append("files mode's disk not checked: the target's hidden size is unknown (set plan.hidden_size)")
    review.add(plan.disk_refusal(), *check_stream_mode(run), *check_stream_disk(run, plan, workdir), check_ttt(run),
               check_slurm_time(run), validation_refusal(plan, validate_minutes),
               check_local_server(run, executor, sources))
    if run.hidden.backend == "vllm":
        failure, note = check_logits_room(run)
        review.add(failure)
        (review.skipped if " not checked" in note else review.notes).extend([note] if note else [])
    check_gpus(run, has_gpu, review)
    return review


def check_config(config: dict, plan, workdir: str | Path = ".", **facts) -> list[str]:
    """``review_config``: raise ConfigError with one line per failure, else return the notes of the checks skipped
    (the plan prints them)."""
    review = review_config(config, plan, workdir, **facts)
    if review.errors:
        raise ConfigError("\n".join(review.errors))
    return review.skipped
