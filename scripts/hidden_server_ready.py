"""Start (local) or submit (slurm) the extraction server (hidden.backend: vllm) through the trace
server's entry point, wait until it serves, write hidden_server.ready."""
import os

from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.errors import ServerError
from eaglenest.serving.connector import storage_dir
from eaglenest.serving.lifecycle import start_server, write_sentinel
from eaglenest.serving.settings import ServerConfig
from eaglenest.settings import HiddenSettings
from eaglenest.states.extract import hidden_server_config, layer_ids
from eaglenest.states.target import TargetFacts

server = ServerConfig.from_config(snakemake.config)
if server.mode not in ("local", "slurm"):
    raise ServerError(f"hidden.backend is 'vllm' but server.mode is '{server.mode}': the workflow starts the extraction "
                      "server only in local or slurm mode (it must write into a directory this workflow reads). "
                      "Set hidden.backend: transformers, or server.mode: local or slurm")
facts = TargetFacts.read(snakemake.input.head)
storage = storage_dir(snakemake.params.states_dir)  # mode 0700: only this user reads the states
cfg = hidden_server_config(server, HiddenSettings.from_config(snakemake.config), facts, storage)
ready = start_server(cfg, snakemake.params.log_dir, sentinel=snakemake.output[0],
                     workflow_pid=int(os.environ.get("EAGLENEST_WORKFLOW_PID", 0)) or None)
write_sentinel(snakemake.output[0], {**ready, "states_dir": str(storage), "layer_ids": layer_ids(facts)})
