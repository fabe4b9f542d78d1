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

from ..states.shards import HiddenShards
from ..states.source import StateSource
from ..settings import TrainSettings
from ..states.target import TargetFacts, load_target_head, resolve_device
from ..util import atomic_path, progress_bar, say
from .batches import BatchLoader, count_steps, loss_rows, run_shapes
from .checkpoint import draft_config, resolve_config, save_checkpoint
from .config import DraftConfig
from .fp8 import resolve_fp8, use_fp8
from .metrics import Metrics, write_metrics
from .model import Eagle3Draft, Runtime
from .optim import MasterAdamW, clip_and_step
from .vocab import load_vocab

AUTO_KEYS = ("attention", "compile", "recompute", "fused_loss", "split_step_grads", "diag_split", "skip_unscored")  # the model's settings (model.Runtime)
FLEX_ONLY = ("split_step_grads", "diag_split")  # AUTO_KEYS that only the flex path has


def resolve_runtime(cfg, device, capability=None):
    """``cfg`` with the "auto" entries of AUTO_KEYS made concrete for ``device`` ("cuda..."/"cpu").

    On CUDA: flex attention, compiled, fused loss, bf16 weights (fp32 masters), recomputed only with
    a trained lm_head, FP8 products where the GPU has them (``fp8.resolve_fp8``; ``capability``: the
    GPU's, default the device's own). Elsewhere: the dense mask and none of the rest. An explicit choice the device cannot run raises (no silent fallback to a slow path)."""
    cuda = str(device).startswith("cuda")
    out = dict(cfg)
    if out["attention"] == "auto":
        out["attention"] = "flex" if cuda else "sdpa"
    if out["compile"] == "auto":
        out["compile"] = cuda and out["attention"] == "flex"
    if out["fused_loss"] == "auto":
        out["fused_loss"] = cuda
    if out["bf16_weights"] == "auto":
        out["bf16_weights"] = cuda
    if out["recompute"] == "auto":
        # Recomputing the TTT steps costs FLOPs and saves less memory than a trained lm_head's gradient
        # and AdamW state take (benchmarks/RESULTS.md, "Figures moved out of code comments"), so
        # recompute only then (the default freezes it: see freeze_lm_head in the schema).
        out["recompute"] = cuda and not out["freeze_lm_head"]
    for key in FLEX_ONLY:
        if out[key] == "auto":
            out[key] = cuda and out["attention"] == "flex"
    if out["skip_unscored"] == "auto":
        out["skip_unscored"] = bool(out["diag_split"])
    out["fp8"] = resolve_fp8(out["fp8"], device, capability)
    if out["attention"] not in ("sdpa", "flex"):
        raise ValueError(f"train.attention must be auto, sdpa or flex, got {out['attention']!r}")
    for key in ("compile", "recompute", "fused_loss", "bf16_weights", *FLEX_ONLY, "skip_unscored"):
        if not isinstance(out[key], bool):
            raise ValueError(f"train.{key} must be auto, true or false, got {out[key]!r}")
    if out["compile"] and (not cuda or out["attention"] != "flex"):
        raise ValueError(
            f"train.compile: true needs attention: flex on a CUDA device (here attention {out['attention']!r} on "
            f"{device}): flex attention has no backward on CPU; set compile: auto or false"
        )
    for key in FLEX_ONLY:
        if out[key] and out["attention"] != "flex":
            raise ValueError(f"train.{key}: true needs attention: flex (here {out['attention']!r}); set it to auto or false")
    if out["skip_unscored"] and not out["diag_split"]:
        raise ValueError("train.skip_unscored: true needs diag_split (the later TTT steps' keys attended on the diagonal); "
                         "set diag_split to auto or true, or skip_unscored to auto or false")
    return out


def target_distribution(last_hidden, loss_mask, lm_head_weight, draft_ids, t2d, max_elements=2**27, rows=None,
                        target_next=None):
    """The targets of ``model.ttt_loss``, from the target's post-norm last hidden state [B, T, H].

    Only positions q whose next token is a completion token are kept (``rows``: ``loss_rows`` of
    ``loss_mask``, when already made on the host): ``probs`` (softmax over the draft vocabulary),
    ``argmax`` (the target's greedy token, a target id) and ``in_draft`` (it is in the draft
    vocabulary: the position carries loss).

    With ``target_next`` [B, T] (the shard's greedy tokens), ``lm_head_weight`` is the draft
    vocabulary's rows of the target's head only ([Vd, H], ``lm_head[draft_ids]``): the argmax comes
    from ``target_next``. Without it (shards written before it existed) ``lm_head_weight`` is the
    full head [V, H] and the argmax is taken over the full vocabulary here. Logits are made
    ``max_elements // rows of the head`` rows at a time.
    """
    B, T, H = last_hidden.shape
    if target_next is not None and lm_head_weight.shape[0] != len(draft_ids):
        raise ValueError(f"target_distribution: with target_next the head must be the draft vocabulary's "
                         f"{len(draft_ids)} rows, got {lm_head_weight.shape[0]}")
    if rows is None:
        rows = loss_rows(loss_mask)
    h = last_hidden.reshape(B * T, H)[rows]
    chunk = max(1, max_elements // lm_head_weight.shape[0])
    probs, argmax = [], []
    for s in range(0, len(rows), chunk):
        logits = (h[s : s + chunk].to(lm_head_weight.dtype) @ lm_head_weight.T).float()
        if target_next is None:
            argmax.append(logits.argmax(-1))
            logits = logits[:, draft_ids]
        probs.append(torch.softmax(logits, dim=-1))
    if not probs:
        probs = [h.new_zeros(0, len(draft_ids), dtype=torch.float32)]
    if target_next is not None:
        argmax = target_next.reshape(B * T)[rows].long()
    else:
        argmax = torch.cat(argmax) if argmax else rows.new_zeros(0)
    return {"rows": rows, "probs": torch.cat(probs), "argmax": argmax, "in_draft": t2d[argmax]}


def make_optimizer(model, cfg, on_gpu):
    """AdamW over ``model``'s trainable parameters. With ``bf16_weights`` the model's parameters are
    cast to bf16 here, after ``optim.MasterAdamW`` took their fp32 values as its masters (its float
    buffers, the rope frequencies, stay fp32); call it before wrapping the model in DDP."""
    params = [p for p in model.parameters() if p.requires_grad]
    betas = (0.9, 0.95)  # MasterAdamW's bf16 moments rely on beta2 well below 1 - 2**-8
    if not cfg["bf16_weights"]:
        return torch.optim.AdamW(params, lr=cfg["lr"], betas=betas, weight_decay=cfg["weight_decay"], **({"fused": True} if on_gpu else {}))
    opt = MasterAdamW(params, lr=cfg["lr"], betas=betas, weight_decay=cfg["weight_decay"])
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return opt


def lr_at(step, cfg, total_steps):
    """Linear warmup to lr, then cosine to lr * min_lr_ratio (``step`` counts from 0)."""
    warmup = cfg["warmup_steps"] if cfg["warmup_steps"] is not None else max(1, round(0.05 * total_steps))
    if step < warmup:
        return cfg["lr"] * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return cfg["lr"] * (cfg["min_lr_ratio"] + (1 - cfg["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * progress)))


def configure_compile(shapes):
    """Let dynamo compile one graph of the TTT step per batch shape of the run, and fail past that
    instead of silently running the rest eagerly (its default once the recompile limit is hit)."""
    import torch._dynamo

    c = torch._dynamo.config
    needed = len(shapes) + 2  # + margin: the first call of a shape can compile twice (guards)
    needed *= 2  # step 0 may differ in dtype from the later steps (norm_before_residual: an fp32 residual)

    def key(*names):  # the name this torch knows (2.6 renamed cache_size -> recompile)
        for name in names:
            if hasattr(c, name):
                return name
        raise RuntimeError(f"torch {torch.__version__}: torch._dynamo.config has none of {names}; train with compile: false")

    limit, total = key("recompile_limit", "cache_size_limit"), key("accumulated_recompile_limit", "accumulated_cache_size_limit")
    setattr(c, limit, max(getattr(c, limit), needed))
    setattr(c, total, max(getattr(c, total), 4 * needed))
    setattr(c, key("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"), True)


def _fingerprint(cfg, shards, vocab_path, head_path, world):
    # The global batch (micro-batches per optimizer step), not how it is split, identifies a run:
    # a state saved by 1 process x grad_accum 2 resumes under 2 processes x 1, and the reverse.
    facts = {
        "config": {k: v for k, v in cfg.items() if k not in ("grad_accum", "save_every", "keep_states", "snapshots")},
        "micro_batches_per_step": cfg["grad_accum"] * world,
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


def start_process(device):
    """This process's place in a torchrun launch -> (world, rank, local_rank, device, own_group):
    under WORLD_SIZE > 1 each rank takes its own GPU, and joins a process group (``own_group``: made
    here, so destroyed here)."""
    world, rank, local_rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(device)
    if device == "cuda" and world > 1:
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    own_group = world > 1 and not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return world, rank, local_rank, device, own_group


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


def target_head_rows(head, shards, draft_ids, info, device, rank):
    """The target's lm_head on the device, as ``target_distribution`` takes it: the draft
    vocabulary's rows [Vd, H], or the full head [V, H] for shards without ``target_next``."""
    head_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if not shards.without_target_next:  # only the draft vocabulary's rows of the head: [Vd, H], contiguous
        return head["lm_head.weight"][draft_ids.cpu()].to(device, head_dtype).contiguous()
    # Shards from before target_next: the old path, the argmax over the full vocabulary each step
    # (the full head on the device). Kept so that shards that cost GPU hours stay usable.
    if rank == 0:
        say(f"train_draft: {len(shards.without_target_next)} shard(s) have no target_next (written by an older "
            f"eaglenest, e.g. {shards.without_target_next[0]}): the target's argmax is taken over its full "
            f"vocabulary of {info.vocab_size} each step, which is slower and keeps the whole lm_head "
            "on the device; delete and re-extract the shards to train on the fast path")
    return head["lm_head.weight"].to(device, head_dtype)


def snapshot_steps(total_steps: int, n: int) -> list[int]:
    """The steps at which the ``n`` drafts along training are kept: equal parts of the run (a third and
    two thirds of it with n = 2), never step 0 (the final draft is the checkpoint itself)."""
    return [max(1, round(total_steps * (i + 1) / (n + 1))) for i in range(n)]


def _snapshot_file(state_dir, fingerprint, i):
    """Where the ``i``-th draft along training waits in ``state_dir`` until the run ends (named by the run)."""
    return Path(state_dir) / f"curve_{fingerprint[:16]}_{i}.safetensors"


def resume(state_dir, fingerprint, model, opt, device, total_steps, snapshots=()):
    """Load the newest resume point of this run in ``state_dir`` (same data and config, and every draft kept
    along training before it still there; ``snapshots``: their (step, file)) into ``model`` and ``opt``
    -> (step, metrics rows so far, the step resumed from or None)."""
    for path in _state_files(state_dir):
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["fingerprint"] != fingerprint:
            say(f"train_draft: ignoring {path}, saved for other data or config")
            continue
        lost = [str(f) for s, f in snapshots if s <= state["step"] and not Path(f).exists()]
        if lost:
            say(f"train_draft: ignoring {path}: the draft(s) kept along training before it are gone ({', '.join(lost)})")
            continue
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        if device.startswith("cuda") and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        say(f"train_draft: resuming from {path} (step {state['step']} of {total_steps})")
        return state["step"], state["metrics"], state["step"]
    return 0, [], None


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
    cfg: dict
    """The training config, its "auto" entries resolved (``resolve_runtime``)."""
    world: int
    """Processes training together (DDP under more than one)."""
    device: str
    """This process's device ("cpu", "cuda:N")."""


def train_step(inputs: StepInputs, lr):
    """One optimizer step at learning rate ``lr`` over ``grad_accum`` micro-batches -> (epoch, the
    summed loss stats [J, 4] on the device, all ranks', the gradient norm, this rank's tokens)."""
    cfg, world, opt = inputs.cfg, inputs.world, inputs.opt
    on_gpu, accum, J = inputs.device.startswith("cuda"), cfg["grad_accum"], cfg["ttt_length"]
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
                loss, st = inputs.trainable(batch["input_ids"], aux, targets, ttt_length=J, decay=cfg["ttt_decay"],
                                            chunk=cfg["loss_chunk"], embeds=batch["embeds"])
            # backward outside autocast: its cache of bf16 weight copies is gone by then
            (loss / accum).backward()
        sums += st.detach()
        n_tok += tokens
    if world > 1:
        dist.all_reduce(sums)
    grad_norm = clip_and_step(opt, inputs.params, cfg["clip"])
    opt.zero_grad(set_to_none=True)
    return epoch, sums, grad_norm, n_tok


def _build_draft(dcfg, cfg, head, d2t, t2d, device, world):
    """The draft on ``device`` -> (model, the target's embedding table in host memory): seeded, its head and
    norm from the target's where ``init_from_target``, its lm_head frozen where ``freeze_lm_head``, its
    products FP8 where ``fp8``."""
    torch.manual_seed(cfg["seed"])
    model = Eagle3Draft(dcfg, runtime=Runtime.from_config(cfg, world))
    init = (head["lm_head.weight"], head["norm.weight"]) if cfg["init_from_target"] else ()
    # The target's embedding stays in host memory: the loader looks up each batch's rows there
    # (a [V, H] table on the GPU would cost 1-2 GiB at real sizes for a few MB of rows a step).
    embed_table = head["embed_tokens.weight"].to(torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model.set_target(embed_table, d2t, t2d, *init, keep_embedding=False)  # a P-EAGLE draft keeps its mask token's row
    if cfg["freeze_lm_head"]:
        model.lm_head.weight.requires_grad_(False)
    model.to(device)
    if cfg["fp8"]:  # before the step compiles; the weights stay the same bf16 parameters
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


def _describe_runtime(cfg, runtime: Runtime) -> str:
    """How this run trains, for the log's first line."""
    return (f"attention {cfg['attention']}, recompute {cfg['recompute']}, fused loss {cfg['fused_loss']}, bf16 weights "
            f"{cfg['bf16_weights']}, fp8 products {cfg['fp8']}, step grads split {runtime.split_step_grads}, diagonal split "
            f"{cfg['diag_split']}, unscored positions skipped {cfg['skip_unscored']}, lm_head "
            f"{'frozen' if cfg['freeze_lm_head'] else 'trained'}")


def _prepare_compile(lengths, cfg, start, remaining, world) -> str:
    """Let dynamo compile one graph per batch shape of the rest of the run (``configure_compile``) -> the log's note."""
    shapes = run_shapes(lengths, cfg, start, remaining, world)
    configure_compile(shapes)
    return f", compiled ({len(shapes)} batch shape{'s' if len(shapes) != 1 else ''}: one graph each)"


@dataclasses.dataclass(frozen=True)
class _Run:
    """Where a run stands and what its checkpoints carry."""

    total_steps: int
    fingerprint: str
    """``_fingerprint``: the data and config the resume points were saved for."""
    state_dir: Path
    snapshots: list
    """(step, file in ``state_dir``) of each draft kept along training."""
    dcfg: DraftConfig
    """The draft's ``checkpoint.draft_config``."""
    info: TargetFacts
    """The target's facts (``target.load_target_head``)."""

    @classmethod
    def of(cls, total_steps, fingerprint, state_dir, n_snapshots, dcfg, info):
        """The run's facts, its ``state_dir`` made, its ``n_snapshots`` drafts along training placed (``snapshot_steps``)."""
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        snapshots = [(s, _snapshot_file(state_dir, fingerprint, i)) for i, s in enumerate(snapshot_steps(total_steps, n_snapshots))]
        return cls(total_steps, fingerprint, state_dir, snapshots, dcfg, info)


def _keep_snapshot(path, inputs: StepInputs, run: _Run, step, rows):
    """The draft at ``step`` as a checkpoint at ``path`` (one of the drafts kept along training)."""
    J = inputs.cfg["ttt_length"]
    stats = {"step": step, "of_steps": run.total_steps, "tokens": sum(int(r["tokens"]) for r in rows),
             "loss": rows[-1]["loss"], "acc": [rows[-1][f"acc_{j}"] for j in range(J)]}
    _save_weights(path, inputs.model, inputs.opt, inputs.cfg, run.dcfg, run.info, stats)


def _save_resume_point(inputs: StepInputs, run: _Run, step, rows):
    """What a killed run resumes from (``resume``), in ``run.state_dir``."""
    state = {
        "fingerprint": run.fingerprint,
        "step": step,
        "model": inputs.model.state_dict(),
        "optimizer": inputs.opt.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(inputs.device) if inputs.device.startswith("cuda") else None,
        "metrics": rows,
    }
    _save_state(run.state_dir, step, state, inputs.cfg["keep_states"])


def _train_steps(inputs: StepInputs, run: _Run, step, metrics: Metrics, rank) -> int:
    """The optimizer steps from ``step`` to the run's last (the loader closed after them); rank 0 keeps
    the drafts along training and the resume points as it passes them -> the step reached."""
    cfg, total_steps = inputs.cfg, run.total_steps
    try:
        while step < total_steps:
            lr = lr_at(step, cfg, total_steps)
            epoch, sums, grad_norm, tokens = train_step(inputs, lr)
            step += 1
            metrics.add(step, epoch, lr, sums, grad_norm, tokens)
            save = rank == 0 and step % cfg["save_every"] == 0 and step < total_steps
            keep = [f for s, f in run.snapshots if s == step and rank == 0]
            if save or keep or step % cfg["log_every"] == 0 or step == total_steps:
                metrics.flush()
            for path in keep:
                _keep_snapshot(path, inputs, run, step, metrics.rows)
            if save:
                _save_resume_point(inputs, run, step, metrics.rows)
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


def _write_outputs(inputs: StepInputs, run: _Run, stats, rows, out_path, metrics_path, snapshot_paths):
    """The checkpoint, the metrics and the drafts kept along training at their outputs; the run's resume
    points (and other runs' drafts) removed from ``run.state_dir``."""
    _save_weights(out_path, inputs.model, inputs.opt, inputs.cfg, run.dcfg, run.info, stats)
    write_metrics(metrics_path, rows)
    for (_, kept), dest in zip(run.snapshots, snapshot_paths):
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        os.replace(kept, dest)
    for path in [*_state_files(run.state_dir), *Path(run.state_dir).glob("curve_*.safetensors")]:
        path.unlink(missing_ok=True)  # the run is complete: its resume points are not, nor other runs' drafts


def train_draft(hidden_paths, vocab_path, out_path, metrics_path, *, head_path, config=None, state_dir, device=None, progress=True,
                stream=None, snapshot_paths=()) -> dict:
    """Train the draft; write ``out_path`` (safetensors: the draft's vLLM tensors, config in the
    metadata) and ``metrics_path`` (CSV, one row per optimizer step). Returns a summary.

    ``snapshot_paths``: one checkpoint per path, of the draft at equal parts of the run (``snapshot_steps``),
    in ``out_path``'s format with the step and tokens so far in its statistics.

    ``stream`` (``stream.open_stream``'s settings; ``hidden_paths`` is then unused): take the states
    from the extraction server instead of shards. ``config``: the training config's keys that differ from
    the schema's (``TrainSettings.config()``); ``device``: where it runs (None: train.device's default).
    A DFlash draft (kind dflash) trains with ``dflash_train.train_dflash`` instead, which builds on this module."""
    cfg = resolve_config(config)
    if cfg["kind"] == "dflash":
        raise ValueError("train_draft trains EAGLE-3 drafts: a DFlash draft (draft.kind dflash) trains with "
                         "eaglenest.draft.dflash_train.train_dflash, same arguments")
    device = device or TrainSettings.defaults().device
    t_start = time.time()
    world, rank, local_rank, device, own_group = start_process(device)
    on_gpu = device.startswith("cuda")

    # the target's head and vocabulary, the states, the model and its optimizer
    head, info = load_target_head(head_path)
    d2t, t2d = load_vocab(vocab_path)
    shards = open_states(hidden_paths, stream, info, t2d, vocab_path, head_path)
    cfg = resolve_runtime(cfg, device)
    dcfg = draft_config(info, len(d2t), cfg)
    model, embed_table = _build_draft(dcfg, cfg, head, d2t, t2d, device, world)
    draft_ids = model.draft_ids()
    target = (target_head_rows(head, shards, draft_ids, info, device, rank), draft_ids, model.t2d)
    del head
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(model, cfg, on_gpu)
    trainable = _wrap_ddp(model, world, local_rank, on_gpu)

    # where this run stands: its steps, and the resume point it left if it was killed
    lengths = [shards.length(k) for k in range(len(shards))]
    total_steps = count_steps(lengths, cfg, world)
    accum, J = cfg["grad_accum"], cfg["ttt_length"]
    run = _Run.of(total_steps, _fingerprint(cfg, shards, vocab_path, head_path, world), state_dir, len(snapshot_paths), dcfg, info)
    step, rows, resumed_from = resume(run.state_dir, run.fingerprint, model, opt, device, total_steps, run.snapshots)

    remaining = (total_steps - step) * accum  # micro-batches this rank still trains on
    how = _describe_runtime(cfg, model.runtime)
    if cfg["compile"]:
        how += _prepare_compile(lengths, cfg, step * accum * world, remaining, world)
    if rank == 0:
        say(f"train_draft: {device}, {how}")
    loader = BatchLoader(shards, lengths, cfg, start=step * accum * world, count=remaining, rank=rank, world=world,
                         device=device, ttt_length=J, embed_table=embed_table, runtime=model.runtime)
    inputs = StepInputs(trainable, model, opt, params, loader, target, cfg, world, device)

    # the loop
    bar = progress_bar(total=total_steps, initial=step, unit="step", desc="train_draft", disable=not progress or rank != 0)
    metrics = Metrics(rows, cfg, device, bar)
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


def _save_weights(path, model, opt, cfg, dcfg, info, stats) -> None:
    """The draft's weights now (the fp32 masters under bf16 weights) as a checkpoint with ``stats``."""
    weights = opt.master_state_dict(model) if cfg["bf16_weights"] else model.state_dict()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    save_checkpoint(path, tensors, dcfg, info, {**stats, "config": cfg})


def train_in_processes(nproc: int, hidden_paths, vocab_path, out_path, metrics_path, *, head_path, config,
                       state_dir, device, stream=None, snapshot_paths=()) -> int:
    """``train_draft`` in this process (``nproc`` 1), or in ``nproc`` processes under torchrun, each
    started with ``main``'s arguments. Returns the exit status."""
    if nproc <= 1:
        train_draft(hidden_paths, vocab_path, out_path, metrics_path, head_path=head_path, config=config,
                    state_dir=state_dir, device=device, stream=stream, snapshot_paths=snapshot_paths)
        return 0
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "eaglenest.draft.train", "--hidden", *hidden_paths, "--vocab", vocab_path, "--head", head_path,
           "--out", out_path, "--metrics", metrics_path, "--state-dir", state_dir, "--snapshots", *snapshot_paths,
           "--config", json.dumps(config), "--device", device, *(["--stream", json.dumps(stream)] if stream else [])]
    say("launching: " + " ".join(cmd))
    # sys.stdout, not the inherited descriptors: a rule script's output goes to its log (logs.to_log)
    return subprocess.run(cmd, stdout=sys.stdout, stderr=sys.stderr).returncode


def main(argv=None):
    """`python -m eaglenest.draft.train ...`: the entry point torchrun starts once per process."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m eaglenest.draft.train")
    p.add_argument("--hidden", nargs="*", default=[])
    p.add_argument("--stream", default=None, help="hidden.mode stream: stream.open_stream's settings as JSON")
    p.add_argument("--vocab", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--snapshots", nargs="*", default=[], help="where the drafts kept along training go")
    p.add_argument("--config", default="{}", help="the training config as JSON")
    p.add_argument("--device", default=None, help="where it runs (default: train.device's)")
    a = p.parse_args(argv)
    train_draft(a.hidden, a.vocab, a.out, a.metrics, head_path=a.head, config=json.loads(a.config),
                state_dir=a.state_dir, device=a.device, stream=json.loads(a.stream) if a.stream else None,
                snapshot_paths=a.snapshots)


if __name__ == "__main__":
    main()
