"""The draft vocabulary: the most frequent completion tokens of the traces (every assistant turn's, in a
conversation: the tokens training scores, ``data.sequences``).

``vocab.safetensors`` holds vLLM's two maps (their convention: ``vllm_format``):

    d2t  int64 [draft_vocab]  offsets: target_id = draft_id + d2t[draft_id]
    t2d  bool  [vocab]        True where a target token is in the draft vocabulary

Draft ids follow ascending target ids, so every offset is non-negative. Ties in frequency go to the
lower target id; tokens never seen fill any remaining places, lowest ids first.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..settings import DraftSettings
from ..data.sequences import read_training_sequences
from ..util import save_safetensors, say
from .vllm_format import d2t_from_target_ids, draft_to_target_ids


def select_vocab(counts, draft_vocab_size):
    """Target ids of the draft vocabulary, ascending: top ``draft_vocab_size`` by count, ties by id."""
    counts = np.asarray(counts)
    ranked = np.lexsort((np.arange(len(counts)), -counts))  # last key is primary: count desc, then id asc
    return np.sort(ranked[: min(draft_vocab_size, len(counts))])


def maps_from_ids(target_ids, target_vocab_size):
    """``(d2t, t2d)`` for ascending target ids."""
    target_ids = torch.as_tensor(np.asarray(target_ids), dtype=torch.int64)
    d2t = d2t_from_target_ids(target_ids)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


def build_vocab(trace_paths, out_path, target_vocab_size, settings: DraftSettings | None = None) -> dict:
    """Count completion tokens over all traces and save ``d2t``/``t2d`` to ``out_path``: the
    ``settings.vocab_size`` most frequent (None: the schema's defaults)."""
    settings = settings or DraftSettings.defaults()
    draft_vocab_size, use_truncated = settings.vocab_size, settings.use_truncated
    if isinstance(trace_paths, (str, Path)):
        trace_paths = [trace_paths]
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    record_counts = {}
    for _, ids, spans in read_training_sequences(trace_paths, use_truncated, record_counts):
        tokens = np.concatenate([np.asarray(ids[start:end], dtype=np.int64) for start, end in spans])
        if tokens.min() < 0 or tokens.max() >= target_vocab_size:
            raise ValueError(
                f"a completion token id ({tokens.min()}..{tokens.max()}) is outside the target vocabulary of "
                f"{target_vocab_size} in {[str(p) for p in trace_paths]}: wrong target or vocab size?"
            )
        counts += np.bincount(tokens, minlength=target_vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise ValueError(f"no completion tokens in {[str(p) for p in trace_paths]} ({record_counts})")
    ids = select_vocab(counts, draft_vocab_size)
    d2t, t2d = maps_from_ids(ids, target_vocab_size)
    stats = {
        # the counts vocab.safetensors has always held (a conversation's answers count in completion_tokens)
        **{k: record_counts[k] for k in ("records", "skipped_truncated", "skipped_empty")},
        "completion_tokens": total,
        "distinct_tokens": int((counts > 0).sum()),
        "target_vocab_size": target_vocab_size,
        "draft_vocab_size": len(ids),
        "coverage": float(counts[ids].sum() / total),  # share of completion tokens the draft can emit
    }
    save_safetensors({"d2t": d2t, "t2d": t2d}, out_path, {"stats": json.dumps(stats)})
    say(
        f"build_vocab: {len(ids)} of {target_vocab_size} tokens cover {stats['coverage']:.2%} of {total} completion "
        f"tokens ({stats['records']} records) -> {out_path}"
    )
    return stats


def load_vocab(path):
    """``(d2t, t2d)`` from a vocab file, checked against each other."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    ids = draft_to_target_ids(d2t)
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or int(t2d.sum()) != len(d2t) or not bool(t2d[ids].all()):
        raise ValueError(f"{path}: d2t and t2d do not describe the same draft vocabulary")
    return d2t, t2d
