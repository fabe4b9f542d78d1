"""FP8 (e4m3) training of the draft's large matrix products on GPUs that have FP8 tensor cores.

``train.fp8`` (auto | true | false) resolves here (``resolve_fp8``); ``use_fp8`` switches the chosen
Linears of a draft to ``float8_linears``: per product, the input and the weight are cast to e4m3 (the
output's gradient to e5m2 in backward) with one scale per tensor taken from its amax at every call,
and multiplied by ``torch._scaled_mm`` on the FP8 tensor cores, with bf16 results. The weights stay
the bf16 ``nn.Parameter``s they were (the optimizer's fp32 masters and moments, ``state_dict()`` and
the checkpoint are unchanged); they are cast again in backward rather than kept in e4m3, and the
input is kept for backward in e4m3 (half its bf16 bytes). Products that read the same input (q/k/v,
the MLP's gate/up) cast and keep it once (``layers.project``).

Per-tensor scales rather than per-row: per-row scaling was slower than bf16 at the draft's shapes on
an H200 (docs/fp8.md). Which products: fc (3·Ht -> H), q/k/v/o and the MLP's gate/up/down, and a
frozen lm_head's two products in the compiled fused loss (logits and d loss / d hidden, ``head_fp8``;
``losses.ttt_loss_fused``). Only Linears whose both dimensions are multiples of 16 (what FP8 matrix
products need); a group runs in FP8 only when all its Linears do.
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer
FP8_MODULES = ("fc", "midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj", "midlayer.self_attn.v_proj",
               "midlayer.self_attn.o_proj", "midlayer.mlp.gate_proj", "midlayer.mlp.up_proj", "midlayer.mlp.down_proj")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CAST, SCALE = "fp8_weight", "fp8_scale"  # the buffers of a switched Linear that hold its weight's e4m3 copy
ROWS = 16  # the inner dimension of an FP8 product is a multiple of 16: the weight gradient's is the rows


def device_capability(device):
    """(major, minor) CUDA capability of ``device``, or None where it is not a CUDA device here."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(torch.device(device))


def resolve_fp8(setting, device, capability=None):
    """``train.fp8`` made concrete (a bool) for ``device``: auto is on where the GPU has FP8 tensor
    cores (``capability``, default: the device's own). ``true`` where it has none raises, naming the
    key and what to do."""
    if setting not in ("auto", True, False):
        raise ValueError(f"train.fp8 must be auto, true or false, got {setting!r}")
    if setting is False:
        return False
    if capability is None:
        capability = device_capability(device)
    capable = capability is not None and tuple(capability) >= MIN_CAPABILITY
    if not capable and setting is True:
        where = f"{device}, capability {capability[0]}.{capability[1]}" if capability else str(device)
        raise ValueError(f"train.fp8: true needs a CUDA GPU of capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                         f"or newer (Ada, Hopper), here {where}; set train.fp8 to auto or false")
    return capable


def _fp8_shaped(module):
    """A Linear without bias whose both dimensions are multiples of 16 (what FP8 matrix products need)."""
    return (isinstance(module, nn.Linear) and module.bias is None
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def fp8_module(module, name):
    """Whether ``use_fp8`` switches ``module`` (named ``name`` in the draft)."""
    return name in FP8_MODULES and _fp8_shaped(module)


def use_fp8(model):
    """Switch the draft's large Linears to FP8 products (``layers.project`` reads ``module.fp8``), in
    place, after ``model.to(device)`` and before the step is compiled. Each gets two empty buffers
    (not saved) that a TTT step fills with the weight's e4m3 copy (``weight_casts``). A frozen lm_head
    is marked too (``fp8``): the compiled fused loss multiplies by it in e4m3 (``head_fp8``); a trained
    one stays bf16 (its gradient would need a third, transposed product). -> the names."""
    switched = []
    for name, module in model.named_modules():
        if fp8_module(module, name):
            module.fp8 = True
            module.register_buffer(CAST, torch.empty(0, dtype=E4M3, device=module.weight.device), persistent=False)
            module.register_buffer(SCALE, torch.empty(0, device=module.weight.device), persistent=False)
            switched.append(name)
    head = getattr(model, "lm_head", None)
    if head is not None and _fp8_shaped(head) and not head.weight.requires_grad:
        head.fp8 = True
        switched.append("lm_head")
    return switched


def weight_casts(model, prefix="midlayer."):
    """The e4m3 copies of the FP8 Linears' weights under ``prefix`` and their inverse scales, by buffer
    name (``<module>.fp8_weight``, ``<module>.fp8_scale``): made once per training step and handed to
    every TTT step with its weights (the weights do not change between the steps), instead of each
    step casting them again, forward and backward. Empty without FP8 Linears."""
    names = [n for n, m in model.named_modules() if getattr(m, "fp8", False) and n.startswith(prefix)]
    if not names:
        return {}
    weights = [model.get_submodule(n).weight for n in names]
    cast = _compiled_casts() if weights[0].is_cuda else _casts
    with torch.no_grad():
        out = {}
        for n, (w8, scale) in zip(names, cast(weights)):
            out[f"{n}.{CAST}"], out[f"{n}.{SCALE}"] = w8, scale
    return out


def _casts(weights):
    return [_cast(w, E4M3) for w in weights]


@functools.lru_cache(maxsize=None)
def _compiled_casts():
    """``_casts`` as one compiled graph (fused amax and cast, no float32 copy of a weight)."""
    return torch.compile(_casts, dynamic=False, fullgraph=True)


def _cast(t, dtype):
    """``t`` [M, K] scaled so that its largest magnitude lands on ``dtype``'s, in ``dtype``, and the
    inverse scale (a float32 scalar tensor, what ``_scaled_mm`` multiplies back)."""
    top = torch.finfo(dtype).max
    amax = t.abs().amax().float().clamp(min=1e-12)
    scale = top / amax
    return (t.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


class HeadCast(NamedTuple):
    """A frozen lm_head [V, H] in e4m3, in both layouts ``_scaled_mm`` takes as its second operand."""

    rows: torch.Tensor  # [V, H] row-major: ``rows.t()`` is the [H, V] of hidden @ W.T
    cols: torch.Tensor  # [V, H] column-major (the same values): the [V, H] of d loss / d logits @ W
    scale: torch.Tensor  # the inverse scale (float32 scalar)


def head_fp8(weight):
    """``weight`` [V, H] (frozen) cast to e4m3 once per loss call, for both of the loss's products.
    Costs 2·V·H bytes while the loss runs (two layouts: ``_scaled_mm`` wants its second operand
    column-major, and the two products read the head transposed to each other)."""
    with torch.no_grad():
        w8, inv = input_cast(weight)
        return HeadCast(w8, w8.t().contiguous().t(), inv)


def input_cast(t):
    """``_cast(t, E4M3)`` (per-tensor scale), compiled on CUDA: one fused amax and cast."""
    return (_compiled_input_cast() if t.is_cuda else _cast)(t, E4M3)


@functools.lru_cache(maxsize=None)
def _compiled_input_cast():
    return torch.compile(_cast, dynamic=False, fullgraph=True)


def _rows_padded(t):
    """``t`` [M, K] with zero rows added up to a multiple of ROWS (zeros change no amax or product)."""
    pad = -t.shape[0] % ROWS
    return F.pad(t, (0, 0, 0, pad)) if pad else t


class _Float8Linears(torch.autograd.Function):
    """x [..., K] times each weight [N_i, K] transposed, in e4m3 with per-tensor scales -> one output
    [..., N_i] per weight (bf16, x's dtype). ``casts``: the weights' e4m3 copies and inverse scales
    (``weight_casts``), or empty to cast them here. Backward: e5m2 output gradients; x kept in e4m3."""

    @staticmethod
    def forward(ctx, x, n, *tensors):
        weights, casts = tensors[:n], tensors[n:]
        if not casts:
            casts = [t for w in weights for t in _cast(w, E4M3)]
        lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])
        x8, sx = _cast(_rows_padded(rows), E4M3)
        outs = []
        for w, w8, sw in zip(weights, casts[0::2], casts[1::2]):
            out = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)
            outs.append(out[: rows.shape[0]].view(*lead, w.shape[0]))
        ctx.save_for_backward(x8, sx, *weights, *(tensors[n:]))
        ctx.set_materialize_grads(False)  # an output nothing used: None, no product
        ctx.lead, ctx.m, ctx.n = lead, rows.shape[0], n
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x8, sx, *tensors = ctx.saved_tensors
        weights, casts = tensors[: ctx.n], tensors[ctx.n :]
        grad_x, grad_ws = None, []
        for i, (g, w) in enumerate(zip(grads, weights)):
            if g is None:
                grad_ws.append(None)
                continue
            g8, sg = _cast(_rows_padded(g.reshape(-1, g.shape[-1])), E5M2)
            if ctx.needs_input_grad[0]:
                w8, sw = (casts[2 * i], casts[2 * i + 1]) if casts else _cast(w, E4M3)
                part = torch._scaled_mm(g8, w8.t().contiguous().t(), scale_a=sg, scale_b=sw, out_dtype=g.dtype)
                grad_x = part if grad_x is None else grad_x + part
            grad_ws.append(torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), scale_a=sg, scale_b=sx,
                                            out_dtype=w.dtype) if ctx.needs_input_grad[2 + i] else None)
        if grad_x is not None:
            grad_x = grad_x[: ctx.m].view(*ctx.lead, -1)
        return (grad_x, None, *grad_ws, *([None] * len(casts)))


def float8_linears(x, *weights, casts=()):
    """``tuple(F.linear(x, w) for w in weights)`` with e4m3 products (``_Float8Linears``); ``casts``:
    the weights' (e4m3 copy, inverse scale) pairs, flat, when made ahead (``weight_casts``)."""
    return _Float8Linears.apply(x, len(weights), *weights, *casts)
