"""What the draft's training holds on the GPU before any activation: ours against the peer's, by part.

Builds eaglenest's draft at each size on the meta device (no memory, no GPU: runs anywhere in a
second) and counts the bytes of what a CUDA training step keeps for the whole step, under our default
CUDA settings (train.bf16_weights and train.fp8 on, lm_head frozen) and under the peer benchmark's
(../shared/bench/bench_speculators.py: speculators 0.9.0's Eagle3DraftModel moved to bf16 whole,
torch.optim.AdamW over its trainable parameters, whose moments take the parameters' dtype; frozen
embed_tokens, lm_head and verifier_lm_head). Both train the same parameters (fc, the decoder layer,
the final norm) with the same shapes; the peer's counts come from our layer shapes under its rules.

The peak memory gpu_all.sh measures is this plus the step's activations and workspaces; the last
column of the summary subtracts it from a measured peak given with --peaks, to show the rest.

    python benchmarks/memory_budget.py [--sizes llama8b kimi] [--peaks kimi=16.32,13.06 llama8b=7.79,7.09]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import draft_config  # noqa: E402

from eaglenest.draft.fp8 import fp8_module  # noqa: E402
from eaglenest.draft.model import Eagle3Draft  # noqa: E402

GIB = 2**30


def budget(size):
    """{part: (ours bytes, peer bytes)} for ``size``, and the number of trained parameters."""
    cfg = draft_config(size)
    with torch.device("meta"):
        model = Eagle3Draft(cfg)
    n_trained = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("lm_head."))
    fp8_cached = sum(m.weight.numel() for n, m in model.named_modules()
                     if fp8_module(m, n) and n.startswith("midlayer."))  # fp8.weight_casts: midlayer only
    head = cfg.draft_vocab_size * cfg.hidden_size
    embed = cfg.target_vocab_size * cfg.hidden_size
    return {
        "trained weights (bf16)": (2 * n_trained, 2 * n_trained),
        "their gradients (bf16)": (2 * n_trained, 2 * n_trained),
        "fp32 master weights": (4 * n_trained, 0),
        "Adam moments (2 x bf16)": (4 * n_trained, 4 * n_trained),
        "e4m3 weight copies (one step)": (fp8_cached, 0),
        "draft lm_head (frozen, bf16)": (2 * head, 2 * head),
        "target head rows (frozen, bf16)": (2 * head, 2 * head),  # the peer's verifier_lm_head
        "target embedding (frozen, bf16)": (2 * embed, 2 * embed),
    }, n_trained


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=["llama8b", "kimi"])
    p.add_argument("--peaks", nargs="*", default=[], help="SIZE=OURS,PEER measured peak GiB (gpu_all.sh)")
    a = p.parse_args()
    peaks = {k: tuple(map(float, v.split(","))) for k, v in (item.split("=") for item in a.peaks)}
    rows = []
    for size in a.sizes:
        parts, n_trained = budget(size)
        ours, peer = (sum(v[i] for v in parts.values()) / GIB for i in (0, 1))
        print(f"\n{size}: {n_trained / 1e6:.0f}M trained parameters (lm_head frozen in both)")
        print("| held for the whole step | ours GiB | peer GiB | ours - peer |\n|---|---|---|---|")
        for part, (o, q) in parts.items():
            print(f"| {part} | {o / GIB:.2f} | {q / GIB:.2f} | {(o - q) / GIB:+.2f} |")
        print(f"| total | {ours:.2f} | {peer:.2f} | {ours - peer:+.2f} |")
        row = {"size": size, "trained_params": n_trained, "static_gib": {"ours": round(ours, 2), "peer": round(peer, 2)},
               "bytes": {part: {"ours": o, "peer": q} for part, (o, q) in parts.items()}}
        if size in peaks:
            po, pp = peaks[size]
            row["rest_gib"] = {"ours": round(po - ours, 2), "peer": round(pp - peer, 2)}
            print(f"measured peak {po:.2f} vs {pp:.2f} GiB: activations and workspaces {po - ours:.2f} vs {pp - peer:.2f} GiB")
        rows.append(row)
    print("SUMMARY " + json.dumps(rows))


if __name__ == "__main__":
    main()
