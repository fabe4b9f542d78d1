"""Flex attention's kernel options at the draft's own shapes: every TTT step's attention, forward and
backward, as ``train_draft`` runs it on CUDA (one packed sequence, the key buffer of all steps, the
per-step block masks of ``model.ttt_block_masks``), timed for each candidate ``kernel_options``.

    python benchmarks/tune_flex.py --sizes kimi llama8b [--autotune] [--out DIR]

Prints one JSON line per (size, candidate) with the milliseconds for the 7 steps' attention and the
TFLOP/s over the blocks computed, then ``BEST <size> <json>`` per size; with ``--out``, the best
options go to ``DIR/flex_best_<size>.json``. ``--autotune`` adds torch's max-autotune search (its
choice is printed by inductor to stderr). A candidate torch rejects is reported and skipped.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import SIZES, timed  # noqa: E402  (head_dim = hidden // heads, as bench_train builds the draft)

from eaglenest.draft.layers import FLEX_BLOCK
from eaglenest.draft.ttt import ttt_block_masks  # noqa: E402

FWD_128 = {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 8}  # torch's H100 pick for hd 128
CANDIDATES = [
    {},
    FWD_128,
    {**FWD_128, "ROWS_GUARANTEED_SAFE": True},
    {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 32, "fwd_num_stages": 3, "fwd_num_warps": 4},
    {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64,
     "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_stages": 3, "bwd_num_warps": 4},
    {**FWD_128, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32, "bwd_num_stages": 3,
     "bwd_num_warps": 4},
    {**FWD_128, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64, "bwd_num_stages": 2,
     "bwd_num_warps": 8},
    {**FWD_128, "USE_TMA": True},
]


def run_steps(attn, q, k, v, masks, gout):
    for mask in masks:
        out = attn(q, k, v, mask)
        out.backward(gout)


def measure(options, q, k, v, masks, gout, iters, mode=None):
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    opts = dict(options) or None

    def attn(q, k, v, mask):
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1], kernel_options=opts)

    fn = torch.compile(attn, dynamic=False, **({"mode": mode} if mode else {}))
    for _ in range(2):
        run_steps(fn, q, k, v, masks, gout)
    torch.cuda.synchronize()
    ms = timed(lambda: run_steps(fn, q, k, v, masks, gout), iters, "cuda") * 1e3
    q.grad = k.grad = v.grad = None
    return ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=["kimi"])
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--autotune", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--small", action="store_true", help="tiny sizes (still needs CUDA: flex has no CPU backward)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("tune_flex: needs CUDA (flex attention's Triton kernels); nothing measured")
        return
    for size in ["tiny"] if a.small else a.sizes:
        H, _, nh, nkv, _ = SIZES[size]
        hd, T, J = H // nh, (256 if a.small else a.seq), a.ttt
        T = -(-T // FLEX_BLOCK) * FLEX_BLOCK
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, nh, T, hd, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        k = torch.randn(1, nkv, J * T, hd, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        v = torch.randn_like(k).requires_grad_()
        gout = torch.randn_like(q)
        masks = ttt_block_masks(T, J, "cuda")
        blocks = sum(int(m.kv_num_blocks.sum()) + (int(m.full_kv_num_blocks.sum()) if m.full_kv_num_blocks is not None else 0)
                     for m in masks)
        # QK and PV over every block computed, forward (2 products) and backward (5)
        flops = blocks * FLEX_BLOCK * FLEX_BLOCK * hd * nh * 2 * 7
        results = []
        for options in CANDIDATES:
            r = {"size": size, "head_dim": hd, "ttt": J, "seq": T, "options": options}
            try:
                ms = measure(options, q, k, v, masks, gout, a.iters)
                r.update(ms=round(ms, 3), tflops_on_blocks=round(flops / ms / 1e9, 1))
                results.append((ms, options))
            except Exception as e:  # noqa: BLE001 - a candidate the kernel cannot take: report, go on
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(r), flush=True)
        best = min(results, key=lambda x: x[0])
        print(f"BEST {size} {json.dumps(best[1])} {best[0]:.3f} ms (default {results[0][0]:.3f} ms)", flush=True)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / f"flex_best_{size}.json").write_text(json.dumps(best[1]))
        if a.autotune:  # last: the slowest to compile
            ms = measure({}, q, k, v, masks, gout, a.iters, mode="max-autotune-no-cudagraphs")
            print(json.dumps({"size": size, "mode": "max-autotune-no-cudagraphs", "ms": round(ms, 3),
                              "tflops_on_blocks": round(flops / ms / 1e9, 1)}), flush=True)
        del q, k, v, gout
        torch.cuda.empty_cache()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
