"""Start (local), submit (slurm) or find (external) the generation server, wait until it serves, write server.ready."""
import os

from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.serving.lifecycle import kv_shortfall, start_server, write_sentinel
from eaglenest.serving.settings import ServerConfig
from eaglenest.settings import GenerationSettings
from eaglenest.util import say

cfg = ServerConfig.from_config(snakemake.config)
ready = start_server(cfg, snakemake.params.log_dir, sentinel=snakemake.output[0],
                     workflow_pid=int(os.environ.get("EAGLENEST_WORKFLOW_PID", 0)) or None)
# generation.concurrency is read from the config, not a param: a change must not restart the server.
if warning := kv_shortfall(ready, GenerationSettings.from_config(snakemake.config).concurrency):
    say(f"WARNING: {warning}")
write_sentinel(snakemake.output[0], ready)
