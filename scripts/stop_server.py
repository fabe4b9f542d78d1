"""Stop the generation server once every trace shard is done (unless server.keep_server)."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.server import ServerConfig, stop_server
from eaglenest.util import say, write_atomic

what = stop_server(ServerConfig.from_dict(snakemake.params.server), snakemake.params.log_dir)
say(f"generation server: {what}")
write_atomic(snakemake.output[0], {"server": what}, indent=None)
