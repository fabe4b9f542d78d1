"""Save the target's embeddings, final norm and lm_head (and its facts) once, for training."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.states.target import save_target_head
from eaglenest.util import say

info = save_target_head(snakemake.params.target, snakemake.output[0], aux_layers=snakemake.params.aux_layers,
                        allow_load=snakemake.params.allow_load)
say(f"target head saved: vocab {info['vocab_size']}, hidden {info['hidden_size']}, aux layers {info['aux_layers']}")
