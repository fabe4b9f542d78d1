"""The offline prediction of vLLM's acceptance: greedy chain speculation simulated with the
transformers target and the exported draft; and vLLM's n-gram (prompt lookup) speculation simulated
over the same greedy sequences (``ngram_acceptance``), so both methods' tokens per target step
(``vllm_facts.per_step``) can be compared on the same prompts without a server.

The draft is read back from its export the way vLLM reads it (``vllm_format``); at every position of
each greedy sequence it proposes the chain vLLM's proposer would (``Eagle3Draft.propose``), and
``simulate_chain`` walks the sequence with greedy verification. It is the number vLLM's counters are
checked against; on the toy the two agree to the token count.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..draft.vllm_format import draft_config_from_json, served_aux_layers, state_dict_from_vllm
from ..errors import ValidationError
from ..util import progress_bar
from ..vllm_facts import acceptance, per_step


def load_exported_draft(draft_dir, embed_weight, *, dtype=torch.float32, device="cpu"):
    """The exported draft as vLLM reads it (config.json keys, vLLM's defaults where absent) in an
    ``Eagle3Draft``, with the target's embedding. Returns ``(model, config)``."""
    from ..draft.export import load_exported
    from ..draft.model import Eagle3Draft

    config, tensors = load_exported(draft_dir)
    cfg = draft_config_from_json(config)
    model = Eagle3Draft(cfg)
    missing, unexpected = model.load_state_dict(state_dict_from_vllm(tensors, cfg), strict=False)
    if unexpected or [m for m in missing if m != "embed_weight"]:
        raise ValidationError(f"{draft_dir}: tensors do not fit an EAGLE-3 draft (missing {missing}, unexpected {unexpected})")
    model.to(device)
    # Weights in the serving dtype; the rope frequencies stay float32 (vLLM builds its cos/sin cache
    # in float32 too): a bf16 inv_freq turns far positions by a visible angle.
    for name, module in model.named_children():
        if name != "rotary_emb":
            module.to(dtype)
    model.set_embedding(embed_weight.detach().to(device, dtype))
    if cfg.parallel_drafting:  # a parameter of the model itself, which the loop above does not reach
        model.mask_hidden.data = model.mask_hidden.data.to(dtype)
    return model.eval(), config


def load_any_draft(draft_dir, embed_weight, num_target_layers: int):
    """``(draft, the vLLM ids of the target layers it reads)`` of an exported draft of any kind: a DFlash draft
    (its config.json has ``dflash_config``) or an EAGLE-3 one (eagle3, eagle3.1, peagle), in the embedding's
    dtype and device. Both propose with the same ``propose(input_ids, aux_hidden, k)`` rows."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    if "dflash_config" in config:
        from ..draft.dflash_format import load_dflash_draft

        draft, aux_layers = load_dflash_draft(draft_dir, embed_weight)
        rope = {name: b.clone() for name, b in draft.rotary_emb.named_buffers()}  # float32, as in load_exported_draft
        draft.to(embed_weight.device, embed_weight.dtype)
        for name, b in rope.items():
            setattr(draft.rotary_emb, name, b.to(embed_weight.device))
        return draft.eval(), list(aux_layers)
    draft, config = load_exported_draft(draft_dir, embed_weight, dtype=embed_weight.dtype, device=embed_weight.device)
    return draft, served_aux_layers(config, num_target_layers)


def simulate_chain(proposals, tokens, start: int, k: int, end: int | None = None) -> list[int]:
    """Accepted count of every draft when greedy speculation generates ``tokens[start:end+1]``.

    ``proposals`` [T, k] as ``Eagle3Draft.propose`` makes them. ``tokens`` is the whole greedy
    sequence (prompt + completion), optionally followed by the target's greedy continuation past the
    last generated token ``end`` (default: the last token). A draft is made each step after the
    target has sampled token m (from m = start) until token ``end`` is out; its j-th token is
    accepted while it equals tokens[m+1+j]; the target then adds one token (the bonus, or its
    correction). Like vLLM, which verifies a draft before its stop check, a draft that runs past
    ``end`` is still compared with the continuation there (an eos accepted mid-draft, then what the
    target would say after it); without a continuation, tokens past the end count as rejected.
    """
    end = len(tokens) - 1 if end is None else end
    last = len(tokens) - 1
    counts, m = [], start
    while m < end:
        chain = proposals[m - 1]
        a = 0
        while a < k and m + 1 + a <= last and int(chain[a]) == int(tokens[m + 1 + a]):
            a += 1
        counts.append(a)
        m += a + 1
    return counts


def counts_from_accepted(accepted: list[int], k: int, lengths: list[int] | None = None) -> dict:
    """Counter-shaped totals (as vLLM's /metrics would count them) from per-draft accepted counts;
    ``lengths``: each draft's token count where a proposer may offer fewer than k (n-gram), else k each."""
    return {
        "drafts": len(accepted),
        "draft_tokens": k * len(accepted) if lengths is None else sum(lengths),
        "accepted": sum(accepted),
        "accepted_per_pos": {i: sum(a > i for a in accepted) for i in range(k)},
    }


def offline_acceptance(target, draft_dir, *, k, sequences=None, prompts=None, max_tokens=256,
                       chat_template_kwargs=None, dtype="bfloat16", device="auto", model=None, progress=True) -> dict:
    """Predict vLLM's acceptance of the exported draft by simulating greedy chain speculation.

    The greedy sequences are ``sequences`` (``(prompt_ids, completion_ids)`` pairs, e.g. the answers
    of the target-alone vLLM run), or else generated from ``prompts`` with the transformers target.
    The target runs once over each whole sequence for its auxiliary states (and k tokens past its
    end, which vLLM's verifier also compares a draft with); the draft proposes its chains at every
    position; ``simulate_chain`` counts what greedy verification accepts. ``target_agreement``: the
    share of completion tokens that the transformers target would also choose (below 1: the
    sequences are not this target's greedy answers, e.g. served in another dtype).
    """
    from ..states.target import greedy_sequences, load_target, resolve_device, target_states

    t0 = time.time()
    device = resolve_device(device)
    if model is None:
        model = load_target(target, device=device, dtype=dtype)
    embed = model.get_input_embeddings().weight
    draft, aux_layers = load_any_draft(draft_dir, embed, model.config.get_text_config().num_hidden_layers)
    source = "given"
    if sequences is None:
        from transformers import AutoTokenizer

        source = "generated"
        tokenizer = AutoTokenizer.from_pretrained(target)
        sequences = greedy_sequences(model, tokenizer, prompts, max_tokens, chat_template_kwargs)
    accepted, agree, total, generated = [], 0, 0, 0
    for prompt_ids, completion in progress_bar(sequences, desc="offline", unit="seq", disable=not progress):
        if not completion:
            continue
        generated += 1
        tokens = list(prompt_ids) + list(completion)
        aux, greedy, tail = target_states(model, tokens, aux_layers, extra=k)
        agree += int((greedy[len(prompt_ids) - 1 : -1] == torch.tensor(completion)).sum())
        total += len(completion)
        proposals = draft.propose(torch.tensor(tokens), aux, k)
        accepted += simulate_chain(proposals, tokens + tail, len(prompt_ids), k, end=len(tokens) - 1)
    counts = counts_from_accepted(accepted, k)
    result = {**acceptance(counts, k), **per_step(counts, total, generated)}
    result.update({
        "sequences": len(sequences), "completion_tokens": total, "tokens_source": source,
        "target_agreement": agree / total if total else None, "dtype": str(embed.dtype).removeprefix("torch."),
        "aux_layers": aux_layers, "seconds": round(time.time() - t0, 1),
    })
    return result


# ----------------------------------------------------------------------------- n-gram, simulated


def ngram_proposal(context: list[int], k: int, prompt_lookup_min: int, prompt_lookup_max: int) -> list[int]:
    """What vLLM's n-gram proposer drafts after ``context`` (prompt + tokens generated so far):
    ``v1/spec_decode/ngram_proposer.py``, ``_find_longest_matched_ngram_and_propose_tokens``. The
    longest suffix of n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) that occurs
    earlier, ending before the last token; of its occurrences the first (vLLM keeps the earliest on a tie);
    then the up to ``k`` tokens that followed it, fewer where the context ends sooner. Empty: no draft.
    (vLLM also stops short of max_model_len, which the validation's requests never reach.)"""
    size = len(context)
    for n in range(min(prompt_lookup_max, size - 1), prompt_lookup_min - 1, -1):
        suffix = context[size - n:]
        for j in range(size - n):
            if context[j:j + n] == suffix:
                return context[j + n:j + n + k]
    return []


def ngram_steps(tokens: list[int], start: int, k: int, prompt_lookup_min: int, prompt_lookup_max: int):
    """Walk greedy verification of n-gram drafts through ``tokens`` (prompt + completion, the completion
    from index ``start``; its first token comes from the prefill) -> (accepted count of each draft,
    each draft's length). A step without a proposal makes no draft and yields one token; a drafted
    step's j-th token is accepted while it equals the sequence's, and the target adds one token."""
    accepted, lengths, m, last = [], [], start, len(tokens) - 1
    while m < last:
        chain = ngram_proposal(tokens[:m + 1], k, prompt_lookup_min, prompt_lookup_max)
        a = 0
        while a < len(chain) and m + 1 + a <= last and chain[a] == tokens[m + 1 + a]:
            a += 1
        if chain:
            accepted.append(a)
            lengths.append(len(chain))
        m += a + 1
    return accepted, lengths


def ngram_acceptance(sequences, k: int, prompt_lookup_min: int, prompt_lookup_max: int) -> dict:
    """vLLM's n-gram speculation simulated over greedy ``(prompt_ids, completion_ids)`` pairs (at T=0 its
    outputs are the target's greedy ones): the keys of ``offline_acceptance``'s acceptance figures
    (vLLM's per-draft definitions) with ``tokens_per_step`` and ``drafted_share`` (``vllm_facts.per_step``,
    as the live runs get them), and the sequences and completion tokens they cover."""
    accepted, lengths, total, generated = [], [], 0, 0
    for prompt_ids, completion in sequences:
        if not completion:
            continue
        generated += 1
        total += len(completion)
        got, sizes = ngram_steps([int(t) for t in (*prompt_ids, *completion)], len(prompt_ids), k,
                                 prompt_lookup_min, prompt_lookup_max)
        accepted += got
        lengths += sizes
    counts = counts_from_accepted(accepted, k, lengths)
    return {**acceptance(counts, k), **per_step(counts, total, generated), "sequences": len(sequences),
            "completion_tokens": total, "prompt_lookup_min": prompt_lookup_min, "prompt_lookup_max": prompt_lookup_max}
