"""predict: the offline simulation of vLLM's chain speculation (acceptance math, greedy verification,
the draft's own proposals, the prediction over a tiny random target). Fast: no vLLM."""

import pytest
import torch

from eaglenest.draft.model import Eagle3Draft
from eaglenest.vllm_facts import acceptance, per_step
from eaglenest.validation.predict import (counts_from_accepted, load_exported_draft, ngram_acceptance, ngram_proposal,
                                         offline_acceptance, simulate_chain)


def test_acceptance_math_edge_cases():
    none = acceptance({"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": {}}, 3)
    assert none["acceptance_length"] is None and none["per_position"] is None
    # all rejected: length 1; all accepted: k + 1
    assert acceptance(counts_from_accepted([0, 0, 0], 3), 3)["acceptance_length"] == 1.0
    full = acceptance(counts_from_accepted([3, 3], 3), 3)
    assert full["acceptance_length"] == 4.0 and full["acceptance_rate"] == 1.0 and full["per_position"] == [1.0, 1.0, 1.0]
    mixed = counts_from_accepted([0, 1, 3, 2], 3)
    assert mixed == {"drafts": 4, "draft_tokens": 12, "accepted": 6, "accepted_per_pos": {0: 3, 1: 2, 2: 1}}
    # per-position rates never rise with the position: position i needs all before it
    per = acceptance(mixed, 3)["per_position"]
    assert per == sorted(per, reverse=True)


def test_per_step_counts_the_undrafted_steps_of_an_ngram_like_run():
    """Two requests, hand-counted. The first (10 tokens): its prefill token, then steps yielding 1 (no
    draft), 3 (draft, 2 accepted), 1 (no draft), 1 (draft, 0 accepted), 3 (draft, 2 accepted). The second
    (6 tokens): its prefill token, then 5 steps without a draft. 10 steps, 3 drafted, 4 accepted."""
    counts = {"drafts": 3, "draft_tokens": 9, "accepted": 4, "accepted_per_pos": {0: 2, 1: 2}}
    got = per_step(counts, completion_tokens=10 + 6, requests=2)
    assert got["decode_steps"] == 10
    assert got["tokens_per_step"] == pytest.approx(14 / 10) and got["drafted_share"] == pytest.approx(3 / 10)
    # vLLM's own figure counts the drafted steps only: far above what a step yields
    assert acceptance(counts, 3)["acceptance_length"] == pytest.approx(1 + 4 / 3)


def test_per_step_equals_vllms_figure_when_every_step_drafts():
    """EAGLE-3-like: every decode step drafts. Request one: prefill token, steps accepting 3, 1, 0 (4 + 2 + 1
    tokens: 8 in all); request two: prefill token, steps accepting 2, 1 (3 + 2: 6 in all)."""
    counts = counts_from_accepted([3, 1, 0, 2, 1], 3)
    got = per_step(counts, completion_tokens=8 + 6, requests=2)
    assert got["decode_steps"] == 5 and got["drafted_share"] == 1.0
    assert got["tokens_per_step"] == pytest.approx(acceptance(counts, 3)["acceptance_length"]) == pytest.approx(12 / 5)


def test_per_step_guards_tokens_accepted_past_the_end_and_empty_runs():
    # One request of 5 tokens (max_tokens 5): prefill token, a step accepting 2 (3 tokens), then a step that
    # accepts 3 of which the request keeps 1. G - R - A = 5 - 1 - 5 = -1 steps: never fewer than the 2 drafts.
    got = per_step({"drafts": 2, "accepted": 5}, completion_tokens=5, requests=1)
    assert got == {"tokens_per_step": 2.0, "drafted_share": 1.0, "decode_steps": 2}
    none = {"tokens_per_step": None, "drafted_share": None, "decode_steps": None}
    assert per_step({"drafts": 0, "accepted": 0}, completion_tokens=0, requests=0) == none
    assert per_step({"drafts": 0, "accepted": 0}, completion_tokens=3, requests=3) == none  # one token each: no step
    # the target alone: no counters, one token a step
    assert per_step({}, completion_tokens=30, requests=3) == {"tokens_per_step": 1.0, "drafted_share": 0.0,
                                                                "decode_steps": 27}


def test_simulate_chain_walks_like_greedy_verification():
    tokens = list(range(100, 112))  # prompt 100..103, completion 104..111 (index 4..11)
    k = 3
    perfect = torch.tensor([[100 + t + 2 + j for j in range(k)] for t in range(len(tokens))])  # row t: tokens[t+2..]
    acc = simulate_chain(perfect, tokens, 4, k)
    # m = 4: accept 5,6,7 (+bonus 8) -> m = 8: accept 9,10,11 -> end
    assert acc == [3, 3]
    wrong = torch.full((len(tokens), k), -1)
    assert simulate_chain(wrong, tokens, 4, k) == [0] * 7  # one token a step: 7 steps after the first token
    # k = 1: one draft token per step, each accepted; the last bonus would fall past the end
    assert simulate_chain(perfect[:, :1], tokens, 4, 1) == [1, 1, 1, 1]
    # a completion of one token: no draft is ever verified
    assert simulate_chain(perfect, tokens[:5], 4, k) == []


def test_simulate_chain_verifies_past_the_end_like_vllm():
    """vLLM verifies a whole draft before its stop check: a draft holding the eos and then what the
    target says after it is accepted in full (and counted), though the request ends at the eos."""
    tokens = list(range(100, 112))
    k = 3
    perfect = torch.tensor([[100 + t + 2 + j for j in range(k)] for t in range(len(tokens))])
    # completion ends at index 9 (the eos, say); 10 and 11 are the target's continuation after it
    assert simulate_chain(perfect, tokens, 4, k, end=9) == [3, 3]  # the second draft covers 9, 10, 11
    assert simulate_chain(perfect, tokens[:10], 4, k) == [3, 1]  # without the continuation: rejected there


def test_ngram_proposal_takes_the_longest_suffix_and_its_first_occurrence():
    # [1, 2] occurs at 0 and 3: the first occurrence's followers, k of them
    assert ngram_proposal([1, 2, 7, 1, 2, 8, 9, 1, 2], 3, 2, 3) == [7, 1, 2]
    # the 3-gram [8, 1, 2] beats the 2-gram [1, 2]: it occurs once, followed by 5
    assert ngram_proposal([1, 2, 7, 8, 1, 2, 5, 8, 1, 2], 3, 2, 3) == [5, 8, 1]
    # fewer than k tokens follow the match: what there is
    assert ngram_proposal([5, 1, 2, 1, 2], 3, 2, 3) == [1, 2]
    # no earlier occurrence of at least prompt_lookup_min tokens: no draft
    assert ngram_proposal([1, 2, 3, 4, 2], 3, 2, 3) == [] and ngram_proposal([1, 2, 3, 4, 2], 3, 1, 3) == [3, 4, 2]
    assert ngram_proposal([4], 3, 1, 3) == []


def test_ngram_proposal_is_vllms():
    """Against vLLM's own function (its Python body, not compiled) on random short-alphabet contexts."""
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as theirs

    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        context = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        lo, hi = (1, 3) if trial % 2 else (2, 5)
        want = theirs.py_func(np.array(context, dtype=np.int32), lo, hi, 10_000, 3).tolist()
        assert ngram_proposal(context, 3, lo, hi) == want, (context, lo, hi)


def test_ngram_acceptance_counts_steps_by_hand():
    """k 3, n-grams of 2 or 3. Prompt 10 11 12 13; completion 10 11 12 14 10 11 12 13 15 (indices 4 to 12 of
    the sequence). Index 4 is the prefill's. Steps: after ..13 10 no earlier [13 10] or [12 13 10]: 1 token (11).
    After ..10 11: [10 11] first at 0, draft 12 13 10 against 12 14 10: 1 accepted, 2 tokens (12 14). After
    ..12 14 and ..14 10: no match, 1 token each (10, 11). After ..10 11: draft 12 13 10 again (the first
    occurrence; the later one would offer 12 14 10) against 12 13 15: 2 accepted, 3 tokens. 5 steps, 2 drafted,
    3 accepted, 8 tokens after the first."""
    seq = ([10, 11, 12, 13], [10, 11, 12, 14, 10, 11, 12, 13, 15])
    out = ngram_acceptance([seq, ([1, 2], [])], 3, 2, 3)
    assert (out["drafts"], out["draft_tokens"], out["accepted"], out["decode_steps"]) == (2, 6, 3, 5)
    assert out["tokens_per_step"] == pytest.approx(8 / 5) and out["drafted_share"] == pytest.approx(2 / 5)
    assert out["acceptance_length"] == pytest.approx(1 + 3 / 2)  # vLLM's figure: per drafted step
    assert out["per_position"] == pytest.approx([1.0, 0.5, 0.0])
    assert out["sequences"] == 2 and out["completion_tokens"] == 9
    # A repetitive completion drafts on every step: after ..3 1, [1] first at 0 offers 2 3 1, all accepted (4
    # tokens); after ..1 2, [3 1 2] offers 3 1 2, of which 3 1 are accepted and end the completion: the bonus
    # falls past the end. 6 tokens kept over 2 steps, though vLLM counts 5 accepted over 2 drafts.
    loop = ngram_acceptance([([1, 2, 3], [1, 2, 3, 1, 2, 3, 1])], 3, 1, 3)
    assert (loop["drafts"], loop["accepted"], loop["decode_steps"], loop["drafted_share"]) == (2, 5, 2, 1.0)
    assert loop["tokens_per_step"] == 3.0 and loop["acceptance_length"] == 3.5


# ----------------------------------------------------------------------------- offline, tiny random target

VOCAB, HIDDEN = 100, 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama target and an untrained draft exported for it in vLLM's format."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglenest.draft.export import write_draft
    from eaglenest.draft.config import DraftConfig
    from eaglenest.draft.model import Eagle3Draft
    from eaglenest.states.target import TargetFacts

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1,
                      bos_token_id=0, pad_token_id=2)
    target = LlamaForCausalLM(cfg).eval()
    dcfg = DraftConfig(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, target_vocab_size=VOCAB, draft_vocab_size=40, target_hidden_size=HIDDEN,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=256)
    draft = Eagle3Draft(dcfg)
    ids = torch.arange(0, VOCAB, 2)[:40]  # every other target id: d2t = offsets, not zero
    d2t, t2d = ids - torch.arange(40), torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    draft.set_target(target.get_input_embeddings().weight, d2t, t2d)
    info = TargetFacts.of(cfg, [1, 2, 3], "tiny")
    write_draft(root / "draft", dcfg, info, draft.state_dict(), None, None, "float32")
    return target, root / "draft", draft


def _sequences(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, VOCAB, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist(),
             torch.randint(3, VOCAB, (int(torch.randint(10, 30, (1,), generator=g)),), generator=g).tolist())
            for _ in range(n)]


def test_exported_draft_loads_as_vllm_reads_it(tiny):
    _, draft_dir, original = tiny
    emb = torch.randn(VOCAB, HIDDEN)
    model, config = load_exported_draft(draft_dir, emb)
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert torch.equal(model.d2t, original.d2t) and torch.equal(model.fc.weight, original.fc.weight)
    assert model.config.norm_before_residual is False and torch.equal(model.embed_weight, emb)
    assert model.rotary_emb.inv_freq.dtype == torch.float32
    bf16, _ = load_exported_draft(draft_dir, emb, dtype=torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16 and bf16.rotary_emb.inv_freq.dtype == torch.float32


def test_propose_matches_a_step_by_step_proposer(tiny):
    """The batched chains equal a plain loop that drafts at one position with a growing KV list."""
    target, draft_dir, _ = tiny
    draft, _ = load_exported_draft(draft_dir, target.get_input_embeddings().weight)
    T, k = 12, 3
    tokens = torch.randint(3, VOCAB, (T,))
    aux = torch.randn(T, 3 * HIDDEN)
    batched = draft.propose(tokens, aux, k)
    assert batched.shape == (T, k) and (batched[-1] == -1).all()
    assert set(batched[:-1].flatten().tolist()) <= set(draft.draft_ids().tolist())  # target ids of draft tokens
    with torch.no_grad():
        nxt = tokens[1:]
        h0 = draft.fc(aux[:-1]).unsqueeze(0)
        emb0 = torch.nn.functional.embedding(nxt, draft.embed_weight).unsqueeze(0)
        cos, sin = draft.rotary_emb(h0, torch.arange(T - 1).unsqueeze(0))
        causal = torch.ones(T - 1, T - 1, dtype=torch.bool).tril()
        out0, kv0 = draft.midlayer(emb0, h0, cos, sin, [], causal)
        for t in (0, 4, T - 2):
            hidden = out0[:, t : t + 1]
            tok = draft.draft_ids()[(draft.norm(hidden) @ draft.lm_head.weight.T).argmax(-1)]
            chain = [int(tok)]
            keys = [(kv0[0][:, :, : t + 1], kv0[1][:, :, : t + 1])]
            for j in range(1, k):
                emb = torch.nn.functional.embedding(tok, draft.embed_weight)
                c, s = draft.rotary_emb(hidden, torch.tensor([[t + j]]))
                mask = torch.ones(1, t + 1 + j, dtype=torch.bool)
                hidden, kv = draft.midlayer(emb, hidden, c, s, keys, mask)
                keys.append(kv)
                tok = draft.draft_ids()[(draft.norm(hidden) @ draft.lm_head.weight.T).argmax(-1)]
                chain.append(int(tok))
            assert batched[t].tolist() == chain, t


def test_offline_acceptance_on_a_tiny_random_target(tiny):
    target, draft_dir, _ = tiny
    k = 3
    out = offline_acceptance(None, draft_dir, k=k, sequences=_sequences(), dtype="float32", device="cpu",
                             model=target, progress=False)
    assert 1.0 <= out["acceptance_length"] <= k + 1
    assert 0.0 <= out["acceptance_rate"] <= 1.0 and len(out["per_position"]) == k
    assert out["per_position"] == sorted(out["per_position"], reverse=True)
    assert out["drafts"] > 0 and out["draft_tokens"] == k * out["drafts"]
    assert out["acceptance_length"] == pytest.approx(1 + sum(out["per_position"]))
    assert out["tokens_source"] == "given" and out["aux_layers"] == [1, 2, 3]
    assert 0.0 <= out["target_agreement"] <= 1.0  # random sequences: not this target's greedy answers
    # every simulated step drafts; tokens accepted past a sequence's end are not kept
    assert out["drafted_share"] == 1.0 and out["decode_steps"] == out["drafts"]
    assert out["tokens_per_step"] <= out["acceptance_length"]


def test_offline_acceptance_counts_what_a_perfect_chain_would(tiny, monkeypatch):
    """With proposals equal to the sequence itself every draft is fully accepted: length k + 1
    (but for the last steps, where fewer than k tokens remain)."""
    target, draft_dir, _ = tiny
    k = 2

    def oracle(draft, tokens, aux, k):
        T = len(tokens)
        return torch.tensor([[int(tokens[t + 2 + j]) if t + 2 + j < T else -1 for j in range(k)] for t in range(T)])

    monkeypatch.setattr(Eagle3Draft, "propose", oracle)
    seqs = [(list(range(3, 8)), list(range(10, 10 + 3 * 7 + 1)))]  # first token + 7 full steps of 3
    out = offline_acceptance(None, draft_dir, k=k, sequences=seqs, dtype="float32", device="cpu", model=target, progress=False)
    assert out["acceptance_length"] == pytest.approx(k + 1) and out["per_position"] == [1.0, 1.0]
    assert out["drafts"] == 7
    assert out["tokens_per_step"] == pytest.approx(3 * 7 / 7) and out["drafted_share"] == 1.0  # 21 tokens, 7 steps


def test_offline_generates_greedy_sequences_when_none_given(tiny, tmp_path):
    """prompts -> the target's own greedy answers: its agreement with them is then 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target, draft_dir, _ = tiny
    vocab = {f"t{i}": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core,
                                  bos_token="t0", eos_token="t1", pad_token="t2", unk_token="t3",
                                  chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    tok.save_pretrained(tmp_path / "tok")
    target.generation_config.eos_token_id = 1
    prompts = [{"id": "a", "messages": [{"role": "user", "content": "t5 t6 t7"}]},
               {"id": "b", "messages": [{"role": "user", "content": "t9 t8"}]}]
    out = offline_acceptance(tmp_path / "tok", draft_dir, k=2, prompts=prompts, max_tokens=12, dtype="float32",
                             device="cpu", model=target, progress=False)
    assert out["tokens_source"] == "generated" and out["target_agreement"] == 1.0
    assert 1.0 <= out["acceptance_length"] <= 3.0 and out["sequences"] == 2
