"""Draft training-step throughput at real sizes, with synthetic hidden states.

One optimizer step of eaglenest's EAGLE-3 draft exactly as `eaglenest.train` runs it (target
distribution once per batch, training-time test, soft cross-entropy in chunks, backward, clip,
AdamW), on one packed sequence. Prints tokens/s, peak memory and model FLOP utilisation against
the bf16 matrix rate measured in the same process. FLOPs are counted like
../shared/bench/bench_speculators.py (attention at the causal average), with our lm_head trained.

    python benchmarks/bench_train.py --sizes llama8b kimi --ttt 7 3 [--compile] [--small]
"""

import argparse
import json
import statistics
import time

import torch

from eaglenest.model import DraftConfig, Eagle3Draft
from eaglenest.train import target_distribution

SIZES = {  # hidden, intermediate, heads, kv heads, vocab
    "llama8b": (4096, 14336, 32, 8, 128256),
    "kimi": (7168, 18432, 64, 8, 163840),
    "tiny": (256, 688, 4, 2, 2048),
}


def timed(fn, iters, dev):
    ts = []
    for _ in range(iters):
        if dev == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def matmul_rate(dev, n):
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        x @ y
    return 2 * n**3 / timed(lambda: x @ y, 10, dev)


def flops_per_token(H, I, nh, nkv, DV, T, ttt, head_trained=True):
    hd = H // nh
    layer = 2 * H * nh * hd + 2 * 2 * H * nkv * hd + nh * hd * H + 3 * H * I  # MACs, trainable
    attn = 2 * (T / 2) * nh * hd
    head = H * DV
    per_step = 6 * (layer + attn) + (6 if head_trained else 4) * head
    once = 6 * 3 * H * H + 2 * H * DV  # fc + the target's distribution (no grad)
    return ttt * per_step + once


def check_flex(dev):
    """The flex path computes what the dense-mask path does: outputs and gradients, all TTT steps."""
    cfg = DraftConfig(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, vocab_size=512, draft_vocab_size=256, target_hidden_size=256)
    torch.manual_seed(0)
    model = Eagle3Draft(cfg).to(dev)
    model.set_target(torch.randn(512, 256) * 0.02, torch.zeros(256, dtype=torch.int64), torch.arange(512) < 256)
    ids = torch.randint(0, 512, (2, 200), device=dev)
    aux = torch.randn(2, 200, 768, device=dev)
    res = {}
    for impl in ("sdpa", "flex"):
        model.attention = impl
        model.zero_grad()
        outs = model(ids, aux, ttt_length=4)
        sum((o.float() ** 2).mean() for o in outs).backward()
        res[impl] = (torch.stack(outs).detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
    d_out = (res["sdpa"][0] - res["flex"][0]).abs().max().item()
    d_grad = max((a - b).abs().max().item() / (a.abs().max().item() + 1e-12) for a, b in zip(res["sdpa"][1], res["flex"][1]))
    print(json.dumps({"check": "flex vs sdpa", "max_abs_out": d_out, "max_rel_grad": d_grad}), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=["llama8b", "kimi"])
    p.add_argument("--ttt", type=int, nargs="+", default=[7, 3])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--chunk", type=int, default=4096, help="rows of draft logits alive at once in the loss")
    p.add_argument("--compile", action="store_true", help="torch.compile the draft's decoder layer")
    p.add_argument("--attention", choices=["sdpa", "flex"], default="sdpa")
    p.add_argument("--check", action="store_true", help="first compare flex against sdpa (outputs, grads)")
    p.add_argument("--small", action="store_true", help="tiny sizes, for a CPU smoke run")
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rate = matmul_rate(dev, 512 if a.small else 8192)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"device {name}; bf16 matmul {rate / 1e12:.1f} TFLOP/s; torch {torch.__version__}", flush=True)
    if a.check:
        check_flex(dev)
    rows = []
    for size in ["tiny"] if a.small else a.sizes:
        H, I, nh, nkv, V = SIZES[size]
        DV = min(32000, V // 2)
        T = 128 if a.small else a.seq
        cfg = DraftConfig(hidden_size=H, intermediate_size=I, num_attention_heads=nh, num_key_value_heads=nkv,
                          head_dim=H // nh, vocab_size=V, draft_vocab_size=DV, target_hidden_size=H,
                          rms_norm_eps=1e-5, max_position_embeddings=131072,
                          rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        model = Eagle3Draft(cfg).to(dev)
        model.attention = a.attention
        g = torch.Generator(device=dev).manual_seed(0)
        embed = torch.randn(V, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        lm_head = torch.randn(V, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        d2t = torch.zeros(DV, dtype=torch.int64)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[:DV] = True
        model.set_target(embed, d2t, t2d)
        if a.compile:
            model.midlayer = torch.compile(model.midlayer)
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=dev == "cuda")
        draft_ids = model.draft_ids()
        t2d_dev = t2d.to(dev)
        for ttt in a.ttt:
            aux = torch.randn(1, T, 3 * H, device=dev, dtype=torch.bfloat16, generator=g)
            last = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16, generator=g)
            ids = torch.randint(0, V, (1, T), device=dev, generator=g)
            mask = torch.ones(1, T, dtype=torch.bool, device=dev)

            def step():
                targets = target_distribution(last, mask, lm_head, draft_ids, t2d_dev)
                with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                    loss, _ = model(ids, aux if dev == "cuda" else aux.float(), targets, ttt_length=ttt, chunk=a.chunk)
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                opt.zero_grad(set_to_none=True)

            t0 = time.perf_counter()
            for _ in range(3):
                step()
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            warm = time.perf_counter() - t0
            s = timed(step, a.iters, dev)
            f = flops_per_token(H, I, nh, nkv, DV, T, ttt)
            r = dict(impl="eaglenest-" + a.attention + ("-compiled" if a.compile else ""), size=size, seq=T, ttt=ttt,
                     step_ms=round(s * 1e3, 2), tokens_per_s=round(T / s), mfu=round(f * T / s / rate, 4),
                     peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev == "cuda" else None,
                     warmup_s=round(warm, 1))
            rows.append(r)
            print(json.dumps(r), flush=True)
        del model, opt
        if dev == "cuda":
            torch.cuda.empty_cache()
    print("SUMMARY " + json.dumps(rows))


if __name__ == "__main__":
    main()
