"""Export the trained draft as directories vLLM serves, one per format (config.json + model.safetensors + card)."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.draft.export import export_draft

out = dict(snakemake.output.items())
export_draft(snakemake.input[0], out.get("vllm"), speculators_dir=out.get("speculators"), card=snakemake.params.card,
             verifier=snakemake.params.verifier, k=snakemake.params.k)
