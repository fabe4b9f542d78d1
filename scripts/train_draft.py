"""Train the EAGLE-3 draft on the hidden-state shards."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

import torch

from eaglenest.train import train_draft

torch.set_num_threads(max(1, snakemake.threads))
train_draft(snakemake.input.hidden, snakemake.input.vocab, snakemake.output.checkpoint, snakemake.output.metrics,
            head_path=snakemake.input.head, state_dir=snakemake.params.state_dir,
            config={**snakemake.params.train, "norm_before_residual": snakemake.params.norm_before_residual},
            device=snakemake.config["train"]["device"])
