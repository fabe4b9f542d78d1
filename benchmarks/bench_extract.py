"""Hidden-state extraction throughput of eaglenest's transformers path, shard writing included.

Runs `eaglenest.states.hidden.extract_hidden` over synthetic traces with a randomly initialised
Llama-3.1-8B-shaped target on the GPU, and prints tokens/s against the 2*params FLOP-per-token
limit (causal attention added, the input embedding excluded: a lookup; the lm_head included:
extraction runs it for the shard's `target_next`, the greedy token at each position) at the bf16
matrix rate measured in the same process, and the write rate of the shard. The ceiling is measured
in the same process too: the same decoder forward with the same aux-layer capture and batch shape,
and the same chunked lm_head argmax (`target.greedy_next`), its outputs left on the device (no copy,
no write); `ratio_to_forward` is extraction over it.

    python benchmarks/bench_extract.py [--seqs 64 --len 2048 --batch-tokens 16384] [--small]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def matmul_rate(dev, n):
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        x @ y
    ts = []
    for _ in range(10):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x @ y
        if dev == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(ts)


def write_traces(path, n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            ids = torch.randint(0, vocab, (length,), generator=g).tolist()
            f.write(json.dumps({"id": f"{i:08x}", "prompt_token_ids": ids[: length // 8],
                                "completion_token_ids": ids[length // 8:], "truncated": False}) + "\n")


def forward_ceiling(model, aux_layers, length, batch_tokens, vocab, dev, seqs, iters=6):
    """Tokens/s of the forward extraction runs (decoder, aux capture, concatenation, the greedy next
    tokens), outputs kept on the device: the rate extraction would reach if copies and writes cost nothing."""
    from eaglenest.states.target import AuxCapture as _AuxCapture, decoder_of as _decoder, greedy_next

    decoder = _decoder(model)
    B = max(1, min(seqs, batch_tokens // length))  # extraction's batch shape
    ids = torch.randint(0, vocab, (B, length), device=dev)
    capture = _AuxCapture(decoder, aux_layers)

    def fwd():
        with torch.inference_mode():
            capture.states.clear()
            last = decoder(input_ids=ids, use_cache=False).last_hidden_state
            nxt = greedy_next(last.reshape(-1, last.shape[-1]), model.get_output_embeddings().weight)
            return torch.cat([capture.states[i] for i in aux_layers], dim=-1), last, nxt

    try:
        fwd()
        ts = []
        for _ in range(iters):
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fwd()
            if dev == "cuda":
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
    finally:
        capture.remove()
    return B * length / statistics.median(ts)


def main():
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglenest.settings import HiddenSettings
    from eaglenest.states.hidden import extract_hidden

    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--out", default=None, help="directory for the shard (default: a temp dir)")
    p.add_argument("--small", action="store_true")
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.small:
        shape = dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=8, vocab_size=2048)
        a.seqs, a.len = 8, 128
    else:
        shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     num_hidden_layers=32, vocab_size=128256)
    cfg = LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    rate = matmul_rate(dev, 512 if a.small else 8192)
    with torch.device(dev):
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    P = sum(q.numel() for q in model.parameters())
    P_matmul = P - cfg.vocab_size * cfg.hidden_size  # embeddings are a lookup; the lm_head runs (target_next)
    L = cfg.num_hidden_layers
    aux = [2, L // 2, L - 3]
    with tempfile.TemporaryDirectory(dir=a.out) as tmp:
        traces = Path(tmp) / "traces.jsonl"
        write_traces(traces, a.seqs, a.len, cfg.vocab_size)
        out = Path(tmp) / "shard.safetensors"
        # Warm-up (kernel selection, device and page-locked host allocators) on as many batches of
        # the measured shape as extraction holds at once, then the measured run.
        from eaglenest.states.hidden import INFLIGHT

        small = Path(tmp) / "warm.jsonl"
        write_traces(small, min(a.seqs, INFLIGHT * max(1, a.batch_tokens // a.len)), a.len, cfg.vocab_size, seed=1)
        settings = HiddenSettings.defaults().replace(target="random-llama", aux_layers=aux, max_length=a.len,
                                                     batch_tokens=a.batch_tokens, device=dev)
        extract_hidden([small], Path(tmp) / "warm.safetensors", settings, model=model, progress=False)
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        stats = extract_hidden([traces], out, settings, model=model, progress=False)
        seconds = time.perf_counter() - t0
        size = out.stat().st_size
    tokens = a.seqs * a.len
    fwd_tok_s = forward_ceiling(model, aux, a.len, a.batch_tokens, cfg.vocab_size, dev, a.seqs)
    flops = 2 * P_matmul * tokens + L * 4 * tokens * (a.len / 2) * cfg.hidden_size
    r = dict(impl="eaglenest.extract_hidden", params_b=round(P / 1e9, 2), seqs=a.seqs, seq=a.len,
             batch_tokens=a.batch_tokens, seconds=round(seconds, 2), tokens_per_s=round(tokens / seconds),
             flop_util=round(flops / seconds / rate, 3), shard_gib=round(size / 2**30, 2),
             write_gib_per_s=round(size / 2**30 / seconds, 2), bytes_per_token=round(size / tokens),
             peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev == "cuda" else None,
             matmul_tflops=round(rate / 1e12, 1), forward_tokens_per_s=round(fwd_tok_s),
             ratio_to_forward=round(tokens / seconds / fwd_tok_s, 3))
    print(json.dumps(r), flush=True)
    print("SUMMARY " + json.dumps([r]))


if __name__ == "__main__":
    main()
