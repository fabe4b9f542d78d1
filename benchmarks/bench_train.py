"""Draft training-step throughput at real sizes, with synthetic hidden states already on the GPU.

One optimizer step of eaglenest's EAGLE-3 draft as `eaglenest.draft.train` runs it (target distribution
once per batch, training-time test, loss, backward, clip, AdamW), on one packed sequence, with the
target distribution as train_draft makes it from shards that have `target_next` (the draft
vocabulary's rows of the target head on the device, the greedy tokens given; `--target-argmax full`:
the path of shards without it, the full head on the device and the argmax over it each step), with the
step path train_draft's config picks on this device by default (on CUDA: flex attention, compiled
step, recomputation, fused loss; see device.resolve_runtime), or the one the flags ask for.
bench_train_e2e.py measures train_draft itself, from shards on disk. Prints tokens/s, peak memory
and model FLOP utilisation against the bf16 matrix rate measured in the same process. FLOPs are
counted like ../shared/bench/bench_speculators.py (attention at the causal average), with our
lm_head trained unless frozen (recomputation not counted).

    python benchmarks/bench_train.py --sizes llama8b kimi --ttt 7 3 [--attention sdpa --compile false] [--small]
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import eaglenest.draft.model
from eaglenest.draft.batches import loss_rows
from eaglenest.draft.config import DraftConfig
from eaglenest.draft.device import AUTO_KEYS, configure_compile, resolve_runtime
from eaglenest.draft.model import Eagle3Draft
from eaglenest.draft.optim import clip_and_step
from eaglenest.draft.runtime import Runtime
from eaglenest.draft.targets import target_distribution
from eaglenest.draft.train import make_optimizer
from eaglenest.draft.ttt import token_embeds_ids, ttt_loss_plan
from eaglenest.settings import TrainSettings

SIZES = {  # hidden, intermediate, heads, kv heads, vocab
    "llama8b": (4096, 14336, 32, 8, 128256),
    "kimi": (7168, 18432, 64, 8, 163840),
    "tiny": (256, 688, 4, 2, 2048),
}


def draft_config(size):
    """The draft of a ``SIZES`` target: its widths, a draft vocabulary of min(32000, V / 2)."""
    H, I, nh, nkv, V = SIZES[size]
    return DraftConfig(hidden_size=H, intermediate_size=I, num_attention_heads=nh, num_key_value_heads=nkv,
                       head_dim=H // nh, target_vocab_size=V, draft_vocab_size=min(32000, V // 2), target_hidden_size=H,
                       rms_norm_eps=1e-5, max_position_embeddings=131072,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


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


KINDS = [  # (kind, substrings of kernel names), first match wins
    ("flex attention", ("flex", "triton_tem")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "mm_")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("memcpy", ("memcpy", "memset")),
    ("reduction/elementwise (triton)", ("triton_",)),
    ("reduction/elementwise (aten)", ("elementwise", "reduce", "vectorized", "index", "scatter", "gather", "softmax", "cat")),
]


def profile(step, dev, steps=2):
    """Device time of ``steps`` steps by kind of kernel (ms per step) and the 30 costliest kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if dev == "cuda":
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if (e.self_device_time_total if dev == "cuda" else e.self_cpu_time_total) > 0]
    us = lambda e: e.self_device_time_total if dev == "cuda" else e.self_cpu_time_total
    if dev == "cuda":  # kernels only: not the spans of record_function ranges (Optimizer.step#...), which repeat them
        events = [e for e in events if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)
                  and "#" not in e.key]
    kinds = {}
    for e in events:
        name = e.key.lower()
        kind = next((k for k, subs in KINDS if any(x in name for x in subs)), "other")
        kinds[kind] = kinds.get(kind, 0) + us(e) / 1e3 / steps
    top = sorted(events, key=us, reverse=True)[:30]
    return {"ms_per_step_by_kind": {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "device_ms_per_step": round(sum(kinds.values()), 2),
            "top_kernels_ms_per_step": [(e.key[:120], round(us(e) / 1e3 / steps, 2), e.count // steps) for e in top]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=["llama8b", "kimi"])
    p.add_argument("--ttt", type=int, nargs="+", default=[7, 3])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--chunk", type=int, default=4096, help="rows of draft logits alive at once in the loss")
    p.add_argument("--prompt", type=int, default=0, help="leading tokens of the sequence without loss (a prompt; "
                   "bench_train_e2e's data has seq/8)")
    choice = lambda x: x if x == "auto" else {"true": True, "false": False}[x]
    for key in ("compile", "recompute", "fused-loss", "split-step-grads", "diag-split", "skip-unscored"):
        p.add_argument(f"--{key}", type=choice, default="auto", help="auto (train's default on this device), true, false")
    p.add_argument("--attention", choices=["auto", "sdpa", "flex"], default="auto")
    p.add_argument("--freeze-lm-head", type=choice, default=None, help="true/false; default: train's (true)")
    p.add_argument("--target-argmax", choices=["shard", "full"], default="shard",
                   help="shard: target_next comes with the batch (the default path); full: the argmax over the full "
                   "target vocabulary each step (shards written before target_next)")
    p.add_argument("--flex-options", nargs="+", default=[None], metavar="JSON",
                   help="flex attention kernel_options to time in turn (JSON dicts; default: the model's FLEX_KERNEL_OPTIONS)")
    p.add_argument("--profile", action="store_true", help="then profile 2 steps: device time by kind of kernel, top kernels")
    p.add_argument("--small", action="store_true", help="tiny sizes, for a CPU smoke run")
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    given = {"attention": a.attention, "compile": a.compile, "recompute": a.recompute, "fused_loss": a.fused_loss,
             "split_step_grads": a.split_step_grads, "diag_split": a.diag_split, "skip_unscored": a.skip_unscored}
    if a.freeze_lm_head is not None:
        given["freeze_lm_head"] = a.freeze_lm_head
    run = resolve_runtime(TrainSettings.defaults().replace(**given), dev)
    rate = matmul_rate(dev, 512 if a.small else 8192)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"device {name}; bf16 matmul {rate / 1e12:.1f} TFLOP/s; torch {torch.__version__}", flush=True)
    label = "eaglenest-step-" + "-".join(f"{k}={getattr(run, k)}" for k in (*AUTO_KEYS, "bf16_weights", "freeze_lm_head"))
    label += f"-target_argmax={a.target_argmax}"
    if run.compile:
        configure_compile(range(len(a.ttt) * len(a.sizes) * len(a.flex_options)))
    rows = []
    for size in ["tiny"] if a.small else a.sizes:
        H, I, nh, nkv, V = SIZES[size]
        T = 128 if a.small else a.seq
        cfg = draft_config(size)
        DV = cfg.draft_vocab_size
        model = Eagle3Draft(cfg, runtime=Runtime.from_settings(run)).to(dev)
        if run.freeze_lm_head:
            model.lm_head.weight.requires_grad_(False)
        g = torch.Generator(device=dev).manual_seed(0)
        embed = torch.randn(V, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        lm_head = torch.randn(V, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        d2t = torch.zeros(DV, dtype=torch.int64)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[:DV] = True
        # as train_draft: the embedding table stays off the device, each batch's rows come with it
        model.set_target(embed[:0], d2t, t2d)
        params = [q for q in model.parameters() if q.requires_grad]
        opt = make_optimizer(model, run.replace(lr=1e-4), dev == "cuda")
        draft_ids = model.draft_ids()
        t2d_dev = t2d.to(dev)
        if a.target_argmax == "shard":  # as train_draft: only the draft rows of the head are on the device
            lm_head = lm_head[draft_ids].contiguous()
        inputs = []
        for ttt in a.ttt:
            aux = torch.randn(1, T, 3 * H, device=dev, dtype=torch.bfloat16, generator=g)
            last = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16, generator=g)
            ids = torch.randint(0, V, (1, T), device=dev, generator=g)
            # the shard's greedy tokens (int32, with the batch), about half in the draft vocabulary
            nxt = torch.randint(0, 2 * DV, (1, T), device=dev, generator=g).clamp(max=V - 1).to(torch.int32)
            inputs.append((ttt, aux, last, ids, nxt, F.embedding(token_embeds_ids(ids, ttt), embed)))
        del embed
        for ttt, aux, last, ids, nxt, embeds in inputs:
            mask = torch.ones(1, T, dtype=torch.bool, device=dev)
            mask[:, : a.prompt] = False
            rows_host = loss_rows(mask.cpu())  # train_draft's loader makes these on the host
            extra = {"plan": {k: v.to(dev) for k, v in ttt_loss_plan(rows_host, T, ttt, T, chains=run.skip_unscored).items()}} if run.fused_loss or run.skip_unscored else {}
            rows_dev = rows_host.to(dev)

            def step(nxt=nxt if a.target_argmax == "shard" else None):
                targets = {**target_distribution(last, mask, lm_head, draft_ids, t2d_dev, rows=rows_dev, target_next=nxt),
                           **extra}
                with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                    loss, _ = model(ids, aux if dev == "cuda" else aux.float(), targets, ttt_length=ttt, chunk=a.chunk, embeds=embeds)
                loss.backward()
                clip_and_step(opt, params, 0.5)
                opt.zero_grad(set_to_none=True)

            for flex_options in a.flex_options:
                if flex_options is not None:
                    eaglenest.draft.layers.FLEX_KERNEL_OPTIONS = json.loads(flex_options)
                    torch._dynamo.reset()  # recompile the step with them (and the rest, as a new run would)
                t0 = time.perf_counter()
                for _ in range(3):
                    step()
                if dev == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                warm = time.perf_counter() - t0
                s = timed(step, a.iters, dev)
                f = flops_per_token(H, I, nh, nkv, DV, T, ttt, head_trained=not run.freeze_lm_head)
                r = dict(impl=label, size=size, seq=T, prompt=a.prompt, ttt=ttt, flex_options=eaglenest.draft.layers.FLEX_KERNEL_OPTIONS,
                         step_ms=round(s * 1e3, 2), tokens_per_s=round(T / s), mfu=round(f * T / s / rate, 4),
                         peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev == "cuda" else None,
                         # between steps: weights, optimizer state, inputs; the rest of the peak is the step's
                         static_gib=round(torch.cuda.memory_allocated() / 2**30, 2) if dev == "cuda" else None,
                         warmup_s=round(warm, 1))
                if a.profile:
                    r["profile"] = profile(step, dev)
                rows.append(r)
                print(json.dumps(r), flush=True)
        del model, opt
        if dev == "cuda":
            torch.cuda.empty_cache()
    print("SUMMARY " + json.dumps(rows))


if __name__ == "__main__":
    main()
