"""Turn the configured dataset into prompt shards and a held-out set."""
from pathlib import Path

from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.data.prompts import prepare_prompts

ds = snakemake.params.dataset
prepare_prompts(snakemake.params.path, Path(snakemake.output.heldout).parent, shards=snakemake.params.shards,
                split=ds["split"], limit=ds["limit"], heldout=ds["heldout"], seed=ds["seed"],
                keep_system=ds["keep_system"], max_prompt_chars=ds["max_prompt_chars"],
                cache_dir=snakemake.config["dataset"]["cache_dir"])
