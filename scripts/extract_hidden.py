"""Run the target over one trace shard's exact tokens and write its hidden-state shard."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.gpus import hold_gpus
from eaglenest.states.hidden import extract_hidden
from eaglenest.util import say

# Jobs run side by side each get their own GPUs (a SLURM job keeps the scheduler's).
hold_gpus(snakemake.resources.get("gpu", 0), log=say)

h = snakemake.params.hidden
extract_hidden([snakemake.input.traces], snakemake.output[0], snakemake.params.target,
               aux_layers=snakemake.params.aux_layers, max_length=h["max_length"], use_truncated=h["use_truncated"],
               batch_tokens=snakemake.config["hidden"]["batch_tokens"], device=snakemake.config["hidden"]["device"],
               dtype=h["dtype"])
