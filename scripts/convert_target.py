"""Convert the target's GGUF file (server.model) into the Hugging Face directory vLLM serves."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.gguf import convert_gguf
from eaglenest.util import atomic_dir, say

with atomic_dir(snakemake.output[0]) as tmp:
    facts = convert_gguf(snakemake.input.gguf, tmp, dtype=snakemake.params.dtype)
say(f"gguf: {snakemake.input.gguf} -> {snakemake.output[0]}: {facts['tensors']} tensors, vocabulary "
    f"{facts['vocab_size']}, tied embeddings {facts['tied']}, chat template {facts['chat_template']}")
