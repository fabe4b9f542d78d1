"""The TTT losses: soft cross-entropy against the target's distribution restricted to the draft
vocabulary, step weights decay^j (at least ``floor``), plain (``ttt_loss``) or with lm_head and the
gradient fused so no logits are kept (``ttt_loss_fused``)."""

import functools

import torch
import torch.nn.functional as F

from .fp8 import E5M2, head_fp8, input_cast
from .ttt import GatherRows, ttt_loss_plan

# speculators' P-EAGLE recipe (models/peagle/data.py, COD sampling, its defaults down_sample_ratio 0.7 and
# down_sample_ratio_min 0.2) trains position j at a share max(0.7**j, 0.2) of the sequence's positions and
# averages the loss over every row it sampled; running every position everywhere, that share is j's weight:
# ``ttt_loss``'s decay COD_RATIO with floor COD_FLOOR.
COD_RATIO, COD_FLOOR = 0.7, 0.2


def soft_cross_entropy(hidden, weight, target_probs, row_weight, chunk=4096):
    """Sum over rows of ``row_weight * CE(target_probs, softmax(hidden @ weight.T))`` and each row's
    argmax, ``chunk`` rows at a time; with several chunks each is recomputed in backward rather than
    kept, so memory holds one chunk of logits."""

    def piece(h, p, w):
        logits = (h @ weight.T).float()
        return (w * -(p * F.log_softmax(logits, dim=-1)).sum(-1)).sum(), logits.argmax(-1)

    n = hidden.shape[0]
    if n <= chunk or not torch.is_grad_enabled():
        pieces = [piece(hidden[s : s + chunk], target_probs[s : s + chunk], row_weight[s : s + chunk]) for s in range(0, max(n, 1), chunk)]
    else:
        from torch.utils.checkpoint import checkpoint

        pieces = [
            checkpoint(piece, hidden[s : s + chunk], target_probs[s : s + chunk], row_weight[s : s + chunk], use_reentrant=False)
            for s in range(0, n, chunk)
        ]
    return sum(p[0] for p in pieces), torch.cat([p[1] for p in pieces])


def ttt_loss(outs, lm_head_weight, draft_ids, targets, decay=0.8, chunk=4096, floor=0.0):
    """Weighted soft cross-entropy of the TTT steps against the target's distribution.

    ``targets`` (from the target's last hidden state, computed once per batch, see train.py), over
    the ``Nq`` flat positions q of [B, T] whose next token is a completion token:
        rows      int64 [Nq]      flat index b*T + q
        probs     float [Nq, Vd]  the target's distribution at q restricted to the draft vocabulary
        argmax    int64 [Nq]      the target's top-1 over its full vocabulary (a target id)
        in_draft  bool  [Nq]      argmax is in the draft vocabulary: positions without it carry no loss
    Step j at base position t predicts what the target predicts at q = t+1+j.
    Returns ``(loss, stats)``: loss = sum_j w_j * mean CE_j with w_j = max(decay^j, floor) (``floor``
    above 0: P-EAGLE's ``COD_FLOOR``); stats [J, 4] = CE sum, loss rows,
    top-1 hits, rows (accuracy counts every row, in the draft vocabulary or not).
    """
    B, T, H = outs[0].shape
    rows = targets["rows"]
    loss = outs[0].new_zeros((), dtype=torch.float32)
    stats = []
    for j, out in enumerate(outs):
        sel = rows % T >= 1 + j  # q = t+1+j needs t >= 0
        w = targets["in_draft"][sel].float()
        ce, top = soft_cross_entropy(out.reshape(B * T, H)[rows[sel] - 1 - j], lm_head_weight, targets["probs"][sel], w, chunk)
        hits = (draft_ids[top] == targets["argmax"][sel]).sum()
        loss = loss + max(decay**j, floor) * ce / w.sum().clamp(min=1)
        stats.append(torch.stack([ce.detach(), w.sum(), hits.float(), torch.tensor(float(sel.sum()), device=w.device)]))
    return loss, torch.stack(stats)


class _LinearSoftCE(torch.autograd.Function):
    """``sum(row_weight * CE(probs[p_index], softmax(hidden @ weight.T)))`` with both gradients
    computed in forward, ``chunk`` rows at a time: the logits of one chunk are alive at once and
    none are kept for backward (only d loss / d hidden [N, H] and d loss / d weight [V, H])."""

    @staticmethod
    def forward(ctx, hidden, weight, probs, p_index, row_weight, chunk, need_h, need_w, compiled=False, fp8=False):
        w = weight.to(hidden.dtype)
        n = hidden.shape[0]
        ce = torch.empty(n, device=hidden.device, dtype=torch.float32)
        top = torch.empty(n, device=hidden.device, dtype=torch.int64)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
        if fp8:  # a frozen head, compiled: both products in FP8
            _fp8_chunks(hidden, w, probs, p_index, row_weight, chunk, ce, top, grad_h)
        else:
            _chunks(hidden, w, probs, p_index, row_weight, chunk, compiled, ce, top, grad_h, grad_w)
        ctx.save_for_backward(grad_h, grad_w)
        loss = (ce * row_weight).sum()
        ctx.mark_non_differentiable(ce, top)
        return loss, ce, top

    @staticmethod
    def backward(ctx, g_loss, _g_ce, _g_top):
        grad_h, grad_w = ctx.saved_tensors  # scaled in place: no second copy of d loss / d weight
        gh = grad_h.mul_(g_loss.to(grad_h.dtype)) if grad_h is not None else None
        gw = grad_w.mul_(g_loss) if grad_w is not None else None
        return gh, gw, None, None, None, None, None, None, None, None


def _chunks(hidden, w, probs, p_index, row_weight, chunk, compiled, ce, top, grad_h, grad_w):
    """``_LinearSoftCE``'s loop in the head's dtype, ``chunk`` rows at a time: fills ``ce``, ``top``,
    ``grad_h`` and adds into ``grad_w`` in place (None: not needed); compiled, the elementwise part is
    one fused kernel set and the rows are a multiple of ``chunk``."""
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s : s + chunk]
        if compiled:  # one fused kernel set for the elementwise part; n is a multiple of chunk
            ce[s : s + chunk], top[s : s + chunk], g = _compiled_soft_ce_grad()(h @ w.T, probs[p_index[s : s + chunk]], row_weight[s : s + chunk])
            if grad_h is not None:
                grad_h[s : s + chunk] = g @ w
            if grad_w is not None:
                grad_w += (g.T @ h).float()
            continue
        logp = (h @ w.T).float()
        top[s : s + chunk] = logp.argmax(-1)
        logp -= logp.logsumexp(-1, keepdim=True)  # in place: one [chunk, V] fp32 buffer
        p = probs[p_index[s : s + chunk]]
        ce[s : s + chunk] = -torch.linalg.vecdot(p, logp)
        if grad_h is not None or grad_w is not None:
            # d CE / d logits = softmax * sum(p) - p, weighted per row
            g = logp.exp_().mul_(p.sum(-1, keepdim=True)).sub_(p).mul_(row_weight[s : s + chunk, None])
            del p, logp
            g = g.to(hidden.dtype)
            if grad_h is not None:
                grad_h[s : s + chunk] = g @ w
            if grad_w is not None:
                grad_w += (g.T @ h).float()


def _fp8_chunks(hidden, w, probs, p_index, row_weight, chunk, ce, top, grad_h):
    """``_LinearSoftCE``'s compiled loop with a frozen head's two products in FP8: the head cast to
    e4m3 once (``head_fp8``), each hidden chunk cast by one compiled amax and cast, the logits
    ``_scaled_mm(h8, W8.T)`` in bf16, d loss / d logits written by the compiled loss kernel directly
    in e5m2 (``_soft_ce_grad_fp8``: its scale is known ahead, no amax pass), and
    d loss / d hidden = ``_scaled_mm(g8, W8)``. Fills ``ce``, ``top`` and ``grad_h`` (None: not
    needed) in place; the rows are a multiple of ``chunk``."""
    head = head_fp8(w)
    # |d CE / d logits| = |softmax * sum(p) - p| <= 1 per element (p sums to at most 1), so a row's
    # gradient is at most its weight: the largest weight lands on e5m2's largest value
    top_g = torch.finfo(E5M2).max
    g_max = row_weight.amax().float().clamp(min=1e-30)
    g_scale, g_inv = top_g / g_max, g_max / top_g
    kernel = _compiled_soft_ce_grad_fp8()
    for s in range(0, hidden.shape[0], chunk):
        h8, sh = input_cast(hidden[s : s + chunk])
        logits = torch._scaled_mm(h8, head.rows.t(), scale_a=sh, scale_b=head.scale, out_dtype=hidden.dtype)
        ce[s : s + chunk], top[s : s + chunk], g8 = kernel(logits, probs[p_index[s : s + chunk]], row_weight[s : s + chunk], g_scale)
        if grad_h is not None:
            grad_h[s : s + chunk] = torch._scaled_mm(g8, head.cols, scale_a=g_inv, scale_b=head.scale, out_dtype=hidden.dtype)


def _soft_ce_grad(logits, p, row_weight):
    """One chunk of ``_LinearSoftCE`` past its matmul: logits [n, V], target probs p [n, V] ->
    CE [n], argmax [n], d loss / d logits [n, V] in the logits' dtype (the same math as the eager
    in-place path, written plainly for the compiler to fuse)."""
    x = logits.float()
    logp = x - x.logsumexp(-1, keepdim=True)
    ce = -(p * logp).sum(-1)
    g = (logp.exp() * p.sum(-1, keepdim=True) - p) * row_weight[:, None]
    return ce, x.argmax(-1), g.to(logits.dtype)


def _soft_ce_grad_fp8(logits, p, row_weight, g_scale):
    """``_soft_ce_grad`` with d loss / d logits scaled by ``g_scale`` and written in e5m2 (what the
    FP8 product takes; ``g_scale`` maps the largest possible value onto e5m2's largest)."""
    ce, top, g = _soft_ce_grad(logits.float(), p, row_weight)  # float logits: g stays fp32 until the one e5m2 rounding
    big = torch.finfo(E5M2).max  # the clamp only catches float rounding at the bound (no inf)
    return ce, top, (g * g_scale).clamp(-big, big).to(E5M2)


@functools.lru_cache(maxsize=None)
def _compiled_soft_ce_grad_fp8():
    return torch.compile(_soft_ce_grad_fp8, dynamic=False, fullgraph=True)


@functools.lru_cache(maxsize=None)
def _compiled_soft_ce_grad():
    # static shapes: ttt_loss_fused pads the rows to a multiple of the chunk, so one graph serves
    return torch.compile(_soft_ce_grad, dynamic=False, fullgraph=True)


def ttt_loss_fused(outs, lm_head_weight, draft_ids, targets, decay=0.8, chunk=4096, compiled=False, fp8=False, floor=0.0):
    """``ttt_loss`` computed in one pass over all steps' rows (``_LinearSoftCE``): the same loss and
    stats, no logits kept for backward, no host synchronisation when ``targets["plan"]``
    (``ttt_loss_plan``, made on the host) is given. ``fp8`` (a head ``fp8.use_fp8`` marked):
    compiled, with the head frozen, its two products run in FP8 (``_fp8_chunks``)."""
    J = len(outs)
    B, T, H = outs[0].shape
    plan = targets.get("plan")
    if plan is None:
        plan = ttt_loss_plan(targets["rows"], T, J, B * T)
    hidden = GatherRows.apply(torch.stack(outs).reshape(J * B * T, H), plan["h_index"])
    p_index, step = plan["p_index"], plan["step"]
    w = targets["in_draft"][p_index].float()
    def per_step(x):
        return torch.zeros(J, device=x.device, dtype=torch.float32).index_add_(0, step, x)

    w_sum = per_step(w)
    decay_j = (decay ** torch.arange(J, device=w.device, dtype=torch.float32)).clamp(min=floor)
    row_weight = w * (decay_j / w_sum.clamp(min=1))[step]
    need_h = torch.is_grad_enabled() and hidden.requires_grad
    need_w = torch.is_grad_enabled() and lm_head_weight.requires_grad
    n = len(p_index)
    if compiled:  # rows padded to a multiple of chunk (weight 0, so no loss and no gradient);
        chunk = min(chunk, 1024)  # small chunks: little padding, and the matmuls stay large enough
        pad = (-n) % chunk
        hidden = F.pad(hidden, (0, 0, 0, pad))
        loss, ce, top = _LinearSoftCE.apply(hidden, lm_head_weight, targets["probs"], F.pad(p_index, (0, pad)),
                                            F.pad(row_weight, (0, pad)), chunk, need_h, need_w, True, fp8 and not need_w)
        ce, top = ce[:n], top[:n]
    else:
        loss, ce, top = _LinearSoftCE.apply(hidden, lm_head_weight, targets["probs"], p_index, row_weight, chunk, need_h, need_w)
    hits = (draft_ids[top] == targets["argmax"][p_index]).float()
    stats = torch.stack([per_step(ce * w), w_sum, per_step(hits), per_step(torch.ones_like(w))], dim=1)
    return loss, stats
