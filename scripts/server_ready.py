"""Start (local mode) or find (external mode) the generation server, wait until it serves, write server.ready."""
import os
from pathlib import Path

from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.server import LocalPaths, ServerConfig, start_local, stop_local, wait_ready, write_sentinel

cfg = ServerConfig.from_dict(snakemake.params.server)
paths = LocalPaths(Path(snakemake.params.log_dir))
if cfg.mode == "local":
    start_local(cfg, paths, workflow_pid=int(os.environ.get("EAGLENEST_WORKFLOW_PID", 0)) or None,
                sentinel=snakemake.output[0])
    try:
        ready = wait_ready(cfg, paths)
    except BaseException:
        stop_local(paths)  # a server that never became ready must not hold GPUs or the port
        raise
elif cfg.mode == "slurm":
    from eaglenest.slurm import SlurmPaths, cancel_server, slurm_wait_ready, submit_server

    jobs = SlurmPaths(Path(snakemake.params.log_dir))
    submit_server(cfg, snakemake.params.server["slurm"], jobs, sentinel=snakemake.output[0],
                  workflow_pid=int(os.environ.get("EAGLENEST_WORKFLOW_PID", 0)) or None)
    try:
        ready = slurm_wait_ready(cfg, jobs)
    except BaseException:
        cancel_server(jobs)  # a job that never became ready must not hold its GPUs
        raise
else:
    ready = wait_ready(cfg)
write_sentinel(snakemake.output[0], ready)
