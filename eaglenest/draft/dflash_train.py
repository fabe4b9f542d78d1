"""Training of the DFlash draft (``draft.kind: dflash``) on the same hidden-state shards as EAGLE-3: the
shards' ``aux_hidden`` (at ``draft.aux_layers``) are its context, their ``target_next`` its labels.

Straight-line loop: read a batch (the same packing and order as ``train.train_draft``, ``batches``), draw
its anchors, run the anchored blocks and their loss (``dflash.DFlashDraft.loss``), step AdamW. The
checkpoint, its metrics CSV (a column per block slot, ``loss_{i}``/``acc_{i}`` for slot i+1) and the drafts
kept along training are the ones ``train_draft`` writes, so export and the report read them the same way.
A killed run resumes as ``train_draft``'s does (``train.TrainRun``): from ``state_dir/step_{n}.pt`` every
``save_every`` steps, with the anchors' generator in it, so the resumed run ends with the same draft.

Not yet here (the EAGLE trainer has them): several processes, hidden.mode stream, and the GPU paths (flex
attention over the blocks, compile, the fused loss, FP8).
"""

import math
import os
import time

import torch

from ..settings import TrainSettings
from ..states.target import load_target_head, resolve_device
from ..util import progress_bar, say
from .batches import count_steps, load_batch, micro_batch_stream
from .checkpoint import draft_config, save_checkpoint, train_record
from .dflash import DFlashConfig, DFlashDraft, sample_anchors
from .metrics import Metrics, write_metrics
from .optim import clip_and_step
from .train import TrainRun, lr_at, open_states, run_fingerprint
from .vocab import load_vocab


def build_dflash(dcfg: DFlashConfig, settings: TrainSettings, head, d2t, t2d, device) -> DFlashDraft:
    """The draft on ``device``, seeded: the target's embedding installed (and the mask embedding started from
    its row), its head and norm from the target's where ``init_from_target``, lm_head frozen where
    ``freeze_lm_head`` (the peers' DFlash drafts use the target's head as is)."""
    torch.manual_seed(settings.seed)
    model = DFlashDraft(dcfg)
    init = (head["lm_head.weight"], head["norm.weight"]) if settings.init_from_target else ()
    model.set_target(head["embed_tokens.weight"].float(), d2t, t2d, *init)
    if settings.freeze_lm_head:
        model.lm_head.weight.requires_grad_(False)
    return model.to(device)


def dflash_step(model: DFlashDraft, opt, params, shards, batches, settings: TrainSettings, lr, generator, device):
    """One optimizer step over ``grad_accum`` micro-batches of ``batches`` (``micro_batch_stream``) -> (epoch,
    the summed loss stats [block_size - 1, 4], the gradient norm, tokens)."""
    for g in opt.param_groups:
        g["lr"] = lr
    accum, on_gpu = settings.grad_accum, device.startswith("cuda")
    sums = torch.zeros(model.config.block_size - 1, 4, device=device)
    tokens = 0
    for _ in range(accum):
        epoch, seq_ids = next(batches)
        batch = {k: v.to(device) for k, v in load_batch(shards, seq_ids).items()}
        anchors, valid = sample_anchors(batch["loss_mask"], settings.dflash_anchors, generator)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu):
            loss, stats = model.loss(batch["input_ids"], batch["aux_hidden"], batch["target_next"], batch["loss_mask"],
                                     anchors, valid, settings.dflash_gamma)
        (loss / accum).backward()
        sums += stats
        tokens += sum(shards.length(k) for k in seq_ids)
    norm = clip_and_step(opt, params, settings.clip)
    opt.zero_grad(set_to_none=True)
    return epoch, sums, norm, tokens


def _open(hidden_paths, vocab_path, head_path, stream):
    """``(head, facts, d2t, t2d, shards)``, or an error where this trainer cannot run on them."""
    if stream is not None:
        raise ValueError("draft.kind dflash trains from hidden shards only for now: set hidden.mode: files")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ValueError("draft.kind dflash trains in one process for now: set train.nproc: 1")
    head, info = load_target_head(head_path)
    d2t, t2d = load_vocab(vocab_path)
    shards = open_states(hidden_paths, None, info, t2d, vocab_path, head_path)
    if shards.without_target_next:
        raise ValueError(f"{shards.without_target_next[0]} has no target_next (an older eaglenest wrote it), which a "
                         "DFlash draft trains against: delete the hidden shards and extract them again")
    return head, info, d2t, t2d, shards


def train_dflash(hidden_paths, vocab_path, out_path, metrics_path, *, head_path, settings: TrainSettings, state_dir,
                 progress=True, stream=None, snapshot_paths=()) -> dict:
    """``train.train_draft`` for a DFlash draft (``settings.draft.kind``: dflash), with the same arguments and
    outputs, resuming the same way from ``state_dir``. Returns a summary."""
    t_start = time.time()
    device = resolve_device(settings.device)
    head, info, d2t, t2d, shards = _open(hidden_paths, vocab_path, head_path, stream)
    dcfg = draft_config(info, len(d2t), settings.draft)
    model = build_dflash(dcfg, settings, head, d2t, t2d, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    lengths = [shards.length(k) for k in range(len(shards))]
    total = count_steps(lengths, settings, 1)
    run = TrainRun.of(total, run_fingerprint(settings, shards, vocab_path, head_path, 1), state_dir, len(snapshot_paths), dcfg, info,
                      trainer="train_dflash")
    generator = torch.Generator().manual_seed(settings.seed)  # the anchors'
    start, rows, resumed_from = run.resume(model, opt, device, generator)
    say(f"train_dflash: {device}, {dcfg.num_hidden_layers} layers, block {dcfg.block_size}, mask token {dcfg.mask_token_id}, "
        f"{total} steps, lm_head {'frozen' if settings.freeze_lm_head else 'trained'}")
    bar = progress_bar(total=total, initial=start, unit="step", desc="train_dflash", disable=not progress)
    metrics = Metrics(rows, dcfg.block_size - 1, math.exp(-1 / settings.dflash_gamma), device, bar)
    batches = micro_batch_stream(lengths, settings, start=start * settings.grad_accum)
    for step in range(start + 1, total + 1):
        lr = lr_at(step - 1, settings, total)
        epoch, sums, norm, tokens = dflash_step(model, opt, params, shards, batches, settings, lr, generator, device)
        metrics.add(step, epoch, lr, sums, norm, tokens)
        save = step % settings.save_every == 0 and step < total
        keep = [f for s, f in run.snapshots if s == step]
        if save or keep or step % settings.log_every == 0 or step == total:
            metrics.flush()
        for path in keep:
            _save(path, model, dcfg, info, settings, _stats(metrics, step, run, resumed_from, t_start, model, shards))
        if save:
            run.save_point(step, model, opt, device, metrics.rows, settings.keep_states, generator)
    bar.close()
    stats = _stats(metrics, total, run, resumed_from, t_start, model, shards)
    _save(out_path, model, dcfg, info, settings, stats)
    write_metrics(metrics_path, metrics.rows)
    run.finish(snapshot_paths)
    say(f"train_dflash: {total} steps{f' (resumed from step {resumed_from})' if resumed_from else ''}, {metrics.tokens} tokens "
        f"in {stats['seconds']:.1f} s, loss {stats['loss']:.4f}, acc@1 {stats['acc'][0]:.3f} "
        f"acc@{dcfg.block_size - 1} {stats['acc'][-1]:.3f} -> {out_path}")
    return stats


def _stats(metrics: Metrics, step, run: TrainRun, resumed_from, t_start, model, shards) -> dict:
    """The run's summary at ``step`` (it goes into the checkpoint too): ``acc`` per block slot 1 .. block_size-1;
    ``tokens`` the run's, ``tokens_per_s`` this process's."""
    last, seconds = metrics.rows[-1], time.time() - t_start
    return {"steps": step, "of_steps": run.total_steps, "resumed_from": resumed_from,
            "tokens": sum(int(r["tokens"]) for r in metrics.rows), "seconds": round(seconds, 2),
            "tokens_per_s": round(metrics.tokens / seconds, 1), "parameters": sum(p.numel() for p in model.parameters()),
            "loss": last["loss"], "acc": [last[f"acc_{j}"] for j in range(run.dcfg.block_size - 1)], "sequences": len(shards)}


def _save(path, model, dcfg, info, settings, stats):
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_checkpoint(path, tensors, dcfg, info, {**stats, "config": train_record(settings)})
