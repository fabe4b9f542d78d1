#!/usr/bin/env python3
"""Another kind of draft trained on a finished workflow run's states, for its validation to serve beside its own.

The run's hidden shards, draft vocabulary, target head and training settings (its logs/config.resolved.yaml),
with ``draft.*`` keys changed (``--set``), train a draft that is exported in vLLM's format (float32, as the
presets that serve in float32 need) to ``OUT/draft``. Then name it in the run's config under
``validate.drafts`` and run the workflow again: only validate_draft reruns, and its report sets the drafts
side by side (benchmarks/RESULTS.md, "The draft kinds in vLLM on SmolLM2"):

  python benchmarks/train_kind_on_run.py RUN peagle-out --set kind=peagle
  python benchmarks/train_kind_on_run.py RUN dflash-out --set kind=dflash mask_token_id=3 dflash.block_size=4 \\
      dflash.num_layers=1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest.config import validate_config  # noqa: E402
from eaglenest.draft.dflash_train import train_dflash  # noqa: E402
from eaglenest.draft.export import export_draft  # noqa: E402
from eaglenest.draft.train import train_draft  # noqa: E402
from eaglenest.settings import TrainSettings  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="the workflow run's directory (hidden/, draft/vocab.safetensors, logs/)")
    p.add_argument("out", type=Path)
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="draft: keys, dotted below draft")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    resolved = a.run / "logs/config.resolved.yaml"
    if not resolved.exists():
        raise SystemExit(f"{resolved} is missing: run the workflow in {a.run} up to draft/checkpoint first")
    cfg = yaml.safe_load(resolved.read_text())
    for item in a.set:
        key, _, value = item.partition("=")
        node = cfg["draft"]
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    settings = TrainSettings.from_config(validate_config(cfg, source=str(resolved))).replace(device=a.device)
    trainer = train_dflash if settings.draft.kind == "dflash" else train_draft  # as rule train_draft picks
    trainer(sorted((a.run / "hidden").glob("shard_*.safetensors")), a.run / "draft/vocab.safetensors",
            a.out / "checkpoint.safetensors", a.out / "train_metrics.csv", head_path=a.run / "hidden/target_head.safetensors",
            settings=settings, state_dir=a.out / ".train_state", progress=True)
    export_draft(a.out / "checkpoint.safetensors", a.out / "draft", dtype="float32")
    print(f"{settings.draft.kind} draft: {a.out / 'draft'}; list it under validate.drafts in the run's config")


if __name__ == "__main__":
    main()
