"""What the Snakefile does while it is parsed (rules/common.smk calls these): read the config once, point a GGUF
target at its converted directory, and, before any job (dry-runs too), log the plan and refuse a config the checks
fail. The rest of the workflow reads the stages' settings (eaglenest.settings) built from the config this leaves.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from .checks import review_config
from .config import ConfigError, resolve_shipped_paths, validate_config, write_resolved_config
from .gguf import converted_dir, is_gguf
from .plan import format_plan, make_plan

RESOLVED_CONFIG = "logs/config.resolved.yaml"
# The keys that name the target: a GGUF file there is served and read as its converted directory.
TARGET_KEYS = (("server", "model"), ("hidden", "target"))


def job_environment(basedir: str) -> None:
    """Rule scripts (and the processes they start: watchdogs, torchrun) import the eaglenest package from the
    workflow's checkout, also inside conda environments (PYTHONPATH; nothing asked of the caller's environment,
    so no `envvars:` to declare). EAGLENEST_WORKFLOW_PID: the process that owns the local server, whose watchdog
    stops the server when it dies; kept where set, so a job that re-reads the Snakefile keeps the main process's."""
    os.environ.update(PYTHONPATH=os.pathsep.join(p for p in (basedir, os.environ.get("PYTHONPATH")) if p))
    os.environ.setdefault("EAGLENEST_WORKFLOW_PID", str(os.getpid()))


def read_config(config: dict, sources: list[str], basedir: str, *, main: bool, log: Callable[[str], None]) -> None:
    """Validate ``config`` in place (schema defaults filled in); a relative path is the working directory's, one
    found only in the workflow's own directory (toy/..., the files the embedded default names) that file. The main
    process (``main``) writes what the run uses to RESOLVED_CONFIG, dry-runs included, and logs whence."""
    config.update(validate_config(config, source=f"the workflow config ({', '.join(sources)}, --config)"))
    shipped = resolve_shipped_paths(config, ".", basedir)
    if main:  # not in the jobs Snakemake re-runs the Snakefile for (SLURM, --sdm conda)
        write_resolved_config(config, RESOLVED_CONFIG, sources, notes=shipped)
        log(f"config from {' + '.join(sources)} + schema defaults; resolved in {RESOLVED_CONFIG}")
        for note in shipped:
            log(note)


def convert_gguf_targets(config: dict) -> dict[str, str]:
    """Where server.model (or hidden.target) is a GGUF file, point it at the Hugging Face directory rule
    convert_target writes under models/, which everything that serves or reads the target uses; ``{directory:
    GGUF file}``."""
    sources = {}
    for section, key in TARGET_KEYS:
        if is_gguf(config[section][key]):
            sources[converted_dir(config[section][key])] = config[section][key]
            config[section][key] = converted_dir(config[section][key])
    return sources


def facts_config(config: dict, gguf_sources: dict[str, str]) -> dict:
    """The config the checks and the plan read the target's facts through: a GGUF target's file (its metadata)
    until rule convert_target has written the directory's config.json."""
    view = {**config, "server": dict(config["server"]), "hidden": dict(config["hidden"])}
    for section, key in TARGET_KEYS:
        d = view[section][key]
        if d in gguf_sources and not os.path.isfile(os.path.join(d, "config.json")):
            view[section][key] = gguf_sources[d]
    return view


def preflight(config: dict, gguf_sources: dict[str, str], sources: list[str], *, has_gpu: bool,
              executor: str | None, validate_minutes: int | None, log: Callable[[str], None]) -> None:
    """Before any job: log what the run will cost (eaglenest.plan) and run every check of the config against the
    target, the disk, the GPUs, the cluster and the profile (eaglenest.checks), all of them; ConfigError with every
    failure at once."""
    facts = facts_config(config, gguf_sources)
    plan = make_plan(facts, has_gpu=has_gpu)
    review = review_config(facts, plan, has_gpu=has_gpu, executor=executor, validate_minutes=validate_minutes,
                           sources=sources)
    plan.skipped = review.skipped
    log(format_plan(plan))
    for note in review.notes:
        log(note)
    if review.errors:
        where = f"the workflow config ({', '.join(sources)}, --config)"
        raise ConfigError(f"{where}: {review.errors[0]}" if len(review.errors) == 1 else
                          f"{where}: {len(review.errors)} settings to fix before any job:\n" +
                          "\n".join(f"  - {e}" for e in review.errors))


def profile_runtime_minutes(workflow, rule: str) -> int | None:
    """The runtime (minutes) the profile's set-resources gives ``rule`` (e.g. profiles/slurm: validate_draft
    8h), else None: what a SLURM job of that rule may take."""
    from snakemake.exceptions import WorkflowError
    from snakemake.resources import Resource

    value = (workflow.resource_settings.overwrite_resources.get(rule) or {}).get("runtime")
    value = getattr(value, "value", value)
    try:
        return int(Resource.parse_human_friendly("runtime", value)) if value is not None else None
    except (WorkflowError, TypeError, ValueError):
        return None


def cluster_executor() -> str | None:
    """The executor the jobs go to where it is not this machine (the SLURM profile's slurm), else None; dry-runs
    included. Snakemake parses the Snakefile before it hands the run its executor, and -n swaps in a dryrun one:
    the executor the command line and its profiles name is the args of snakemake's CLI (cli.args_to_api). Called
    through Snakemake's Python API instead, nothing names it here: None."""
    from snakemake_interface_executor_plugins.registry import ExecutorPluginRegistry

    frame = sys._getframe()
    while frame and not (frame.f_code.co_name == "args_to_api" and hasattr(frame.f_locals.get("args"), "executor")):
        frame = frame.f_back
    name = frame.f_locals["args"].executor if frame else None
    if not isinstance(name, str) or name in ("local", "dryrun", "touch"):
        return None
    return None if ExecutorPluginRegistry().get_plugin(name).common_settings.local_exec else name


def config_sources(configfiles) -> list[str]:
    """What the config was read from: the --configfile files, else the embedded default (see the Snakefile)."""
    return [str(f) for f in configfiles] or ["config.yaml"]
