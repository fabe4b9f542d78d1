"""Measure the exported draft in real vLLM (beside the target alone, n-gram and validate.drafts) against an offline prediction."""
import os

from eaglenest.logs import to_log

to_log(snakemake.log[0])

import torch

from eaglenest.serving.settings import ServerConfig
from eaglenest.settings import ValidateSettings
from eaglenest.util import usable_threads
from eaglenest.validation.validate import validate_draft

torch.set_num_threads(usable_threads(snakemake.threads))
drafts = {f: snakemake.input[f] for f in ("vllm", "speculators") if f in snakemake.input.keys()}
validate_draft(drafts, snakemake.input.heldout, snakemake.input.metrics, snakemake.output.json, snakemake.output.html,
               ValidateSettings.from_config(snakemake.config), server=ServerConfig.from_config(snakemake.config),
               checkpoint_path=snakemake.input.checkpoint,
               log_dir=snakemake.params.log_dir, csv_path=snakemake.output.csv, curve_paths=list(snakemake.input.curve),
               workflow_pid=int(os.environ.get("EAGLENEST_WORKFLOW_PID", 0)) or None)
