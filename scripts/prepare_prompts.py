"""Turn the configured dataset into prompt shards and a held-out set."""
from pathlib import Path

from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.data.prompts import prepare_prompts
from eaglenest.settings import PromptSettings

prepare_prompts(Path(snakemake.output.heldout).parent, PromptSettings.from_config(snakemake.config))
