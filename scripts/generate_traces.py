"""Send every question of one prompt shard to the server and keep reasoning, content and token ids."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.data.traces import generate_shard
from eaglenest.serving.probe import check_sentinel
from eaglenest.serving.settings import ServerConfig
from eaglenest.settings import GenerationSettings

api_key = ServerConfig.from_config(snakemake.config).api_key()
ready = check_sentinel(snakemake.input.ready, api_key)
settings = GenerationSettings.from_config(snakemake.config).replace(model=ready["model"])
generate_shard(snakemake.input.prompts, snakemake.output.traces, settings, urls=ready["urls"], api_key=api_key,
               stats_path=snakemake.output.stats)
