"""Training of the EAGLE-3 draft with training-time test (TTT), from hidden-state shards.

Straight-line loop: read a batch (memory-mapped shards), compute the target's distribution once
(``lm_head(last_hidden)``, restricted to the draft vocabulary: only the draft-vocabulary rows of the
target's head are on the device, the target's greedy token comes from the shard's ``target_next``),
run the TTT forward, step AdamW.
In ``hidden.mode: stream`` the shards are a ``stream.StreamedStates`` instead: the same sequences,
their states fetched from the extraction server ahead of the loader (it is told the order), so the
batches, and the draft, are those files mode makes from the shards. A killed run resumes from ``state_dir/step_{n}.pt`` (model, optimizer, RNG, step; the data order
is a function of the seed, the epoch and the step), which lies outside the declared outputs and is
removed once the checkpoint is written. The drafts kept along training (``snapshots``: at equal parts of
the run, for the report's learning curve) are written there too, named by the run, and moved to their
outputs at the end, so a resumed run still has the ones it passed before it was killed. Under torchrun (WORLD_SIZE > 1) the batches are dealt to
the ranks in turn, gradients are averaged by DDP and rank 0 writes.
"""

import contextlib
import dataclasses
import hashlib
import inspect
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..settings import TrainSettings
from ..states.shards import HiddenShards
from ..states.source import StateSource
from ..states.target import TargetFacts, load_target_head
from ..util import atomic_path, progress_bar, say
from .batches import BatchLoader, count_steps, run_shapes
from .checkpoint import draft_config, save_checkpoint, train_record
from .config import DraftConfig
from .dflash import DFlashConfig
from .device import configure_compile, resolve_runtime, start_process
from .fp8 import use_fp8
from .metrics import Metrics, write_metrics
from .model import Eagle3Draft
from .optim import MasterAdamW, clip_and_step
from .runtime import Runtime
from .targets import target_distribution, target_head_rows
from .vocab import load_vocab


def make_optimizer(model, settings: TrainSettings, on_gpu):
    """AdamW over ``model``'s trainable parameters. With ``bf16_weights`` the model's parameters are
    cast to bf16 here, after ``optim.MasterAdamW`` took their fp32 values as its masters (its float
    buffers, the rope frequencies, stay fp32); call it before wrapping the model in DDP."""
    params = [p for p in model.parameters() if p.requires_grad]
    betas = (0.9, 0.95)  # MasterAdamW's bf16 moments rely on beta2 well below 1 - 2**-8
    if not settings.bf16_weights:
        return torch.optim.AdamW(params, lr=settings.lr, betas=betas, weight_decay=settings.weight_decay, **({"fused": True} if on_gpu else {}))
    opt = MasterAdamW(params, lr=settings.lr, betas=betas, weight_decay=settings.weight_decay)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return opt


def lr_at(step, settings: TrainSettings, total_steps):
    """Linear warmup to lr, then cosine to lr * min_lr_ratio (``step`` counts from 0)."""
    warmup = settings.warmup_steps if settings.warmup_steps is not None else max(1, round(0.05 * total_steps))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return settings.lr * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def run_fingerprint(settings: TrainSettings, shards, vocab_path, head_path, world):
    """What a run's resume points are saved under (``TrainRun``): a hash of its data, vocabulary, head and config."""
    # The global batch (micro-batches per optimizer step), not how it is split, identifies a run:
    # a state saved by 1 process x grad_accum 2 resumes under 2 processes x 1, and the reverse.
    # ``settings``: resolve_runtime's, recorded as the checkpoint records them (train_record).
    facts = {
        "config": {k: v for k, v in train_record(settings).items() if k not in ("grad_accum", "save_every", "keep_states", "snapshots")},
        "micro_batches_per_step": settings.grad_accum * world,
        "shards": shards.fingerprint_facts(),
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


def open_states(hidden_paths, stream, info, t2d, vocab_path, head_path) -> StateSource:
    """The sequences to train on: the hidden shards, or (``stream``) the extraction server's states,
    checked against the target's head and the vocabulary."""
    if stream is not None:
        from ..states.stream import open_stream

        shards = open_stream(stream)
    else:
        shards = HiddenShards(hidden_paths)
    if len(t2d) != info.vocab_size:
        raise ValueError(f"{vocab_path}: t2d covers {len(t2d)} tokens, the target ({head_path}) has {info.vocab_size}")
    if shards.aux_layers != info.aux_layers or shards.hidden_size != info.hidden_size:
        raise ValueError(
            f"hidden shards (aux layers {shards.aux_layers}, hidden {shards.hidden_size}) do not match "
            f"{head_path} (aux layers {info.aux_layers}, hidden {info.hidden_size}): re-extract one or the other"
        )
    return shards


def snapshot_steps(total_steps: int, n: int) -> list[int]:
    """The steps at which the ``n`` drafts along training are kept: equal parts of the run (a third and
    two thirds of it with n = 2), never step 0 (the final draft is the checkpoint itself)."""
    return [max(1, round(total_steps * (i + 1) / (n + 1))) for i in range(n)]


def _snapshot_file(state_dir, fingerprint, i):
    """Where the ``i``-th draft along training waits in ``state_dir`` until the run ends (named by the run)."""
    return Path(state_dir) / f"curve_{fingerprint[:16]}_{i}.safetensors"


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What every optimizer step of a run reads (``train_step``): the same objects from the first step to the last."""

    trainable: torch.nn.Module
    """The model, or its DDP wrapper under several processes: what the forward and backward run through."""
    model: Eagle3Draft
    """The draft itself (its weights' dtype is what the aux states are cast to on CPU)."""
    opt: torch.optim.Optimizer
    """``make_optimizer``'s optimizer over ``params``."""
    params: list
    """The trainable parameters, whose gradient norm is clipped."""
    loader: BatchLoader
    """This rank's micro-batches, on the device."""
    head: tuple
    """The target's (lm_head rows, draft ids, t2d) on the device, as ``target_distribution`` takes them."""
    settings: TrainSettings
    """The run's settings, their "auto" code paths resolved (``device.resolve_runtime``)."""
    world: int
    """Processes training together (DDP under more than one)."""
    device: str
    """This process's device ("cpu", "cuda:N")."""


def train_step(inputs: StepInputs, lr):
    """One optimizer step at learning rate ``lr`` over ``grad_accum`` micro-batches -> (epoch, the
    summed loss stats [J, 4] on the device, all ranks', the gradient norm, this rank's tokens)."""
    settings, world, opt = inputs.settings, inputs.world, inputs.opt
    on_gpu, accum, J = inputs.device.startswith("cuda"), settings.grad_accum, settings.ttt_length
    for g in opt.param_groups:
        g["lr"] = lr
    sums = torch.zeros(J, 4, device=inputs.device)
    n_tok = 0
    for a in range(accum):
        epoch, tokens, batch = inputs.loader.next()
        targets = target_distribution(batch["last_hidden"], batch["loss_mask"], *inputs.head, rows=batch["rows"],
                                      target_next=batch.get("target_next"))
        if "plan" in batch:
            targets["plan"] = batch["plan"]
        aux = batch["aux_hidden"] if on_gpu else batch["aux_hidden"].to(inputs.model.fc.weight.dtype)  # no autocast on CPU
        sync = world == 1 or a == accum - 1
        with inputs.trainable.no_sync() if not sync else contextlib.nullcontext():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu):
                loss, st = inputs.trainable(batch["input_ids"], aux, targets, ttt_length=J, decay=settings.ttt_decay,
                                            chunk=settings.loss_chunk, embeds=batch["embeds"])
            # backward outside autocast: its cache of bf16 weight copies is gone by then
            (loss / accum).backward()
        sums += st.detach()
        n_tok += tokens
    if world > 1:
        dist.all_reduce(sums)
    grad_norm = clip_and_step(opt, inputs.params, settings.clip)
    opt.zero_grad(set_to_none=True)
    return epoch, sums, grad_norm, n_tok


def _build_draft(dcfg, settings, head, d2t, t2d, device, world):
    """The draft on ``device`` -> (model, the target's embedding table in host memory): seeded, its head and
    norm from the target's where ``init_from_target``, its lm_head frozen where ``freeze_lm_head``, its
    products FP8 where ``fp8``."""
    torch.manual_seed(settings.seed)
    model = Eagle3Draft(dcfg, runtime=Runtime.from_settings(settings, world))
    init = (head["lm_head.weight"], head["norm.weight"]) if settings.init_from_target else ()
    # The target's embedding stays in host memory: the loader looks up each batch's rows there
    # (a [V, H] table on the GPU would cost 1-2 GiB at real sizes for a few MB of rows a step).
    embed_table = head["embed_tokens.weight"].to(torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model.set_target(embed_table, d2t, t2d, *init, keep_embedding=False)  # a P-EAGLE draft keeps its mask token's row
    if settings.freeze_lm_head:
        model.lm_head.weight.requires_grad_(False)
    model.to(device)
    if settings.fp8:  # before the step compiles; the weights stay the same bf16 parameters
        use_fp8(model)
    return model, embed_table


def _wrap_ddp(model, world, local_rank, on_gpu):
    """What the steps run through: ``model`` itself in one process, else its DDP wrapper."""
    if world == 1:
        return model
    # buffers (the frozen embedding, the vocab maps) are equal on every rank: no broadcast each step
    ddp = torch.nn.parallel.DistributedDataParallel
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(ddp).parameters else {"broadcast_buffers": False}
    return ddp(model, device_ids=[local_rank] if on_gpu else None, **no_sync)


def _describe_runtime(settings, runtime: Runtime) -> str:
    """How this run trains, for the log's first line."""
    return (f"attention {settings.attention}, recompute {settings.recompute}, fused loss {settings.fused_loss}, bf16 weights "
            f"{settings.bf16_weights}, fp8 products {settings.fp8}, step grads split {runtime.split_step_grads}, diagonal split "
            f"{settings.diag_split}, unscored positions skipped {settings.skip_unscored}, lm_head "
            f"{'frozen' if settings.freeze_lm_head else 'trained'}")


def _prepare_compile(lengths, settings, start, remaining, world) -> str:
    """Let dynamo compile one graph per batch shape of the rest of the run (``configure_compile``) -> the log's note."""
    shapes = run_shapes(lengths, settings, start, remaining, world)
    configure_compile(shapes)
    return f", compiled ({len(shapes)} batch shape{'s' if len(shapes) != 1 else ''}: one graph each)"


@dataclasses.dataclass(frozen=True)
class TrainRun:
    """Where a run stands and what its checkpoints carry; its resume points and the drafts kept along training
    wait in ``state_dir`` until it ends. Both trainers' (this module's and ``dflash_train``'s)."""

    total_steps: int
    fingerprint: str
    """``run_fingerprint``: the data and config the resume points were saved for."""
    state_dir: Path
    snapshots: list
    """(step, file in ``state_dir``) of each draft kept along training."""
    dcfg: DraftConfig | DFlashConfig
    """The draft's ``checkpoint.draft_config``."""
    info: TargetFacts
    """The target's facts (``target.load_target_head``)."""
    trainer: str = "train_draft"
    """What the log lines are prefixed with."""

    @classmethod
    def of(cls, total_steps, fingerprint, state_dir, n_snapshots, dcfg, info, trainer="train_draft"):
        """The run's facts, its ``state_dir`` made, its ``n_snapshots`` drafts along training placed (``snapshot_steps``)."""
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        snapshots = [(s, _snapshot_file(state_dir, fingerprint, i)) for i, s in enumerate(snapshot_steps(total_steps, n_snapshots))]
        return cls(total_steps, fingerprint, state_dir, snapshots, dcfg, info, trainer)

    def resume(self, model, opt, device, generator=None):
        """Load the newest resume point of this run (same fingerprint, and every draft kept along training before
        it still there) into ``model``, ``opt`` and the RNGs (``generator`` too, where given) -> (step, metrics
        rows so far, the step resumed from or None)."""
        for path in _state_files(self.state_dir):
            state = torch.load(path, map_location="cpu", weights_only=True)
            if state["fingerprint"] != self.fingerprint:
                say(f"{self.trainer}: ignoring {path}, saved for other data or config")
                continue
            lost = [str(f) for s, f in self.snapshots if s <= state["step"] and not Path(f).exists()]
            if lost:
                say(f"{self.trainer}: ignoring {path}: the draft(s) kept along training before it are gone ({', '.join(lost)})")
                continue
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])
            if device.startswith("cuda") and state.get("cuda_rng") is not None:
                torch.cuda.set_rng_state(state["cuda_rng"], device)
            if generator is not None:
                generator.set_state(state["generator"])
            say(f"{self.trainer}: resuming from {path} (step {state['step']} of {self.total_steps})")
            return state["step"], state["metrics"], state["step"]
        return 0, [], None

    def save_point(self, step, model, opt, device, rows, keep, generator=None):
        """What a killed run resumes from (``resume``), in ``state_dir``; ``keep``: how many of them stay."""
        state = {
            "fingerprint": self.fingerprint,
            "step": step,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.startswith("cuda") else None,
            "metrics": rows,
        }
        if generator is not None:
            state["generator"] = generator.get_state()
        _save_state(self.state_dir, step, state, keep)

    def finish(self, snapshot_paths):
        """The drafts kept along training moved to ``snapshot_paths``, the run's resume points (and other runs'
        drafts) removed: the run is complete, its outputs written."""
        for (_, kept), dest in zip(self.snapshots, snapshot_paths):
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            os.replace(kept, dest)
        for path in [*_state_files(self.state_dir), *Path(self.state_dir).glob("curve_*.safetensors")]:
            path.unlink(missing_ok=True)


def _keep_snapshot(path, inputs: StepInputs, run: TrainRun, step, rows):
    """The draft at ``step`` as a checkpoint at ``path`` (one of the drafts kept along training)."""
    J = inputs.settings.ttt_length
    stats = {"step": step, "of_steps": run.total_steps, "tokens": sum(int(r["tokens"]) for r in rows),
             "loss": rows[-1]["loss"], "acc": [rows[-1][f"acc_{j}"] for j in range(J)]}
    _save_weights(path, inputs.model, inputs.opt, inputs.settings, run.dcfg, run.info, stats)


def _train_steps(inputs: StepInputs, run: TrainRun, step, metrics: Metrics, rank) -> int:
    """The optimizer steps from ``step`` to the run's last (the loader closed after them); rank 0 keeps
    the drafts along training and the resume points as it passes them -> the step reached."""
    settings, total_steps = inputs.settings, run.total_steps
    try:
        while step < total_steps:
            lr = lr_at(step, settings, total_steps)
            epoch, sums, grad_norm, tokens = train_step(inputs, lr)
            step += 1
            metrics.add(step, epoch, lr, sums, grad_norm, tokens)
            save = rank == 0 and step % settings.save_every == 0 and step < total_steps
            keep = [f for s, f in run.snapshots if s == step and rank == 0]
            if save or keep or step % settings.log_every == 0 or step == total_steps:
                metrics.flush()
            for path in keep:
                _keep_snapshot(path, inputs, run, step, metrics.rows)
            if save:
                run.save_point(step, inputs.model, inputs.opt, inputs.device, metrics.rows, settings.keep_states)
    finally:
        inputs.loader.close()
    return step


def _run_stats(step, resumed_from, metrics: Metrics, seconds, model, shards, J, stream) -> dict:
    """``train_draft``'s summary (it goes into the checkpoint too)."""
    last = metrics.rows[-1]
    stats = {
        "steps": step,
        "resumed_from": resumed_from,
        "tokens": metrics.tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(metrics.tokens / seconds, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss": last["loss"],
        "acc": [last[f"acc_{j}"] for j in range(J)],
        "sequences": len(shards),
    }
    if stream is not None:
        stats["stream"] = {**shards.counts, "peak_disk_bytes": shards.peak_bytes, "wait_s": round(shards.t_wait, 2)}
    return stats


def _write_outputs(inputs: StepInputs, run: TrainRun, stats, rows, out_path, metrics_path, snapshot_paths):
    """The checkpoint, the metrics and the drafts kept along training at their outputs (``TrainRun.finish``)."""
    _save_weights(out_path, inputs.model, inputs.opt, inputs.settings, run.dcfg, run.info, stats)
    write_metrics(metrics_path, rows)
    run.finish(snapshot_paths)


def train_draft(hidden_paths, vocab_path, out_path, metrics_path, *, head_path, settings: TrainSettings, state_dir, progress=True,
                stream=None, snapshot_paths=()) -> dict:
    """Train the draft; write ``out_path`` (safetensors: the draft's vLLM tensors, config in the
    metadata) and ``metrics_path`` (CSV, one row per optimizer step). Returns a summary.

    ``snapshot_paths``: one checkpoint per path, of the draft at equal parts of the run (``snapshot_steps``),
    in ``out_path``'s format with the step and tokens so far in its statistics.

    ``stream`` (``stream.open_stream``'s settings; ``hidden_paths`` is then unused): take the states
    from the extraction server instead of shards. ``settings``: the run's (``TrainSettings``; it runs on their
    ``device``, and their draft's shape is the draft's).
    A DFlash draft (kind dflash) trains with ``dflash_train.train_dflash`` instead, which builds on this module."""
    if settings.draft.kind == "dflash":
        raise ValueError("train_draft trains EAGLE-3 drafts: a DFlash draft (draft.kind dflash) trains with "
                         "eaglenest.draft.dflash_train.train_dflash, same arguments")
    t_start = time.time()
    world, rank, local_rank, device, own_group = start_process(settings.device)
    on_gpu = device.startswith("cuda")

    # the target's head and vocabulary, the states, the model and its optimizer
    head, info = load_target_head(head_path)
    d2t, t2d = load_vocab(vocab_path)
    shards = open_states(hidden_paths, stream, info, t2d, vocab_path, head_path)
    settings = resolve_runtime(settings, device)
    dcfg = draft_config(info, len(d2t), settings.draft)
    model, embed_table = _build_draft(dcfg, settings, head, d2t, t2d, device, world)
    draft_ids = model.draft_ids()
    target = (target_head_rows(head, shards, draft_ids, info, device, rank), draft_ids, model.t2d)
    del head
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(model, settings, on_gpu)
    trainable = _wrap_ddp(model, world, local_rank, on_gpu)

    # where this run stands: its steps, and the resume point it left if it was killed
    lengths = [shards.length(k) for k in range(len(shards))]
    total_steps = count_steps(lengths, settings, world)
    accum, J = settings.grad_accum, settings.ttt_length
    run = TrainRun.of(total_steps, run_fingerprint(settings, shards, vocab_path, head_path, world), state_dir, len(snapshot_paths), dcfg, info)
    step, rows, resumed_from = run.resume(model, opt, device)

    remaining = (total_steps - step) * accum  # micro-batches this rank still trains on
    how = _describe_runtime(settings, model.runtime)
    if settings.compile:
        how += _prepare_compile(lengths, settings, step * accum * world, remaining, world)
    if rank == 0:
        say(f"train_draft: {device}, {how}")
    loader = BatchLoader(shards, lengths, settings, start=step * accum * world, count=remaining, rank=rank, world=world,
                         device=device, ttt_length=J, embed_table=embed_table, runtime=model.runtime)
    inputs = StepInputs(trainable, model, opt, params, loader, target, settings, world, device)

    # the loop
    bar = progress_bar(total=total_steps, initial=step, unit="step", desc="train_draft", disable=not progress or rank != 0)
    metrics = Metrics(rows, settings.ttt_length, settings.ttt_decay, device, bar)
    step = _train_steps(inputs, run, step, metrics, rank)
    metrics.flush()
    if stream is not None:
        say(shards.summary())
    bar.close()

    # the outputs
    seconds = time.time() - t_start
    stats = _run_stats(step, resumed_from, metrics, seconds, model, shards, J, stream)
    if rank == 0:
        _write_outputs(inputs, run, stats, rows, out_path, metrics_path, snapshot_paths)
    if own_group:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        say(f"train_draft: {step} steps, {metrics.tokens} tokens in {seconds:.1f} s ({stats['tokens_per_s']:.0f} tok/s), "
            f"loss {stats['loss']:.4f}, acc@0 {stats['acc'][0]:.3f} acc@{J - 1} {stats['acc'][-1]:.3f} -> {out_path}")
    return stats


def _save_weights(path, model, opt, settings, dcfg, info, stats) -> None:
    """The draft's weights now (the fp32 masters under bf16 weights) as a checkpoint with ``stats``."""
    weights = opt.master_state_dict(model) if settings.bf16_weights else model.state_dict()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    save_checkpoint(path, tensors, dcfg, info, {**stats, "config": train_record(settings)})
