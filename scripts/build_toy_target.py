"""Rebuild the embedded toy target (toy/target) and its prompts (toy/prompts.jsonl) from a seed.

By hand, from the repository root (same flags as `python -m eaglenest.toy`):

    python scripts/build_toy_target.py --out toy/target --prompts toy/prompts.jsonl --seed 0
"""

from eaglenest import toy

toy.main()
