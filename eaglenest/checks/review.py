"""Every check of a config, all of them run (``review_config``), and the one error of their failures
(``check_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..plan import RunSettings, validation_refusal
from .gpus import check_gpus
from .settings_checks import (check_columns, check_datasets, check_drafts, check_local_server, check_logits_room,
                              check_slurm_time, check_stream_disk, check_stream_mode, check_ttt)
from .target import check_target


@dataclass
class Review:
    """What the checks of a config found: the failures (one line each, key, value, limit and fix), the checks
    that could not run here (one line each, why), and lines for the log of checks that passed."""

    errors: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def add(self, *failures) -> None:
        self.errors += [f for f in failures if f]


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
