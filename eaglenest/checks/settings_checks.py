"""The checks of the settings among themselves and against the working directory: the datasets and drafts named,
their columns, stream mode's placement and disk, the extraction server's memory, the draft tokens, the SLURM time
and where the servers run."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..data.datasets import columns_refusal, is_local_dataset
from ..errors import ConfigError
from ..plan import RunSettings, human_bytes
from ..serving.slurm_cluster import slurm_time_ok
from ..states.preflight import STREAM_CACHE_DIR, preflight_logits_memory, states_file_bytes


def check_datasets(run: RunSettings, workdir: Path) -> list[str]:
    """Local dataset paths (dataset.path, validate.datasets[i].path) exist; a hub name is not checked."""
    generated = run.questions.questions  # then dataset.path is not read
    paths = [("dataset.path", run.prompts.path)] * (not generated) + [
        (f"validate.datasets[{i}].path ({d['name']})", d["path"]) for i, d in enumerate(run.questions.evalsets)]
    errors = []
    for key, path in paths:
        if is_local_dataset(path, workdir) and not (workdir / Path(path).expanduser()).exists():
            errors.append(f"{key} {path}: no such file or directory (relative to the working directory "
                          f"{workdir.resolve()}); fix the path, or give a Hugging Face dataset name (org/name)")
    return errors


def check_columns(run: RunSettings, workdir: Path) -> tuple[list[str], list[str]]:
    """(errors, notes): each local dataset (dataset.path, validate.datasets[i].path) yields a question from its first
    rows with its column mapping (dataset.columns, validate.datasets[i].columns), e.g. not a lone `text` column
    unmapped; a hub dataset is not read before a job, said in one note. A missing file is check_datasets'."""
    d = run.prompts
    sets = [("dataset.path", d.path, d.columns, "dataset.columns")] * (not run.questions.questions) + [
        (f"validate.datasets[{i}].path ({s['name']})", s["path"], s.get("columns"), f"validate.datasets[{i}].columns")
        for i, s in enumerate(run.questions.evalsets)]
    errors, hub = [], []
    for key, path, columns, columns_key in sets:
        local = workdir / Path(path).expanduser()
        if not is_local_dataset(path, workdir):
            hub.append(path)
        elif local.exists():
            errors += [e for e in (columns_refusal(str(local), columns, f"{key} {path}", key=columns_key),) if e]
    notes = [f"columns of the hub dataset(s) {', '.join(dict.fromkeys(hub))} not checked: only local files are read "
             "before a job (prepare_prompts and validate_draft check them)"] if hub else []
    return errors, notes


def check_stream_mode(run: RunSettings) -> list[str]:
    """hidden.mode stream takes its states from the vLLM extraction server, placed where server.mode runs servers."""
    h, mode = run.hidden, run.server.mode
    if h.mode != "stream":
        return []
    errors = []
    if h.backend != "vllm":
        errors.append("hidden.mode: stream takes the states from the vLLM extraction server: set hidden.backend: vllm "
                      "(or hidden.mode: files to use the transformers backend)")
    placement = h.placement
    needs = {"node": "local", "slurm": "slurm"}[placement]
    if needs != mode:
        errors.append(f"hidden.stream.placement: {placement} needs server.mode: {needs} (it is {mode!r}): node runs the "
                      "extraction server beside the trainer, slurm as its own SLURM job; make the two agree")
    return errors


def check_logits_room(run: RunSettings) -> tuple[str | None, str]:
    """(failure or None, the log's line) of the extraction server's room for its prompt logits (states.preflight)."""
    try:
        return None, preflight_logits_memory(dataclasses.asdict(run.server), run.hidden)
    except ConfigError as e:
        return str(e), ""


def check_ttt(run: RunSettings) -> str | None:
    """The draft proposes validate.num_speculative_tokens tokens a step; training unrolls it train.ttt_length times."""
    k, ttt = run.export.k, run.train.ttt_length
    if k <= ttt:
        return None
    return (f"validate.num_speculative_tokens {k} is more than train.ttt_length {ttt}, the draft tokens training teaches "
            f"the draft to propose (k drafts need ttt_length >= k); set validate.num_speculative_tokens to {ttt} or less, "
            f"or train.ttt_length to {k} or more")


def check_drafts(run: RunSettings, workdir: Path) -> list[str]:
    """Each of validate.drafts an exported draft directory with its config.json (relative paths: to the working
    directory), so validation does not find it missing after the hours before it."""
    errors = []
    for draft in run.validate.other_drafts:
        path = workdir / draft["path"]
        if not (path / "config.json").is_file():
            what = "has no config.json" if path.is_dir() else "is not a directory"
            errors.append(f"validate.drafts '{draft['name']}': {path} {what}; point path at an exported draft "
                          f"directory (another run's draft/checkpoint)")
    return errors


def check_stream_disk(run: RunSettings, plan, workdir: Path) -> list[str]:
    """Stream mode's disk budget: at least one per-request file of the longest sequence (what train_draft checks
    again with the traces' own lengths), and no more than the working directory's disk has free."""
    if plan.mode != "stream":
        return []
    errors, budget = [], run.hidden.max_disk_gb
    layers = len(run.draft.aux_layers or range(3)) + 1  # the aux layers and the last
    if plan.hidden_size and plan.sequence_tokens:
        least = states_file_bytes(plan.sequence_tokens, layers, plan.hidden_size)
        if plan.stream_bytes < least:
            errors.append(f"hidden.stream.max_disk_gb {budget:g} is below one per-request file of the longest sequence "
                          f"({plan.sequence_tokens:,} tokens x {layers} layers x hidden size {plan.hidden_size} x 4 bytes "
                          f"= {least / 1e9:.3g} GB); raise hidden.stream.max_disk_gb to {least / 1e9:.3g} or more, or "
                          "lower hidden.max_length")
    # what an earlier run's per-request files and cache hold is the budget's own: a rerun clears them
    held = sum(f.stat().st_size for d in (run.hidden.states_dir, STREAM_CACHE_DIR)
               for f in (workdir / d).rglob("*") if f.is_file())
    if plan.free_bytes is not None and plan.stream_bytes > plan.free_bytes + held:
        errors.append(f"hidden.stream.max_disk_gb {budget:g} is more than the working directory's disk has free "
                      f"({human_bytes(plan.free_bytes + held)}); lower it to what the disk holds, or free disk")
    return errors


def check_slurm_time(run: RunSettings) -> str | None:
    """server.slurm.time in a form sbatch takes (serving.slurm_cluster.SLURM_TIME): sbatch refuses any other at submission."""
    value = run.slurm.time
    if run.server.mode != "slurm" or slurm_time_ok(value):
        return None
    return (f"server.slurm.time {value!r} is not a time sbatch takes: minutes, minutes:seconds, hours:minutes:seconds, "
            "days-hours, days-hours:minutes or days-hours:minutes:seconds (an integer is minutes); e.g. "
            "\"2-00:00:00\" for two days")


def check_local_server(run: RunSettings, executor: str | None, sources=()) -> str | None:
    """A cluster executor (``executor``: its name; None where jobs run on this machine) with server.mode local would
    run vLLM where Snakemake runs (a login node, on its CPU) and send the GPU rules to the cluster; refused, naming
    the preset that runs the servers as SLURM jobs."""
    if executor is None or run.server.mode != "local":
        return None
    stems = [s[: -len(".yaml")] for s in map(str, sources) if s.endswith(".yaml") and not s.endswith(".slurm.yaml")]
    sibling = next((f"{s}.slurm.yaml" for s in stems if os.path.exists(f"{s}.slurm.yaml")), None)
    fix = f"--configfile {sibling}" if sibling else "with server.mode: slurm (and server.slurm's partition, GPUs and time)"
    return (f"server.mode: local under the {executor} executor would start vLLM on this machine ({os.uname().nodename}) "
            f"while the rules' jobs go to the cluster: run {fix}, or drop the cluster profile to run everything on "
            "this machine")
