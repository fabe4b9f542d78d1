"""eaglenest: train an EAGLE-3 speculative-decoding draft for a served LLM, as a Snakemake workflow."""

__version__ = "0.1.0"
