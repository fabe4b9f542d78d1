"""Train the EAGLE-3 draft on the hidden-state shards, or (hidden.mode: stream) on states streamed
from the running extraction server: one process, or torchrun over train.nproc."""
import json
import subprocess
import sys
from pathlib import Path

from eaglenest.logs import to_log

to_log(snakemake.log[0])

import torch

from eaglenest.draft.train import train_draft
from eaglenest.gpus import hold_gpus
from eaglenest.serving.probe import check_sentinel
from eaglenest.serving.settings import ServerConfig
from eaglenest.settings import TrainSettings
from eaglenest.util import say, usable_threads

# Its own GPUs for this job and the torchrun processes it starts (a SLURM job keeps the scheduler's).
hold_gpus(snakemake.resources.get("gpu", 0), log=say)

settings = TrainSettings.from_config(snakemake.config)
config, h = settings.config(), settings.hidden
nproc, device = snakemake.params.nproc, settings.device
stream = None
if h.mode == "stream":
    server = snakemake.config["server"]
    ready = check_sentinel(snakemake.input.ready, ServerConfig.from_dict(server).api_key())
    stream = {"traces": list(snakemake.input.traces), "url": ready["urls"][0], "model": ready["model"],
              "head": snakemake.input.head, "storage": ready["states_dir"], "server": server,
              **{k: getattr(h, k) for k in ("max_length", "use_truncated", "concurrency", "request_timeout", "max_retries",
                                            "backoff_base", "backoff_max", "max_disk_gb", "cache")},
              "ahead_tokens": h.stream_ahead * config["batch_tokens"],
              "cache_dir": str(Path(snakemake.params.state_dir) / "stream_cache")}
args = dict(hidden=list(snakemake.input.get("hidden", [])), vocab=snakemake.input.vocab, head=snakemake.input.head,
            out=snakemake.output.checkpoint, metrics=snakemake.output.metrics, state_dir=snakemake.params.state_dir,
            snapshots=list(snakemake.output.snapshots))
if nproc > 1:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "eaglenest.draft.train", "--hidden", *args["hidden"], "--vocab", args["vocab"], "--head", args["head"],
           "--out", args["out"], "--metrics", args["metrics"], "--state-dir", args["state_dir"], "--snapshots", *args["snapshots"],
           "--config", json.dumps(config), "--device", device, *(["--stream", json.dumps(stream)] if stream else [])]
    say("launching: " + " ".join(cmd))
    sys.exit(subprocess.run(cmd, stdout=sys.stdout, stderr=sys.stderr).returncode)
torch.set_num_threads(usable_threads(snakemake.threads))
train_draft(args["hidden"], args["vocab"], args["out"], args["metrics"], head_path=args["head"],
            state_dir=args["state_dir"], config=config, device=device, stream=stream, snapshot_paths=args["snapshots"])
