"""Training-time test (TTT) plumbing: which keys each draft step sees (dense masks and flex
BlockMasks), which positions still carry a scored token (``ttt_chains``), and the per-step gradient
aliases of ``split_step_grads``; the same pattern for all steps at once for P-EAGLE's one forward
(``parallel_mask``, ``parallel_block_mask``, ``parallel_positions``)."""

import dataclasses
import functools

import torch
import torch.nn.functional as F


from .layers import FLEX_BLOCK

def token_embeds_ids(input_ids, ttt_length):
    """[B, T+ttt_length-1]: the tokens whose embeddings the TTT reads (step j at base t reads the
    token at t+1+j, i.e. column t+j); past the end, token 0, whose rows carry no loss."""
    return F.pad(input_ids, (0, ttt_length))[:, 1:]


def ttt_mask(T, step, device=None):
    """[T, (step+1)*T] bool: step 0's keys causally, then one diagonal block per later step."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    diag = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)



def parallel_mask(T, J, device=None):
    """[J·T, J·T] bool: every step's ``ttt_mask`` at once (P-EAGLE's one forward, step j's rows and keys
    at j·T..(j+1)·T): step 0's keys causally, then the diagonal of each step up to the query's own."""
    rows = [F.pad(ttt_mask(T, j, device), (0, (J - 1 - j) * T)) for j in range(J)]
    return torch.cat(rows, dim=0)


def parallel_positions(T, J, device=None):
    """[J·T] int64: the rope position of each column of P-EAGLE's one forward, t + j at j·T + t."""
    return (torch.arange(J, device=device)[:, None] + torch.arange(T, device=device)).flatten()


@functools.lru_cache(maxsize=32)
def parallel_block_mask(T, J, device):
    """``parallel_mask`` as a flex-attention BlockMask (its blocks outside step 0's causal part and the
    diagonals are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def allowed(b, h, q, k):
        return torch.where(k < T, k <= q % T, ((k % T) == (q % T)) & (k // T <= q // T))

    return create_block_mask(allowed, None, None, J * T, J * T, device=device, BLOCK_SIZE=FLEX_BLOCK)


@functools.lru_cache(maxsize=None)
def _ttt_mask_mod(T):
    """``ttt_mask``'s pattern over key buffers of any number of steps (step i's keys at i*T..(i+1)*T):
    one function object per T, so a compiled step sees the same mask_mod at every step."""

    def allowed(b, h, q, k):
        return torch.where(k < T, k <= q, (k % T) == q)

    return allowed


@functools.lru_cache(maxsize=32)
def causal_block_mask(T, device):
    """Flex attention's BlockMask of a causal [T, T] mask (``diag_split``'s part over step 0)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q, k):
        return k <= q

    return create_block_mask(causal, None, None, T, T, device=device, BLOCK_SIZE=FLEX_BLOCK)


@functools.lru_cache(maxsize=32)
def ttt_block_masks(T, ttt_length, device):
    """One flex-attention BlockMask per TTT step j over a key buffer of ``ttt_length * T`` keys: it
    lists only the blocks of steps <= j (the causal blocks of step 0 and one diagonal block row per
    later step), so step j costs about what step 0 does and never reads the unwritten part of the
    buffer. ``T`` must be a multiple of FLEX_BLOCK: then no block straddles two steps and the shared
    mask_mod (``_ttt_mask_mod``) needs no step limit. Same shapes and mask_mod at every j.
    The block lists, not the mask_mod, keep later steps out: only a compiled flex kernel honours
    them (``Attention.attend`` always compiles it on CUDA; an uncompiled call would read later slots)."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    if T % FLEX_BLOCK:
        raise ValueError(f"flex TTT attention needs T a multiple of {FLEX_BLOCK}, got {T} (train pads batches to it)")
    mod = _ttt_mask_mod(T)
    masks = []
    for j in range(ttt_length):
        limit = (j + 1) * T

        def limited(b, h, q, k, limit=limit):
            return (k < limit) & mod(b, h, q, k)

        bm = create_block_mask(limited, None, None, T, ttt_length * T, device=device, BLOCK_SIZE=FLEX_BLOCK)
        masks.append(
            BlockMask.from_kv_blocks(
                bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=mod, seq_lengths=(T, ttt_length * T),
            )
        )
    return masks


def mark_chains_dynamic(args):
    """``Eagle3Draft._chains_step``'s arguments: the chains' count N, which varies by batch, made a
    dynamic dimension of the compiled step (one graph per batch shape, not one per N)."""
    _, e_index, hidden, cos, sin, _, _, kd, vd, _, chains = args
    for t, dim in ((e_index, 0), (hidden, 0), (cos, 1), (sin, 1), (kd, 0), (vd, 0), (chains, 0)):
        torch._dynamo.mark_dynamic(t, dim)


def step_weights(shared, collect):
    """``split_step_grads``: one TTT step's aliases of the ``shared`` parameters (the same storage,
    leaves of their own, so that step's gradients land apart, in ``collect``); None without."""
    if not shared:
        return None
    weights = {n: p.detach().requires_grad_() for n, p in shared.items()}
    for i, w in enumerate(weights.values()):
        w.register_post_accumulate_grad_hook(collect.hook(i))
    return weights


@dataclasses.dataclass
class StepWeights:
    """What ``split_step_grads`` hands every TTT step in place of the parameters: its own aliases of
    ``shared`` (``step_weights``, gradients into ``collect``) and ``casts``, tensors made once per
    training step (``fp8.weight_casts``), by name."""

    shared: dict
    collect: "StepGrads"
    casts: dict

    def weights(self):
        return {**step_weights(self.shared, self.collect), **self.casts}


class StepGrads:
    """``split_step_grads``: collects the step aliases' gradients as autograd stores them (a
    post-accumulate hook takes each alias's ``.grad`` and drops it from the alias: no copy) and, at
    the end of that backward, gives each parameter their sum (added to a gradient it already has,
    as when micro-batches accumulate). Holds no alias, so nothing outlives the backward."""

    def __init__(self, params, compiled=False):
        self.params, self.compiled = params, compiled  # compiled: the sum as one kernel per parameter
        self.parts = [[] for _ in params]
        self.queued = False

    def hook(self, i):
        def take(alias):
            self.parts[i].append(alias.grad)
            alias.grad = None
            if not self.queued:  # once per backward: sum when the engine is done
                self.queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)

        return take

    def finish(self):
        parts, self.parts, self.queued = self.parts, [[] for _ in self.params], False
        for p, total in zip(self.params, (_compiled_sum_parts() if self.compiled else _sum_parts)(parts)):
            if total is None:
                continue
            if p.grad is None:
                p.grad = total
            else:
                p.grad += total


def _sum_parts(parts):
    """Each list's sum, in fp32, rounded once to the parts' dtype and written into its first part."""
    out = []
    for ps in parts:
        if not ps:
            out.append(None)
            continue
        total = ps[0].float()
        for g in ps[1:]:
            total = total + g.float()
        out.append(ps[0].copy_(total))
    return out


@functools.lru_cache(maxsize=None)
def _compiled_sum_parts():
    # one kernel per parameter reading every step's gradient once; static shapes: one graph a run
    return torch.compile(_sum_parts, dynamic=False)


# ----------------------------------------------------------------------------- loss


def ttt_loss_plan(rows, T, ttt_length, n_flat, chains=False):
    """Which (step, base position) rows ``ttt_loss_fused`` scores, from ``targets["rows"]`` (any
    device; train.py makes it on the host, in the loader thread, so the step never waits on it).

    Step j scores base t = q-1-j for each loss position q with q % T >= 1+j. Returns int64 tensors
    over those N rows: ``h_index`` into the steps' outputs stacked [J·n_flat] (n_flat = B·T),
    ``p_index`` into the targets' rows, ``step`` the step j; with ``chains`` (``skip_unscored``)
    also ``chains``, the positions the later steps run at (``ttt_chains``)."""
    t = rows % T
    h_index, p_index, step = [], [], []
    for j in range(ttt_length):
        sel = (t >= 1 + j).nonzero().squeeze(1)
        p_index.append(sel)
        h_index.append(rows[sel] - 1 - j + j * n_flat)
        step.append(torch.full_like(sel, j))
    plan = {"h_index": torch.cat(h_index), "p_index": torch.cat(p_index), "step": torch.cat(step)}
    if chains:
        plan["chains"] = ttt_chains(rows, T, ttt_length, n_flat)
    return plan


def ttt_chains(rows, T, ttt_length, n_flat, multiple=16):
    """The flat base positions (b·T + t, sorted) at which the TTT steps after step 0 run under
    ``skip_unscored``: those whose chain scores a token at some step j >= 1 (a loss row q = t+1+j
    in ``rows`` with q % T >= 1+j, as ``ttt_loss_plan``). Padded with unscored positions to a
    multiple of ``multiple`` (at least ``multiple``, at most n_flat): rounder matrix shapes."""
    need = torch.zeros(n_flat, dtype=torch.bool, device=rows.device)
    t = rows % T
    for j in range(1, ttt_length):
        need[rows[t >= 1 + j] - 1 - j] = True
    n = int(need.sum())
    extra = min(n_flat, max(multiple, -(-n // multiple) * multiple)) - n
    if extra:
        need[(~need).nonzero().squeeze(1)[:extra]] = True
    return need.nonzero().squeeze(1)


class GatherRows(torch.autograd.Function):
    """``x.index_select(0, index)`` for an ``index`` without repeats: its backward copies the rows
    back (index_copy) instead of index_select's atomic index_add, which is slower at real sizes
    (benchmarks/RESULTS.md, "Figures moved out of code comments")."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.new_zeros((ctx.rows, *grad.shape[1:])).index_copy_(0, index, grad), None
