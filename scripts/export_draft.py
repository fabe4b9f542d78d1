"""Export the trained draft as a directory vLLM serves (config.json + model.safetensors + card)."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.export import export_draft

export_draft(snakemake.input[0], snakemake.output[0], card=snakemake.params.card)
