"""Rebuild the embedded toy target (toy/target) and its prompts (toy/prompts.jsonl) from a seed.

By hand, from the repository root (same flags as `python -m eaglenest.toy`):

    python scripts/build_toy_target.py --out toy/target --prompts toy/prompts.jsonl --seed 0

From a Snakemake rule: output.model (a directory), output.prompts, params.seed, log[0].
"""

import sys

from eaglenest import toy

if "snakemake" in globals():
    sys.stderr = sys.stdout = open(snakemake.log[0], "w")  # noqa: F821 (set by Snakemake)
    toy.main(["--out", snakemake.output.model, "--prompts", snakemake.output.prompts,  # noqa: F821
              "--seed", str(snakemake.params.seed)])  # noqa: F821
else:
    toy.main()
