"""The TTT losses: soft cross-entropy against the target's distribution restricted to the draft
vocabulary, step weights decay^j, plain (``ttt_loss``) or with lm_head and the gradient fused so no
logits are kept (``ttt_loss_fused``)."""

import functools

import torch
import torch.nn.functional as F

from .ttt import GatherRows, ttt_loss_plan



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


def ttt_loss(outs, lm_head_weight, draft_ids, targets, decay=0.8, chunk=4096):
    """Weighted soft cross-entropy of the TTT steps against the target's distribution.

    ``targets`` (from the target's last hidden state, computed once per batch, see train.py), over
    the ``Nq`` flat positions q of [B, T] whose next token is a completion token:
        rows      int64 [Nq]      flat index b*T + q
        probs     float [Nq, Vd]  the target's distribution at q restricted to the draft vocabulary
        argmax    int64 [Nq]      the target's top-1 over its full vocabulary (a target id)
        in_draft  bool  [Nq]      argmax is in the draft vocabulary: positions without it carry no loss
    Step j at base position t predicts what the target predicts at q = t+1+j.
    Returns ``(loss, stats)``: loss = sum_j decay^j * mean CE_j; stats [J, 4] = CE sum, loss rows,
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
        loss = loss + decay**j * ce / w.sum().clamp(min=1)
        stats.append(torch.stack([ce.detach(), w.sum(), hits.float(), torch.tensor(float(sel.sum()), device=w.device)]))
    return loss, torch.stack(stats)


class _LinearSoftCE(torch.autograd.Function):
    """``sum(row_weight * CE(probs[p_index], softmax(hidden @ weight.T)))`` with both gradients
    computed in forward, ``chunk`` rows at a time: the logits of one chunk are alive at once and
    none are kept for backward (only d loss / d hidden [N, H] and d loss / d weight [V, H])."""

    @staticmethod
    def forward(ctx, hidden, weight, probs, p_index, row_weight, chunk, need_h, need_w, compiled=False):
        w = weight.to(hidden.dtype)
        n = hidden.shape[0]
        ce = torch.empty(n, device=hidden.device, dtype=torch.float32)
        top = torch.empty(n, device=hidden.device, dtype=torch.int64)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
        for s in range(0, n, chunk):
            h = hidden[s : s + chunk]
            if compiled:  # one fused kernel set for the elementwise part; n is a multiple of chunk
                ce[s : s + chunk], top[s : s + chunk], g = _compiled_soft_ce_grad()(h @ w.T, probs[p_index[s : s + chunk]], row_weight[s : s + chunk])
                if need_h:
                    grad_h[s : s + chunk] = g @ w
                if need_w:
                    grad_w += (g.T @ h).float()
                continue
            logp = (h @ w.T).float()
            top[s : s + chunk] = logp.argmax(-1)
            logp -= logp.logsumexp(-1, keepdim=True)  # in place: one [chunk, V] fp32 buffer
            p = probs[p_index[s : s + chunk]]
            ce[s : s + chunk] = -torch.linalg.vecdot(p, logp)
            if need_h or need_w:
                # d CE / d logits = softmax * sum(p) - p, weighted per row
                g = logp.exp_().mul_(p.sum(-1, keepdim=True)).sub_(p).mul_(row_weight[s : s + chunk, None])
                del p, logp
                g = g.to(hidden.dtype)
                if need_h:
                    grad_h[s : s + chunk] = g @ w
                if need_w:
                    grad_w += (g.T @ h).float()
        ctx.save_for_backward(grad_h, grad_w)
        loss = (ce * row_weight).sum()
        ctx.mark_non_differentiable(ce, top)
        return loss, ce, top

    @staticmethod
    def backward(ctx, g_loss, _g_ce, _g_top):
        grad_h, grad_w = ctx.saved_tensors  # scaled in place: no second copy of d loss / d weight
        gh = grad_h.mul_(g_loss.to(grad_h.dtype)) if grad_h is not None else None
        gw = grad_w.mul_(g_loss) if grad_w is not None else None
        return gh, gw, None, None, None, None, None, None, None


def _soft_ce_grad(logits, p, row_weight):
    """One chunk of ``_LinearSoftCE`` past its matmul: logits [n, V], target probs p [n, V] ->
    CE [n], argmax [n], d loss / d logits [n, V] in the logits' dtype (the same math as the eager
    in-place path, written plainly for the compiler to fuse)."""
    x = logits.float()
    logp = x - x.logsumexp(-1, keepdim=True)
    ce = -(p * logp).sum(-1)
    g = (logp.exp() * p.sum(-1, keepdim=True) - p) * row_weight[:, None]
    return ce, x.argmax(-1), g.to(logits.dtype)


@functools.lru_cache(maxsize=None)
def _compiled_soft_ce_grad():
    # static shapes: ttt_loss_fused pads the rows to a multiple of the chunk, so one graph serves
    return torch.compile(_soft_ce_grad, dynamic=False, fullgraph=True)


def ttt_loss_fused(outs, lm_head_weight, draft_ids, targets, decay=0.8, chunk=4096, compiled=False):
    """``ttt_loss`` computed in one pass over all steps' rows (``_LinearSoftCE``): the same loss and
    stats, no logits kept for backward, no host synchronisation when ``targets["plan"]``
    (``ttt_loss_plan``, made on the host) is given."""
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
    decay_j = decay ** torch.arange(J, device=w.device, dtype=torch.float32)
    row_weight = w * (decay_j / w_sum.clamp(min=1))[step]
    need_h = torch.is_grad_enabled() and hidden.requires_grad
    need_w = torch.is_grad_enabled() and lm_head_weight.requires_grad
    n = len(p_index)
    if compiled:  # rows padded to a multiple of chunk (weight 0, so no loss and no gradient);
        chunk = min(chunk, 1024)  # small chunks: little padding, and the matmuls stay large enough
        pad = (-n) % chunk
        hidden = F.pad(hidden, (0, 0, 0, pad))
        loss, ce, top = _LinearSoftCE.apply(hidden, lm_head_weight, targets["probs"], F.pad(p_index, (0, pad)),
                                            F.pad(row_weight, (0, pad)), chunk, need_h, need_w, True)
        ce, top = ce[:n], top[:n]
    else:
        loss, ce, top = _LinearSoftCE.apply(hidden, lm_head_weight, targets["probs"], p_index, row_weight, chunk, need_h, need_w)
    hits = (draft_ids[top] == targets["argmax"][p_index]).float()
    stats = torch.stack([per_step(ce * w), w_sum, per_step(hits), per_step(torch.ones_like(w))], dim=1)
    return loss, stats
