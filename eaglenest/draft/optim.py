"""AdamW for a draft held in bfloat16 on the GPU: fp32 master weights, bfloat16 moments.

With fp32 weights under autocast, each trainable parameter costs 18 bytes at the step's peak (fp32
weight, fp32 gradient, two fp32 AdamW moments, and autocast's bf16 copy); here it costs 12 (bf16
weight and gradient, fp32 master, two bf16 moments): what that saves at Kimi-K2.5 sizes is in
benchmarks/RESULTS.md, "Figures moved out of code comments". Updates are computed in fp32 against the
master and rounded once into the bf16 weight, so small steps late in the cosine schedule are not lost
to bf16 rounding (as they are when AdamW runs on bf16 weights directly). bf16 moments are safe at the
betas train.py uses (0.9, 0.95): each update moves them by at least 5%, far above bf16's resolution (0.4%).

Decoupled weight decay and bias correction as ``torch.optim.AdamW``; ``tests/test_optim.py`` checks
the trajectory against it. ``step(max_norm=...)`` clips as ``clip_grad_norm_`` does but inside the
update: the gradients are read twice (norm, update) instead of four times (norm, rescale in place,
update), and on CUDA the whole step is one compiled graph.
"""

import functools

import torch

_SLOTS = ("master", "exp_avg", "exp_avg_sq")


def _update(param, grad, master, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, bc1, bc2, scale):
    """One AdamW step of one parameter, in fp32, written back in place; ``grad`` times ``scale``."""
    g = grad.float() * scale
    m = exp_avg.float() * beta1 + g * (1 - beta1)
    v = exp_avg_sq.float() * beta2 + g * g * (1 - beta2)
    master.copy_(master * (1 - lr * weight_decay) - (lr / bc1) * m / ((v / bc2).sqrt() + eps))
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    param.copy_(master)


def _step_all(params, grads, masters, exp_avgs, exp_avg_sqs, scalars, max_norm):
    """The whole optimizer step: with ``max_norm``, the gradients' global L2 norm and torch's clip
    coefficient (``clip_grad_norm_``: max_norm / (norm + 1e-6), at most 1), applied inside each
    update instead of rewriting the gradients first; then one update per parameter. Returns the
    norm (before clipping), or None. Compiled, it is one graph per run: a reduction over each
    gradient, then one fused kernel per parameter."""
    norm, scale = None, 1.0
    if max_norm is not None:
        norm = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).norm()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p, g, master, m, v in zip(params, grads, masters, exp_avgs, exp_avg_sqs):
        _update(p, g, master, m, v, *scalars, scale)
    return norm


@functools.lru_cache(maxsize=None)
def _compiled_step_all():
    # static shapes: the trained parameters are the same at every step of a run (one graph); the
    # scalars are tensors, so a new lr or step count each step does not recompile
    return torch.compile(_step_all, dynamic=False, fullgraph=True)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over bf16 ``params`` whose fp32 values are the masters; call it BEFORE casting the model
    to bf16 (the masters are copied from the parameters as they are now)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, moment_dtype=torch.bfloat16, compiled=None):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.compiled = compiled
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {
                    "step": 0,
                    "master": p.detach().float().clone(),
                    "exp_avg": torch.zeros_like(p, dtype=moment_dtype),
                    "exp_avg_sq": torch.zeros_like(p, dtype=moment_dtype),
                }

    @torch.no_grad()
    def step(self, closure=None, *, max_norm=None):
        """One step over every parameter with a gradient. With ``max_norm``, the gradients are
        clipped first as ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` would (one parameter
        group only: the norm is global), and their norm before clipping is returned."""
        if closure is not None:
            raise ValueError("MasterAdamW takes no closure")
        groups = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        groups = [(g, params) for g, params in groups if params]
        if max_norm is not None and len(groups) > 1:
            raise ValueError("MasterAdamW clips one parameter group only (the norm is over all of them)")
        norm = None
        for group, params in groups:
            beta1, beta2 = group["betas"]
            n = self.state[params[0]]["step"] + 1
            scalars = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"], 1 - beta1**n, 1 - beta2**n)
            compiled = self.compiled if self.compiled is not None else params[0].is_cuda
            if compiled:  # one small copy a step, from pinned memory: a pageable one would wait for the device
                host = torch.tensor(scalars, dtype=torch.float32)
                host = host.pin_memory() if params[0].is_cuda else host
                scalars = tuple(host.to(params[0].device, non_blocking=True).unbind())
            for p in params:
                self.state[p]["step"] = n
            slots = ([self.state[p][k] for p in params] for k in _SLOTS)
            fn = _compiled_step_all() if compiled else _step_all
            norm = fn(params, [p.grad for p in params], *slots, scalars, max_norm)
        return norm

    def master_state_dict(self, model):
        """``model.state_dict()`` with every trained parameter's fp32 master in place of its bf16 value
        (what the checkpoint and the export keep)."""
        masters = {id(p): self.state[p]["master"] for g in self.param_groups for p in g["params"]}
        names = {id(p): n for n, p in model.named_parameters()}
        out = model.state_dict()
        for pid, master in masters.items():
            out[names[pid]] = master
        return out

    def load_state_dict(self, state_dict):
        # torch's loader casts every floating state tensor to its parameter's dtype (bf16 here),
        # which would round the masters: set the slots aside and put them back as saved.
        slots = {pid: {k: st.pop(k) for k in _SLOTS if k in st} for pid, st in state_dict["state"].items()}
        try:
            super().load_state_dict(state_dict)
        finally:
            for pid, st in state_dict["state"].items():
                st.update(slots[pid])
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, saved in slots.items():
            p = params[pid]
            for k, v in saved.items():
                self.state[p][k] = v.to(p.device, copy=True)  # never shared with the caller's dict


def clip_and_step(opt, params, max_norm):
    """Clip the gradients of ``params`` to global norm ``max_norm`` and step ``opt``; returns their
    norm before clipping (a device tensor). MasterAdamW does both in one pass over the gradients."""
    if isinstance(opt, MasterAdamW):
        return opt.step(max_norm=max_norm)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()
    return norm
