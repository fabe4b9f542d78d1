"""The targets the draft is trained against: the target's distribution over the draft vocabulary at the
scored positions of a batch (``target_distribution``), from the rows of the target's head on the device
(``target_head_rows``)."""

import torch

from ..util import say
from .batches import loss_rows


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
