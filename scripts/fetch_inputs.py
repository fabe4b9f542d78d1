"""Fetch what the jobs read from the Hugging Face hub (evaluation sets, the target's config and tokenizer)
before them, on the machine Snakemake runs on; offline, check each is cached."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.fetch import fetch_inputs
from eaglenest.settings import FetchSettings

fetch_inputs(FetchSettings.from_config(snakemake.config), snakemake.output[0])
