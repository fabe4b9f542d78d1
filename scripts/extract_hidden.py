"""Run the target over one trace shard's exact tokens and write its hidden-state shard."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.gpus import hold_gpus
from eaglenest.settings import HiddenSettings
from eaglenest.states.hidden import extract_hidden
from eaglenest.util import say

# Jobs run side by side each get their own GPUs (a SLURM job keeps the scheduler's).
hold_gpus(snakemake.resources.get("gpu", 0), log=say)

extract_hidden([snakemake.input.traces], snakemake.output[0], HiddenSettings.from_config(snakemake.config))
