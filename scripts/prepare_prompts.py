"""Turn the configured dataset into prompt shards and a held-out set."""
from pathlib import Path

from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.data.prompts import prepare_prompts
from eaglenest.settings import PromptSettings

s = PromptSettings.from_config(snakemake.config)
prepare_prompts(s.path, Path(snakemake.output.heldout).parent, shards=s.shards, split=s.split, limit=s.limit,
                heldout=s.heldout, seed=s.seed, keep_system=s.keep_system, max_prompt_chars=s.max_prompt_chars,
                cache_dir=s.cache_dir)
