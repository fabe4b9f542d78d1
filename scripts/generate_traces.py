"""Send every question of one prompt shard to the server and keep reasoning, content and token ids."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.server import ServerConfig, check_sentinel
from eaglenest.traces import generate_shard

gen = dict(snakemake.config["generation"])
max_error_fraction = gen.pop("max_error_fraction")
api_key = ServerConfig.from_dict(snakemake.config["server"]).api_key()
ready = check_sentinel(snakemake.input.ready, api_key)
generate_shard(snakemake.input.prompts, snakemake.output.traces, urls=ready["urls"], model=ready["model"],
               generation=gen, api_key=api_key, stats_path=snakemake.output.stats,
               max_error_fraction=max_error_fraction)
