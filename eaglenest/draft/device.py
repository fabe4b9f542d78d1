"""Where a training process runs and how: its place in a torchrun launch and its device
(``start_process``), the code paths the device takes where the settings say "auto" (``resolve_runtime``),
and dynamo's limits for the compiled step (``configure_compile``)."""

import os

import torch
import torch.distributed as dist

from ..settings import TrainSettings
from ..states.target import resolve_device
from .fp8 import resolve_fp8

AUTO_KEYS = ("attention", "compile", "recompute", "fused_loss", "split_step_grads", "diag_split", "skip_unscored")  # the model's settings (runtime.Runtime)
FLEX_ONLY = ("split_step_grads", "diag_split")  # AUTO_KEYS that only the flex path has


def resolve_runtime(settings: TrainSettings, device, capability=None) -> TrainSettings:
    """``settings`` with their "auto" code paths (AUTO_KEYS, bf16_weights, fp8) made concrete for ``device``
    ("cuda..."/"cpu").

    On CUDA: flex attention, compiled, fused loss, bf16 weights (fp32 masters), recomputed only with
    a trained lm_head, FP8 products where the GPU has them (``fp8.resolve_fp8``; ``capability``: the
    GPU's, default the device's own). Elsewhere: the dense mask and none of the rest. An explicit choice the device cannot run raises (no silent fallback to a slow path)."""
    cuda = str(device).startswith("cuda")
    out = {k: getattr(settings, k) for k in (*AUTO_KEYS, "bf16_weights", "fp8")}
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
        out["recompute"] = cuda and not settings.freeze_lm_head
    for key in FLEX_ONLY:
        if out[key] == "auto":
            out[key] = cuda and out["attention"] == "flex"
    if out["skip_unscored"] == "auto":
        out["skip_unscored"] = bool(out["diag_split"])
    out["fp8"] = resolve_fp8(out["fp8"], device, capability)
    _check_runtime(out, device, cuda)
    return settings.replace(**out)


def _check_runtime(out, device, cuda):
    """Raise where a resolved choice of ``resolve_runtime`` is not one the device runs, naming the setting."""
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
