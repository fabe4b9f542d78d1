"""Choose the draft vocabulary (d2t / t2d) by completion-token frequency over all traces."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.draft.vocab import build_vocab
from eaglenest.states.target import load_target_head

_, info = load_target_head(snakemake.input.head)
build_vocab(snakemake.input.traces, snakemake.output[0], info["vocab_size"],
            draft_vocab_size=snakemake.params.vocab_size, use_truncated=snakemake.params.use_truncated)
