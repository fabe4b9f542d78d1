"""`train_draft` itself, end to end, from hidden-state shards on local disk.

For each size: a random target of that width and vocabulary but only 4 layers (the draft only sees
its widths) is run over random traces by `eaglenest.states.hidden.extract_hidden`, which writes a shard in
the project's format (with `target_next`, the target's greedy tokens, as the workflow writes it:
train_draft then keeps only the draft vocabulary's rows of the target head on the device);
`save_target_head` and `build_vocab` write the head and the vocabulary (draft vocabulary 32000). The target is then freed and `eaglenest.draft.train.train_draft` runs with its
DEFAULT configuration; only the sizes are set: one `--seq`-token sequence per step
(`batch_tokens = seq`), `max_steps`. Reported from its own metrics file: tokens/s as the median
over the steps after `--warmup` (train_draft times each step with CUDA events on its compute
stream, end of one step to the end of the next, so loading, copies and host gaps count), MFU,
and peak memory (the most allocated in train_draft's logged windows after warm-up, and in all of
them: `run_peak_gib`, which includes loading and compiling);
`outside_steps_s` is the run's wall time less steps x the median step (compilation, loading the
head, writing the checkpoint).

MFU counts FLOPs like ../shared/bench/bench_speculators.py's flops_per_token (bench_train.py
holds the same formula): per token and TTT step 6x the trainable layer MACs and causal attention,
6x (trained) or 4x (frozen) the draft lm_head, plus fc and the target distribution over the draft
vocabulary once; recomputation in backward is not counted (the target's argmax over its full
vocabulary is extraction's work, in `extract_s`, not training's).

    python benchmarks/bench_train_e2e.py --sizes llama8b kimi [--seqs 40 --seq 2048 --steps 40] [--small]
"""

import argparse
import csv
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_extract import write_traces  # noqa: E402
from bench_train import SIZES, flops_per_token, matmul_rate  # noqa: E402

from eaglenest.draft.train import AUTO_KEYS  # noqa: E402


def make_data(root, size, seqs, seq, dev):
    """Shard + target head + vocabulary of a random 4-layer target of ``size``'s widths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglenest.settings import DraftSettings, HiddenSettings
    from eaglenest.states.hidden import extract_hidden
    from eaglenest.states.target import save_target_head
    from eaglenest.draft.vocab import build_vocab

    H, I, nh, nkv, V = SIZES[size]
    cfg = LlamaConfig(hidden_size=H, intermediate_size=I, num_attention_heads=nh, num_key_value_heads=nkv,
                      num_hidden_layers=4, vocab_size=V, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        torch.set_default_dtype(torch.bfloat16)
        try:
            target = LlamaForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(torch.float32)
    traces = root / "traces.jsonl"
    write_traces(traces, seqs, seq, V)
    t0 = time.perf_counter()
    ext = extract_hidden([traces], root / "shard_0.safetensors",
                         HiddenSettings.defaults().replace(target=f"random-{size}", max_length=seq, batch_tokens=16384, device=dev),
                         model=target, progress=False)
    extract_s = time.perf_counter() - t0
    save_target_head(root / "target_head.safetensors", HiddenSettings.defaults().replace(target=f"random-{size}"), model=target)
    build_vocab([traces], root / "vocab.safetensors", V, DraftSettings.defaults().replace(vocab_size=min(32000, V // 2)))
    del target
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"extract_s": round(extract_s, 2), "shard_gib": round(ext["bytes"] / 2**30, 2)}


def main():
    from eaglenest.draft.checkpoint import resolve_config
    from eaglenest.draft.train import resolve_runtime, train_draft

    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=["llama8b", "kimi"])
    p.add_argument("--seqs", type=int, default=40, help="sequences in the shard (one per step)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the median (compilation)")
    p.add_argument("--ttt", type=int, default=None, help="ttt_length (default: train's default)")
    p.add_argument("--dir", default=None, help="local directory for the shards (default: a temp dir)")
    p.add_argument("--out", default=None, help="directory for a JSON copy of the results")
    p.add_argument("--config", default="{}", help="training config overrides as JSON (labelled in the output; "
                   "the figures of issue 12 use none)")
    p.add_argument("--small", action="store_true", help="tiny sizes, for a CPU smoke run")
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.small:
        a.sizes, a.seq, a.seqs, a.steps, a.warmup = ["tiny"], 256, 8, 8, 2
    rate = matmul_rate(dev, 512 if a.small else 8192)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"device {name}; bf16 matmul {rate / 1e12:.1f} TFLOP/s; torch {torch.__version__}", flush=True)
    overrides = json.loads(a.config)
    config = {**overrides, "batch_tokens": a.seq, "max_steps": a.steps}
    if a.ttt:
        config["ttt_length"] = a.ttt
    resolved = resolve_runtime(resolve_config(config), dev)
    results = []
    for size in a.sizes:
        H, I, nh, nkv, V = SIZES[size]
        DV = min(32000, V // 2)
        root = Path(tempfile.mkdtemp(prefix=f"e2e-{size}-", dir=a.dir))
        try:
            data = make_data(root, size, a.seqs, a.seq, dev)
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()  # train_draft's first logged window starts here
            t0 = time.perf_counter()
            stats = train_draft([root / "shard_0.safetensors"], root / "vocab.safetensors", root / "draft.safetensors",
                                root / "metrics.csv", head_path=root / "target_head.safetensors", config=config,
                                state_dir=root / "state", device=dev, progress=False)
            wall = time.perf_counter() - t0
            rows = list(csv.DictReader(open(root / "metrics.csv")))
            after = [r for r in rows if int(r["step"]) > a.warmup]
            tok_s = statistics.median(float(r["tokens_per_s"]) for r in after)
            ttt = resolved["ttt_length"]
            f = flops_per_token(H, I, nh, nkv, DV, a.seq, ttt, head_trained=not resolved["freeze_lm_head"])
            kind = f"config overrides {json.dumps(overrides)}" if overrides else "default config"
            r = dict(impl=f"eaglenest train_draft e2e ({kind}: " + ", ".join(
                         f"{k}={resolved[k]}" for k in (*AUTO_KEYS, "bf16_weights", "fp8", "freeze_lm_head")) + ")",
                     size=size, seq=a.seq, ttt=ttt, steps=stats["steps"], tokens_per_s=round(tok_s),
                     step_ms=round(a.seq / tok_s * 1e3, 2), mfu=round(f * tok_s / rate, 4),
                     peak_gib=round(max(float(r["peak_gib"]) for r in after), 2) if "peak_gib" in rows[0] else None,
                     run_peak_gib=round(max(float(r["peak_gib"]) for r in rows), 2) if "peak_gib" in rows[0] else None,
                     run_s=round(wall, 1), outside_steps_s=round(wall - stats["steps"] * a.seq / tok_s, 1),
                     loss_first=round(float(rows[0]["loss"]), 3),
                     loss_last=round(float(rows[-1]["loss"]), 3), **data)
            results.append(r)
            print(json.dumps(r), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            if dev == "cuda":
                torch.cuda.empty_cache()
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bench_train_e2e.json").write_text(json.dumps(results, indent=1))
    print("SUMMARY " + json.dumps(results))


if __name__ == "__main__":
    main()
