"""Train the draft (EAGLE-3, or DFlash with draft.kind dflash) on the hidden-state shards, or (hidden.mode: stream) on states streamed
from the running extraction server: one process, or torchrun over train.nproc."""
import sys

from eaglenest.logs import to_log

to_log(snakemake.log[0])

import torch

from eaglenest.draft.launch import train_in_processes
from eaglenest.gpus import hold_gpus
from eaglenest.serving.probe import check_sentinel
from eaglenest.serving.settings import ServerConfig
from eaglenest.settings import TrainSettings
from eaglenest.states.preflight import STREAM_CACHE_DIR
from eaglenest.states.stream import stream_spec
from eaglenest.util import say, usable_threads

# Its own GPUs for this job and the torchrun processes it starts (a SLURM job keeps the scheduler's).
hold_gpus(snakemake.resources.get("gpu", 0), log=say)
torch.set_num_threads(usable_threads(snakemake.threads))

settings, io, state_dir = TrainSettings.from_config(snakemake.config), snakemake.input, snakemake.params.state_dir
server = snakemake.config["server"]
stream = None if settings.hidden.mode != "stream" else stream_spec(
    settings.hidden, traces=io.traces, ready=check_sentinel(io.ready, ServerConfig.from_dict(server).api_key()),
    head=io.head, server=server, batch_tokens=settings.batch_tokens, cache_dir=STREAM_CACHE_DIR)
if settings.draft.kind == "dflash":  # its own trainer (one process, shards)
    from eaglenest.draft.dflash_train import train_dflash

    train_dflash(list(io.get("hidden", [])), io.vocab, snakemake.output.checkpoint, snakemake.output.metrics, head_path=io.head,
                 settings=settings, state_dir=state_dir, stream=stream,
                 snapshot_paths=list(snakemake.output.snapshots))
    sys.exit(0)
sys.exit(train_in_processes(snakemake.params.nproc, list(io.get("hidden", [])), io.vocab, snakemake.output.checkpoint,
                            snakemake.output.metrics, head_path=io.head, settings=settings, state_dir=state_dir,
                            stream=stream, snapshot_paths=list(snakemake.output.snapshots)))
