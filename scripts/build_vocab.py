"""Choose the draft vocabulary (d2t / t2d) by completion-token frequency over all traces."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.draft.vocab import build_vocab
from eaglenest.settings import DraftSettings
from eaglenest.states.target import TargetFacts

build_vocab(snakemake.input.traces, snakemake.output[0], TargetFacts.read(snakemake.input.head).vocab_size,
            DraftSettings.from_config(snakemake.config))
