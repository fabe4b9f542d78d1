"""Stop a local server or SLURM job once its last consumer is done (unless server.keep_server): the
generation server after the traces, the extraction server after the hidden shards."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.serving.lifecycle import stop_server
from eaglenest.serving.settings import ServerConfig
from eaglenest.util import say, write_atomic

what = stop_server(ServerConfig.from_config(snakemake.config), snakemake.params.log_dir)
say(f"server ({snakemake.params.log_dir}): {what}")
write_atomic(snakemake.output[0], {"server": what}, indent=None)
if "table" in snakemake.output.keys():  # the generation server's stop: all trace shards are done
    from eaglenest.data.traces import write_stats_table

    write_stats_table(snakemake.input.stats, snakemake.output.table)
