"""Training of the EAGLE-3 draft with training-time test (TTT), from hidden-state shards.

Straight-line loop: read a batch (memory-mapped shards), compute the target's distribution once
(``lm_head(last_hidden)``, restricted to the draft vocabulary), run the TTT forward, step AdamW.
A killed run resumes from ``state_dir/step_{n}.pt`` (model, optimizer, RNG, step; the data order
is a function of the seed, the epoch and the step), which lies outside the declared outputs and is
removed once the checkpoint is written. Under torchrun (WORLD_SIZE > 1) the batches are dealt to
the ranks in turn, gradients are averaged by DDP and rank 0 writes.
"""

import contextlib
import csv
import hashlib
import inspect
import io
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .config import defaults
from .hidden import HiddenShards
from .model import DraftConfig, Eagle3Draft
from .target import load_target_head, resolve_device
from .util import atomic_path, progress_bar, save_safetensors, say, write_atomic
from .vocab import load_vocab

CHECKPOINT_FORMAT = "eaglenest.draft/1"

# The schema's `train:` keys (less where the job runs) and draft.norm_before_residual; the schema
# documents each one and holds its default (the only place it is written).
DEFAULTS = {**{k: v for k, v in defaults("train").items() if k not in ("device", "gpus", "nproc")},
            "norm_before_residual": defaults("draft")["norm_before_residual"]}


def resolve_config(config):
    unknown = sorted(set(config or {}) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown training config keys {unknown}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **(config or {})}


def draft_config(info, draft_vocab_size, cfg) -> DraftConfig:
    """The draft's shape: the target's sizes unless the (resolved) training config overrides them."""
    keys = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "norm_before_residual")
    return DraftConfig.from_target(info, draft_vocab_size, **{k: cfg[k] for k in keys})


def epoch_batches(lengths, epoch, seed, batch_tokens, batch_size=None, window=1024):
    """Micro-batches (lists of sequence indices) of one epoch, a function of (seed, epoch) only.

    Shuffle, sort each window of ``window`` sequences by length (little padding), pack greedily so
    that sequences x longest <= batch_tokens, then shuffle the batches.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches = []
    for w in range(0, len(order), window):
        cur = []
        for k in sorted(order[w : w + window], key=lambda k: lengths[k]):
            longest = max(lengths[cur[-1]], lengths[k]) if cur else lengths[k]
            if cur and ((len(cur) + 1) * longest > batch_tokens or (batch_size and len(cur) >= batch_size)):
                batches.append(cur)
                cur = []
            cur.append(k)
        if cur:
            batches.append(cur)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def micro_batch_stream(lengths, cfg, start=0):
    """Endless ``(epoch, batch)`` over the epochs, from global micro-batch ``start`` on."""
    m, epoch = 0, 0
    while True:
        batches = epoch_batches(lengths, epoch, cfg["seed"], cfg["batch_tokens"], cfg["batch_size"])
        if m + len(batches) <= start:
            m += len(batches)
        else:
            for b in batches[max(0, start - m) :]:
                yield epoch, b
            m += len(batches)
        epoch += 1


def load_batch(shards, seq_ids):
    """Padded CPU tensors of some sequences: input_ids/loss_mask [B, T], aux [B, T, 3H], last [B, T, H]."""
    items = [shards[k] for k in seq_ids]
    B, T = len(items), max(len(it["input_ids"]) for it in items)
    out = {
        "input_ids": torch.zeros(B, T, dtype=torch.int64),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
        "aux_hidden": torch.zeros(B, T, items[0]["aux_hidden"].shape[1], dtype=items[0]["aux_hidden"].dtype),
        "last_hidden": torch.zeros(B, T, items[0]["last_hidden"].shape[1], dtype=items[0]["last_hidden"].dtype),
    }
    for b, it in enumerate(items):
        for name, t in it.items():
            out[name][b, : len(t)] = t
    return out


@torch.no_grad()
def target_distribution(last_hidden, loss_mask, lm_head_weight, draft_ids, t2d, max_elements=2**27):
    """The targets of ``model.ttt_loss``, from the target's post-norm last hidden state [B, T, H].

    Only positions q whose next token is a completion token are kept; logits over the full target
    vocabulary are made ``max_elements // vocab`` rows at a time.
    """
    B, T, H = last_hidden.shape
    pred = torch.zeros_like(loss_mask)
    pred[:, :-1] = loss_mask[:, 1:]  # position q predicts token q+1
    rows = pred.flatten().nonzero().squeeze(1)
    h = last_hidden.reshape(B * T, H)[rows]
    chunk = max(1, max_elements // lm_head_weight.shape[0])
    probs, argmax = [], []
    for s in range(0, len(rows), chunk):
        logits = (h[s : s + chunk].to(lm_head_weight.dtype) @ lm_head_weight.T).float()
        argmax.append(logits.argmax(-1))
        probs.append(torch.softmax(logits[:, draft_ids], dim=-1))
    if not probs:
        probs, argmax = [h.new_zeros(0, len(draft_ids), dtype=torch.float32)], [rows.new_zeros(0)]
    argmax = torch.cat(argmax)
    return {"rows": rows, "probs": torch.cat(probs), "argmax": argmax, "in_draft": t2d[argmax]}


def lr_at(step, cfg, total_steps):
    """Linear warmup to lr, then cosine to lr * min_lr_ratio (``step`` counts from 0)."""
    warmup = cfg["warmup_steps"] if cfg["warmup_steps"] is not None else max(1, round(0.05 * total_steps))
    if step < warmup:
        return cfg["lr"] * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return cfg["lr"] * (cfg["min_lr_ratio"] + (1 - cfg["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * progress)))


def _count_steps(lengths, cfg, world):
    if cfg["max_steps"]:
        return int(cfg["max_steps"])
    epochs = float(cfg["epochs"])  # may be fractional: the last epoch is then partly used
    counts = [len(epoch_batches(lengths, e, cfg["seed"], cfg["batch_tokens"], cfg["batch_size"])) for e in range(math.ceil(epochs))]
    micro = sum(counts[: int(epochs)]) + (round((epochs - int(epochs)) * counts[-1]) if epochs % 1 else 0)
    return max(1, micro // (cfg["grad_accum"] * world))


def _fingerprint(cfg, shards, vocab_path, head_path, world):
    # The global batch (micro-batches per optimizer step), not how it is split, identifies a run:
    # a state saved by 1 process x grad_accum 2 resumes under 2 processes x 1, and the reverse.
    facts = {
        "config": {k: v for k, v in cfg.items() if k not in ("grad_accum", "save_every", "keep_states")},
        "micro_batches_per_step": cfg["grad_accum"] * world,
        # Size and modification time, as make and Snakemake judge files: rewritten shards (even of the
        # same size) are other data. Hashing their content would read hundreds of GB at real scale.
        "shards": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in shards.paths],
        "vocab": hashlib.sha256(Path(vocab_path).read_bytes()).hexdigest(),
        "head": (Path(head_path).stat().st_size, Path(head_path).stat().st_mtime_ns),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def _state_files(state_dir):
    files = [(int(p.stem.split("_")[1]), p) for p in Path(state_dir).glob("step_*.pt") if p.stem.split("_")[1].isdigit()]
    return [p for _, p in sorted(files, reverse=True)]


def _save_state(state_dir, step, state, keep):
    with atomic_path(Path(state_dir) / f"step_{step}.pt", fsync=False) as tmp:
        torch.save(state, tmp)
    for old in _state_files(state_dir)[keep:]:
        old.unlink(missing_ok=True)


def _write_metrics(path, rows):
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, buf.getvalue())


def train_draft(hidden_paths, vocab_path, out_path, metrics_path, *, head_path, config=None, state_dir, device="auto", progress=True) -> dict:
    """Train the draft; write ``out_path`` (safetensors: the draft's vLLM tensors, config in the
    metadata) and ``metrics_path`` (CSV, one row per optimizer step). Returns a summary."""
    cfg = resolve_config(config)
    t_start = time.time()
    world, rank, local_rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(device)
    if device == "cuda" and world > 1:
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    own_group = world > 1 and not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    on_gpu = device.startswith("cuda")

    head, info = load_target_head(head_path)
    d2t, t2d = load_vocab(vocab_path)
    shards = HiddenShards(hidden_paths)
    if len(t2d) != info["vocab_size"]:
        raise ValueError(f"{vocab_path}: t2d covers {len(t2d)} tokens, the target ({head_path}) has {info['vocab_size']}")
    if shards.aux_layers != info["aux_layers"] or shards.hidden_size != info["hidden_size"]:
        raise ValueError(
            f"hidden shards (aux layers {shards.aux_layers}, hidden {shards.hidden_size}) do not match "
            f"{head_path} (aux layers {info['aux_layers']}, hidden {info['hidden_size']}): re-extract one or the other"
        )
    dcfg = draft_config(info, len(d2t), cfg)
    torch.manual_seed(cfg["seed"])
    model = Eagle3Draft(dcfg)
    model.attention = cfg["attention"]
    init = (head["lm_head.weight"], head["norm.weight"]) if cfg["init_from_target"] else ()
    model.set_target(head["embed_tokens.weight"].to(torch.bfloat16 if on_gpu else torch.float32), d2t, t2d, *init)
    model.to(device)
    lm_head_target = head["lm_head.weight"].to(device, torch.bfloat16 if on_gpu else torch.float32)
    del head
    draft_ids, t2d_dev = model.draft_ids(), model.t2d
    trainable = model
    if world > 1:
        # buffers (the frozen embedding, the vocab maps) are equal on every rank: no broadcast each step
        ddp = torch.nn.parallel.DistributedDataParallel
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(ddp).parameters else {"broadcast_buffers": False}
        trainable = ddp(model, device_ids=[local_rank] if on_gpu else None, **no_sync)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"])

    lengths = [shards.length(k) for k in range(len(shards))]
    total_steps = _count_steps(lengths, cfg, world)
    accum, J = cfg["grad_accum"], cfg["ttt_length"]
    fingerprint = _fingerprint(cfg, shards, vocab_path, head_path, world)
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)

    step, rows, resumed_from = 0, [], None
    for path in _state_files(state_dir):
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["fingerprint"] != fingerprint:
            say(f"train_draft: ignoring {path}, saved for other data or config")
            continue
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        if on_gpu and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        step, rows, resumed_from = state["step"], state["metrics"], state["step"]
        say(f"train_draft: resuming from {path} (step {step} of {total_steps})")
        break

    stream = micro_batch_stream(lengths, cfg, start=step * accum * world)
    n_tokens_total = 0
    bar = progress_bar(total=total_steps, initial=step, unit="step", desc="train_draft", disable=not progress or rank != 0)
    while step < total_steps:
        t0 = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, total_steps)
        sums = torch.zeros(J, 4, device=device)
        n_tok = torch.zeros((), device=device)
        for a in range(accum):
            for r in range(world):  # every rank walks the same stream and keeps its own batches
                epoch, batch_ids = next(stream)
                if r == rank:
                    mine = batch_ids
            batch = {k: v.to(device, non_blocking=True) for k, v in load_batch(shards, mine).items()}
            targets = target_distribution(batch["last_hidden"], batch["loss_mask"], lm_head_target, draft_ids, t2d_dev)
            aux = batch["aux_hidden"] if on_gpu else batch["aux_hidden"].float()
            sync = world == 1 or a == accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu):
                with trainable.no_sync() if not sync else contextlib.nullcontext():
                    loss, st = trainable(batch["input_ids"], aux, targets, ttt_length=J, decay=cfg["ttt_decay"], chunk=cfg["loss_chunk"])
                    (loss / accum).backward()
            sums += st
            n_tok += sum(lengths[k] for k in mine)
        if world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(n_tok)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        s = sums.cpu()
        ce = (s[:, 0] / s[:, 1].clamp(min=1)).tolist()
        acc = (s[:, 2] / s[:, 3].clamp(min=1)).tolist()
        seconds = time.time() - t0
        n_tokens_total += int(n_tok)
        row = {"step": step, "epoch": epoch, "lr": opt.param_groups[0]["lr"], "loss": sum(cfg["ttt_decay"] ** j * c for j, c in enumerate(ce))}
        row.update({f"loss_{j}": ce[j] for j in range(J)})
        row.update({f"acc_{j}": acc[j] for j in range(J)})
        row.update({"grad_norm": float(grad_norm), "tokens": int(n_tok), "tokens_per_s": int(n_tok) / seconds})
        rows.append(row)
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{acc[0]:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        if rank == 0 and step % cfg["save_every"] == 0 and step < total_steps:
            state = {
                "fingerprint": fingerprint,
                "step": step,
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(device) if on_gpu else None,
                "metrics": rows,
            }
            _save_state(state_dir, step, state, cfg["keep_states"])
    bar.close()

    seconds = time.time() - t_start
    last = rows[-1]
    stats = {
        "steps": step,
        "resumed_from": resumed_from,
        "tokens": n_tokens_total,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(n_tokens_total / seconds, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss": last["loss"],
        "acc": [last[f"acc_{j}"] for j in range(J)],
        "sequences": len(shards),
    }
    if rank == 0:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        metadata = {
            "format": CHECKPOINT_FORMAT,
            "draft_config": json.dumps(dcfg.to_dict()),
            "target": json.dumps(info),
            "train": json.dumps({**stats, "config": cfg}, default=str),
        }
        save_safetensors(tensors, out_path, metadata)
        _write_metrics(metrics_path, rows)
        for path in _state_files(state_dir):  # the run is complete: its resume points are not
            path.unlink(missing_ok=True)
    if own_group:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        say(
            f"train_draft: {step} steps, {n_tokens_total} tokens in {seconds:.1f} s ({stats['tokens_per_s']:.0f} tok/s), "
            f"loss {last['loss']:.4f}, acc@0 {stats['acc'][0]:.3f} acc@{J - 1} {stats['acc'][-1]:.3f} -> {out_path}"
        )
    return stats


def load_checkpoint(path):
    """``(tensors, draft_config, target_info, train_stats)`` of a train_draft checkpoint."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: not an eaglenest draft checkpoint (format {meta.get('format')!r})")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, DraftConfig(**json.loads(meta["draft_config"])), json.loads(meta["target"]), json.loads(meta["train"])


def main(argv=None):
    """`python -m eaglenest.train ...`: the entry point torchrun starts once per process."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m eaglenest.train")
    p.add_argument("--hidden", nargs="+", required=True)
    p.add_argument("--vocab", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--config", default="{}", help="the training config as JSON")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    train_draft(a.hidden, a.vocab, a.out, a.metrics, head_path=a.head, config=json.loads(a.config),
                state_dir=a.state_dir, device=a.device)


if __name__ == "__main__":
    main()
