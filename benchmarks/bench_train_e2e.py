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

``--kind`` trains that draft kind (``draft.kind``; default: the config's) through the workflow's own
trainer for it: `train_draft` for eagle3, eagle3.1 and peagle, `dflash_train.train_dflash` for dflash,
with the mask token (peagle, dflash) the target's last id. DFlash's MFU counts its own FLOPs
(``dflash_flops_per_token``). ``--data DIR`` keeps the shard, head and vocabulary of each size under
DIR/<size> and reuses them when there (several kinds, one extraction).

    python benchmarks/bench_train_e2e.py --sizes llama8b kimi [--seqs 40 --seq 2048 --steps 40] [--kind peagle] [--small]
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

from eaglenest.draft.device import AUTO_KEYS  # noqa: E402
from eaglenest.settings import TrainSettings  # noqa: E402


def train_settings(changes: dict) -> TrainSettings:
    """The schema's TrainSettings with flat ``changes``: TrainSettings fields, the draft's shape keys (DraftSettings.shape)
    and ``dflash`` (a dict of DFlashSettings fields)."""
    base, changes = TrainSettings.defaults(), dict(changes)
    draft = base.draft.replace(**{k: changes.pop(k) for k in list(changes) if k in base.draft.shape()})
    if "dflash" in changes:
        draft = draft.replace(dflash=draft.dflash.replace(**changes.pop("dflash")))
    return base.replace(draft=draft, **changes)


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


def dflash_flops_per_token(H, I, nh, nkv, DV, T, settings):
    """A DFlash step's FLOPs per sequence token, counted as ``bench_train.flops_per_token`` counts EAGLE's: per
    block slot and layer 6x the layer's MACs and its attention (the context up to the anchor, T/2 on average,
    and the block's S slots); per sequence token and layer 6x the context's k/v projections, and fc once;
    4x (frozen) or 6x (trained) the lm_head at the scored slots. Anchors: ``dflash_anchors``, at most T."""
    S, L = settings.draft.dflash.block_size, settings.draft.dflash.num_layers
    hd = H // nh
    N = min(settings.dflash_anchors, T)
    slot = 2 * H * nh * hd + 2 * H * nkv * hd + 3 * H * I + 2 * nh * hd * (T / 2 + S)  # q, o, k, v, MLP, attention
    ctx = 2 * H * nkv * hd
    head = (4 if settings.freeze_lm_head else 6) * N * (S - 1) * H * DV
    return (6 * (N * S * L * slot + T * L * ctx + T * 3 * H * H) + head) / T


def data_dir(root, size, seqs, seq):
    """DIR/<size> holding this size's shard, head and vocabulary, or None where it must be made."""
    d = Path(root) / size
    want = {"size": size, "seqs": seqs, "seq": seq}
    try:
        return d if json.loads((d / "made.json").read_text()) == want else None
    except (OSError, ValueError):
        return None


def main():
    from eaglenest.draft.device import resolve_runtime
    from eaglenest.draft.dflash_train import train_dflash
    from eaglenest.draft.train import train_draft

    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=["llama8b", "kimi"])
    p.add_argument("--seqs", type=int, default=40, help="sequences in the shard (one per step)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the median (compilation)")
    p.add_argument("--ttt", type=int, default=None, help="ttt_length (default: train's default)")
    p.add_argument("--dir", default=None, help="local directory for the shards (default: a temp dir)")
    p.add_argument("--out", default=None, help="directory for a JSON copy of the results")
    p.add_argument("--config", default="{}", help="training settings overrides as JSON, keyed as the checkpoint records them "
                   "(train: keys, the draft's shape keys and dflash: train_settings; labelled in the output; "
                   "the figures of issue 12 use none)")
    p.add_argument("--kind", default=None, choices=["eagle3", "eagle3.1", "peagle", "dflash"],
                   help="the draft kind (draft.kind; default: the training config's)")
    p.add_argument("--data", default=None, help="keep and reuse each size's shard, head and vocabulary under DATA/<size>")
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
    if a.kind:
        config["kind"] = a.kind
    resolved = resolve_runtime(train_settings(config), dev)
    kind = resolved.draft.kind
    results = []
    for size in a.sizes:
        H, I, nh, nkv, V = SIZES[size]
        DV = min(32000, V // 2)
        if kind in ("peagle", "dflash") and "mask_token_id" not in overrides:
            config["mask_token_id"] = V - 1  # any id of a random target; dflash has no default
        root = Path(tempfile.mkdtemp(prefix=f"e2e-{size}-", dir=a.dir))
        data_root = data_dir(a.data, size, a.seqs, a.seq) if a.data else None
        try:
            if data_root is None:
                data_root = Path(a.data) / size if a.data else root
                data_root.mkdir(parents=True, exist_ok=True)
                data = make_data(data_root, size, a.seqs, a.seq, dev)
                if a.data:
                    (data_root / "made.json").write_text(json.dumps({"size": size, "seqs": a.seqs, "seq": a.seq}))
            else:
                data = {"extract_s": None, "shard_gib": None, "data": f"reused {data_root}"}
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()  # the trainer's first logged window starts here
            trainer = train_dflash if kind == "dflash" else train_draft
            t0 = time.perf_counter()
            stats = trainer([data_root / "shard_0.safetensors"], data_root / "vocab.safetensors", root / "draft.safetensors",
                            root / "metrics.csv", head_path=data_root / "target_head.safetensors",
                            settings=train_settings(config).replace(device=dev), state_dir=root / "state", progress=False)
            wall = time.perf_counter() - t0
            rows = list(csv.DictReader(open(root / "metrics.csv")))
            after = [r for r in rows if int(r["step"]) > a.warmup]
            tok_s = statistics.median(float(r["tokens_per_s"]) for r in after)
            how = f"config overrides {json.dumps(overrides)}" if overrides else "default config"
            if kind == "dflash":
                ttt = resolved.draft.dflash.block_size - 1  # the slots drafted
                f = dflash_flops_per_token(H, I, nh, nkv, DV, a.seq, resolved)
                impl = (f"eaglenest train_dflash e2e ({how}: kind dflash, block {resolved.draft.dflash.block_size}, "
                        f"{resolved.draft.dflash.num_layers} layers, {resolved.dflash_anchors} anchors, dense block attention, "
                        f"bf16 autocast on CUDA, fp32 AdamW, freeze_lm_head={resolved.freeze_lm_head})")
            else:
                ttt = resolved.ttt_length
                f = flops_per_token(H, I, nh, nkv, DV, a.seq, ttt, head_trained=not resolved.freeze_lm_head)
                impl = (f"eaglenest train_draft e2e ({how}: kind {kind}, " + ", ".join(
                    f"{k}={getattr(resolved, k)}" for k in (*AUTO_KEYS, "bf16_weights", "fp8", "freeze_lm_head")) + ")")
            r = dict(impl=impl, kind=kind, size=size, seq=a.seq, ttt=ttt, steps=stats["steps"], tokens_per_s=round(tok_s),
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
