"""Export the trained draft as directories vLLM serves, one per format (config.json + model.safetensors + card)."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from eaglenest.draft.export import export_draft
from eaglenest.settings import ExportSettings

out = dict(snakemake.output.items())
settings = ExportSettings.from_config(snakemake.config)
export_draft(snakemake.input[0], out.get("vllm"), settings, speculators_dir=out.get("speculators"), card=settings.card())
