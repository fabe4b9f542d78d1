"""Choose the draft vocabulary (d2t / t2d) by completion-token frequency over all traces."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.target import load_target_head
from eaglenest.vocab import build_vocab

_, info = load_target_head(snakemake.input.head)
build_vocab(snakemake.input.traces, snakemake.output[0], info["vocab_size"],
            draft_vocab_size=snakemake.params.vocab_size, use_truncated=snakemake.params.use_truncated)
