"""The settings of every stage the plan and the checks read (``RunSettings``), built once from the validated
config, and the GPUs a server and each stage's job hold."""

from __future__ import annotations

from dataclasses import dataclass

from ..serving.settings import ServerConfig, SlurmSettings
from ..serving.slurm_jobs import server_job_gpus
from ..settings import (DraftSettings, ExportSettings, GenerationSettings, HiddenSettings, PlanSettings, PromptSettings,
                        QuestionSettings, TrainSettings, ValidateSettings)


@dataclass(frozen=True)
class RunSettings:
    """Each stage's settings of one config: what the plan and the checks read, typed, to the bottom."""

    server: ServerConfig
    slurm: SlurmSettings
    prompts: PromptSettings
    questions: QuestionSettings
    generation: GenerationSettings
    hidden: HiddenSettings
    draft: DraftSettings
    train: TrainSettings
    validate: ValidateSettings
    export: ExportSettings
    plan: PlanSettings

    @classmethod
    def from_config(cls, config: dict) -> "RunSettings":
        """Every stage's settings from a validated config (schema defaults filled in)."""
        return cls(server=ServerConfig.from_config(config), slurm=SlurmSettings.from_config(config),
                   prompts=PromptSettings.from_config(config), questions=QuestionSettings.from_config(config),
                   generation=GenerationSettings.from_config(config), hidden=HiddenSettings.from_config(config),
                   draft=DraftSettings.from_config(config), train=TrainSettings.from_config(config),
                   validate=ValidateSettings.from_config(config), export=ExportSettings.from_config(config),
                   plan=PlanSettings.from_config(config))


def gpus_text(n: int) -> str:
    """``n`` GPU(s) in words: "1 GPU", "8 GPUs"."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def server_gpus(run: RunSettings) -> int:
    """GPUs of one server (one replica): under SLURM its job's (serving.slurm_jobs.server_job_gpus); elsewhere
    tensor_parallel_size."""
    if run.server.mode == "slurm":
        return server_job_gpus(run.server, run.slurm)
    return run.server.tensor_parallel_size


def stage_gpus(run: RunSettings, section: str, has_gpu: bool) -> int:
    """GPUs of one job of a config section (hidden, train, validate): `<section>.gpus` when set.
    Unset, under server.mode slurm they follow the server job's GPUs (server.slurm.gpus, else
    tensor_parallel_size), never the submitting node, a login node without GPUs; elsewhere the GPUs of
    this machine. Validation starts the target's servers, so it takes the server's count; the others one."""
    n = section_gpus(run)[section]
    if n is not None:
        return n
    server = server_gpus(run) if run.server.mode == "slurm" else (run.server.tensor_parallel_size if has_gpu else 0)
    return server if section == "validate" else min(1, server)


def section_gpus(run: RunSettings) -> dict:
    """``{section: its gpus key}`` (None: unset) of the sections whose jobs hold GPUs."""
    return {"hidden": run.hidden.gpus, "train": run.train.gpus, "validate": run.plan.validate_gpus}
