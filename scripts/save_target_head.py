"""Save the target's embeddings, final norm and lm_head (and its facts) once, for training."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.settings import HiddenSettings
from eaglenest.states.target import save_target_head
from eaglenest.util import say

facts = save_target_head(snakemake.output[0], HiddenSettings.from_config(snakemake.config))
say(f"target head saved: vocab {facts.vocab_size}, hidden {facts.hidden_size}, aux layers {facts.aux_layers}")
