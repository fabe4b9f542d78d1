"""Start the extraction server (hidden.backend: vllm) through the trace server's lifecycle code,
wait until it serves, write hidden_server.ready."""
import json
import os
from pathlib import Path

from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.extract_vllm import hidden_server_config, layer_ids
from eaglenest.server import LocalPaths, ServerError, start_local, stop_local, wait_ready, write_sentinel
from eaglenest.vllm_connector import storage_dir

info = json.loads(Path(snakemake.input.head).with_suffix(".json").read_text())
storage = storage_dir(snakemake.params.states_dir)  # mode 0700: only this user reads the states
cfg = hidden_server_config(snakemake.params.server, snakemake.params.hidden, info, storage)
paths = LocalPaths(Path(snakemake.params.log_dir))
workflow_pid = int(os.environ.get("EAGLENEST_WORKFLOW_PID", 0)) or None
if cfg.mode == "local":
    start_local(cfg, paths, workflow_pid=workflow_pid, sentinel=snakemake.output[0])
    try:
        ready = wait_ready(cfg, paths)
    except BaseException:
        stop_local(paths)  # a server that never became ready must not hold GPUs or the port
        raise
elif cfg.mode == "slurm":
    from eaglenest.slurm import SlurmPaths, cancel_server, slurm_wait_ready, submit_server

    jobs = SlurmPaths(Path(snakemake.params.log_dir))
    submit_server(cfg, snakemake.params.server["slurm"], jobs, sentinel=snakemake.output[0], workflow_pid=workflow_pid)
    try:
        ready = slurm_wait_ready(cfg, jobs)
    except BaseException:
        cancel_server(jobs)  # a job that never became ready must not hold its GPUs
        raise
else:
    raise ServerError(f"hidden.backend is 'vllm' but server.mode is '{cfg.mode}': the workflow starts the extraction "
                      "server only in local or slurm mode (it must write into a directory this workflow reads). "
                      "Set hidden.backend: transformers, or server.mode: local or slurm")
write_sentinel(snakemake.output[0], {**ready, "states_dir": str(storage), "layer_ids": layer_ids(info)})
