"""Stop a local (or SLURM) server once its last consumer is done (unless server.keep_server): the
generation server after the traces, the extraction server after the hidden shards."""
import json
from pathlib import Path

from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.server import LocalPaths, ServerConfig, stop_local

cfg = ServerConfig.from_dict(snakemake.params.server)
if cfg.mode == "local" and not cfg.keep_server:
    stopped = stop_local(LocalPaths(Path(snakemake.params.log_dir)))
    what = "stopped" if stopped else "not running"
elif cfg.mode == "slurm" and not cfg.keep_server:
    from eaglenest.slurm import SlurmPaths, cancel_server

    stopped = cancel_server(SlurmPaths(Path(snakemake.params.log_dir)))
    what = "cancelled (SLURM job)" if stopped else "not running"
elif cfg.mode in ("local", "slurm"):
    what = "kept (server.keep_server)"
else:
    what = f"left alone ({cfg.mode} mode)"
print(f"server ({snakemake.params.log_dir}): {what}")
Path(snakemake.output[0]).write_text(json.dumps({"server": what}) + "\n")
