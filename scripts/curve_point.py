"""A draft kept along training in real vLLM: one point of the report's learning curve."""
import os

from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.serving.settings import ServerConfig
from eaglenest.settings import ValidateSettings
from eaglenest.validation.curve import measure_point

measure_point(snakemake.input.checkpoint, snakemake.input.heldout, snakemake.output[0],
              ValidateSettings.from_config(snakemake.config), server=ServerConfig.from_config(snakemake.config),
              log_dir=snakemake.params.log_dir,
              workflow_pid=int(os.environ.get("EAGLENEST_WORKFLOW_PID", 0)) or None)
