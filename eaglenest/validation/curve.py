"""The learning curve: vLLM's acceptance of a draft kept along training (``train.snapshots``), as tokens
per target step (``vllm_facts.per_step``) beside vLLM's per-drafted-step acceptance length.

``measure_point`` exports one kept draft in vLLM's format, serves it on one server start and sends the
held-out prompts at T=0 with ``validate.concurrency`` in flight: the acceptance of the headline cell, the
figure validate_draft gives the final draft, so the points and the final draft line up on one curve.
validate_draft draws the curve (``report.learning_curve``). Speed is not measured here: one
pass, no warm-up, no one-request phase (a point costs a server start and one pass over the set)."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

from ..draft.checkpoint import load_checkpoint
from ..draft.export import export_draft
from ..draft.vllm_format import how_to_serve
from ..errors import ServerError, ValidationError
from ..serving.settings import ServerConfig
from ..settings import ValidateSettings
from ..util import say, write_atomic
from .evalsets import read_prompts
from .requests import request_settings
from .runs import measure_run, validation_server


def measure_point(checkpoint_path, heldout_path, json_path, settings: ValidateSettings | None = None, *,
                  server: ServerConfig | None = None, log_dir="logs/validate", workflow_pid=None, log=say) -> dict:
    """vLLM's acceptance of the draft in ``checkpoint_path`` on the held-out prompts at T=0 (module docstring);
    writes it, with the step and tokens the draft had trained on, to ``json_path`` and returns it. ``settings``:
    validation's, ``server``: the generation server's, which the run's server starts from (None each: the schema's
    defaults)."""
    settings = settings or ValidateSettings.defaults()
    t0 = time.time()
    k = settings.num_speculative_tokens
    name = f"curve_{Path(checkpoint_path).stem}"
    draft_dir = Path(log_dir) / name / "draft"
    shutil.rmtree(draft_dir, ignore_errors=True)
    export_draft(checkpoint_path, draft_dir)
    trained = load_checkpoint(checkpoint_path)[3]
    prompts = read_prompts(heldout_path)
    srv = validation_server(settings, server or ServerConfig.defaults())
    model, spec, _ = how_to_serve("vllm", draft_dir.resolve(), k, srv.model)
    requests = request_settings(settings)  # T=0
    log(f"curve_point: the draft of step {trained['step']} of {trained['of_steps']} in vLLM ({len(prompts)} prompts, k={k})")
    try:
        run = measure_run(name, dataclasses.replace(srv, model=model, served_model_name=srv.model_id), spec, prompts,
                          requests, log_dir=log_dir, concurrency=settings.concurrency, warmup_requests=0, min_seconds=0.0,
                          workflow_pid=workflow_pid, log=log, k=k, one_request_runs=0)
    except ServerError as e:
        raise ValidationError(f"learning-curve point {checkpoint_path} could not start vLLM: {e}") from e
    finally:
        shutil.rmtree(draft_dir, ignore_errors=True)
    point = {"step": trained["step"], "of_steps": trained["of_steps"], "tokens": trained["tokens"],
             "train_loss": trained["loss"], "train_acc": trained.get("acc"), "prompts": len(prompts),
             "temperature": 0.0, "max_tokens": settings.request_max_tokens, "k": k,
             "output_tokens": run["completion_tokens"], "seconds_to_ready": run["seconds_to_ready"],
             "seconds": round(time.time() - t0, 1),
             **{key: run[key] for key in ("tokens_per_step", "drafted_share", "decode_steps", "acceptance_length",
                                          "acceptance_rate", "per_position", "drafts", "draft_tokens", "accepted")}}
    write_atomic(json_path, point)
    log(f"curve_point: step {point['step']} of {point['of_steps']}: {point['tokens_per_step']:.3f} tokens per target "
        f"step (vLLM's acceptance length per drafted step {point['acceptance_length']:.3f}) "
        f"({point['prompts']} prompts, {point['seconds']} s) -> {json_path}")
    return point
