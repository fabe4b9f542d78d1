"""The draft model: vLLM's tensor names and shapes, TTT causality, TTT == vLLM's step-by-step drafting, the loss mask."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from eaglenest.draft.config import KINDS, DraftConfig
from eaglenest.draft.losses import soft_cross_entropy, ttt_loss
from eaglenest.draft.model import Eagle3Draft
from eaglenest.draft.runtime import Runtime
from eaglenest.draft.vllm_format import tensor_shapes
from tests.support.tiny_draft import H, V, VD, inputs, make_model

J = 4  # TTT steps


def test_state_dict_is_vllms_tensors():
    model = make_model()
    shapes = tensor_shapes(model.config)
    state = model.state_dict()
    assert set(state) == set(shapes)  # no embed_tokens: vLLM shares the target's
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    outs = model(*inputs(), ttt_length=J)
    assert len(outs) == J and all(o.shape == (2, 12, H) for o in outs)


def test_hidden_size_must_match_the_shared_embedding():
    with pytest.raises(ValueError, match="shares the target's token embedding"):
        DraftConfig(
            hidden_size=16, intermediate_size=8, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
            target_vocab_size=V, draft_vocab_size=VD, target_hidden_size=H,
        )


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_ttt_never_sees_the_future(norm_before_residual):
    model = make_model(norm_before_residual=norm_before_residual)
    ids, aux = inputs(T=14)
    with torch.no_grad():
        ref = [model.lm_head(o) for o in model(ids, aux, ttt_length=J)]
        for cut in (3, 8):
            for j in range(J):
                # step j at base t reads aux up to t and tokens up to t+1+j: change everything later
                ids2, aux2 = ids.clone(), aux.clone()
                ids2[:, cut + 2 + j :] = (ids2[:, cut + 2 + j :] + 7) % V
                aux2[:, cut + 1 :] += torch.randn_like(aux2[:, cut + 1 :])
                out = model.lm_head(model(ids2, aux2, ttt_length=J)[j])
                torch.testing.assert_close(out[:, : cut + 1], ref[j][:, : cut + 1], rtol=0, atol=1e-5)
                assert not torch.allclose(out[:, cut + 1 :], ref[j][:, cut + 1 :])
                # ... and the token it is given does matter
                ids3 = ids.clone()
                ids3[:, cut + 1 + j] = (ids3[:, cut + 1 + j] + 7) % V
                assert not torch.allclose(model.lm_head(model(ids3, aux, ttt_length=J)[j])[:, cut], ref[j][:, cut])


def rms_norm(x, weight, eps):
    """vLLM's RMSNorm (forward_native): normalised in float32, cast back, times the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def vllm_combine(model, aux):
    """vLLM's combine_hidden_states: with norm_before_fc, the whole input through input_norm; with fc_norm, each aux layer's H_t-wide chunk through its own
    RMSNorm (fc_norm.{i}), concatenated again; then fc."""
    cfg = model.config
    if cfg.norm_before_fc:
        aux = rms_norm(aux, model.input_norm.weight, cfg.rms_norm_eps)
    if cfg.fc_norm:
        chunks = aux.split(cfg.target_hidden_size, dim=-1)
        assert len(chunks) == cfg.num_aux_layers
        aux = torch.cat([rms_norm(c, model.fc_norm[i].weight, cfg.rms_norm_eps) for i, c in enumerate(chunks)], dim=-1)
    return aux @ model.fc.weight.T


def vllm_style_drafts(model, ids, aux, t, steps, own_tokens=False):
    """What vLLM computes when it drafts after target position t: one pass over the prefix with the
    target's fused features (rope positions 0..t), then one token at a time, each attending to the
    prefix's keys and its own chain, at rope position t+i, fed the previous step's aux_output: the
    pre-norm sum, or with norm_output the normed output (llama_eagle3.py, LlamaModel.forward).
    Returns the normed outputs at t; with ``own_tokens`` step i reads the draft's own greedy token of
    step i-1 (vLLM's proposer) instead of the sequence's, and the drafted target ids come back too."""
    cfg = model.config

    def embed(tok):
        return F.embedding(tok, model.embed_weight)

    def fed(out):
        return rms_norm(out, model.norm.weight, cfg.rms_norm_eps) if cfg.norm_output else out

    def greedy(normed):
        return model.draft_ids()[(normed @ model.lm_head.weight.T).argmax(-1)]

    pos = torch.arange(t + 1)[None]
    hidden = vllm_combine(model, aux[:, : t + 1])
    cos, sin = model.rotary_emb(hidden, pos)
    causal = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()
    out, kv = model.midlayer(embed(ids[:, 1 : t + 2]), hidden, cos, sin, [], causal)
    past, hidden, outs = [kv], fed(out[:, t : t + 1]), [rms_norm(out[:, t], model.norm.weight, cfg.rms_norm_eps)]
    tokens = [greedy(outs[0])]
    for i in range(1, steps):
        cos, sin = model.rotary_emb(hidden, torch.tensor([[t + i]]))
        mask = torch.ones(1, t + 1 + i, dtype=torch.bool)
        tok = tokens[-1][:, None] if own_tokens else ids[:, t + 1 + i : t + 2 + i]
        out, kv = model.midlayer(embed(tok), hidden, cos, sin, past, mask)
        past.append(kv)
        hidden = fed(out)
        outs.append(rms_norm(out[:, 0], model.norm.weight, cfg.rms_norm_eps))
        tokens.append(greedy(outs[-1]))
    return (outs, torch.stack(tokens, dim=1)) if own_tokens else outs


EAGLE31 = KINDS["eagle3.1"]
PEAGLE = {**KINDS["peagle"], "mask_token_id": 7}
SEQUENTIAL = {kind: flags for kind, flags in KINDS.items() if not flags["parallel_drafting"]}
# speculators' trainer's EAGLE-3 default: one input_norm over fc's whole input, the normed output fed forward
VARIANTS = {**SEQUENTIAL, "speculators-default": {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}}


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_ttt_equals_vllm_step_by_step_drafting(kind):
    model = make_model(**VARIANTS[kind])
    assert model.config.kind == (kind if kind in KINDS else None)
    ids, aux = inputs(T=16)
    with torch.no_grad():
        ttt = model(ids, aux, ttt_length=J)
        for t in (0, 5, 11):
            for j, ref in enumerate(vllm_style_drafts(model, ids, aux, t, J)):
                torch.testing.assert_close(ttt[j][:, t], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_propose_drafts_what_vllm_would(kind):
    """The offline prediction's chains (``propose``) are vLLM's: its own greedy tokens fed back with
    the kind's fed-forward state, from the kind's fused features."""
    model = make_model(**VARIANTS[kind])
    ids, aux = inputs(B=1, T=16)
    proposals = model.propose(ids[0], aux[0], J)
    with torch.no_grad():
        for t in (0, 5, 14):
            _, tokens = vllm_style_drafts(model, ids, aux, t, J, own_tokens=True)
            assert proposals[t].tolist() == tokens[0].tolist(), t


def test_eagle31_switches_change_what_they_should():
    """On the same weights: fc_norm changes every step (the fused features), norm_output only the
    steps after the first (what is fed back); an EAGLE-3 draft ignores fc_norm's weights (it has none)."""
    ids, aux = inputs(T=16)
    full = make_model(**EAGLE31)
    assert sorted(n for n in full.state_dict() if n.startswith("fc_norm.")) == [f"fc_norm.{i}.weight" for i in range(3)]
    assert not any(torch.equal(w.weight, torch.ones(H)) for w in full.fc_norm)  # make_model moved them off ones
    fresh = Eagle3Draft(full.config)
    assert all(torch.equal(w.weight, torch.ones(H)) for w in fresh.fc_norm)  # initialised to ones
    state = {n: t for n, t in full.state_dict().items() if not n.startswith("fc_norm.")}
    runs = {}
    for fc_norm in (False, True):
        for norm_output in (False, True):
            model = Eagle3Draft(dataclasses.replace(full.config, fc_norm=fc_norm, norm_output=norm_output))
            model.load_state_dict(full.state_dict() if fc_norm else state, strict=False)
            model.embed_weight = full.embed_weight
            with torch.no_grad():
                runs[fc_norm, norm_output] = model.eval()(ids, aux, ttt_length=J)
    eagle3, eagle31 = runs[False, False], runs[True, True]
    for j in range(J):
        torch.testing.assert_close(eagle31[j], full(ids, aux, ttt_length=J)[j].detach())
        assert not torch.allclose(eagle31[j], eagle3[j], atol=1e-3), j
        assert not torch.allclose(runs[True, False][j], eagle3[j], atol=1e-3), j  # fc_norm: from step 0 on
    torch.testing.assert_close(runs[False, True][0], eagle3[0])  # norm_output: step 0 is the same ...
    for j in range(1, J):
        assert not torch.allclose(runs[False, True][j], eagle3[j], atol=1e-3), j  # ... the later ones are not


def test_positions_outside_the_draft_vocab_carry_no_loss():
    torch.manual_seed(0)
    B, T, Vd = 1, 10, VD
    lm_head = torch.randn(Vd, H)
    draft_ids = torch.arange(0, 2 * Vd, 2)
    rows = torch.arange(1, T)  # every position q >= 1 predicts a completion token
    targets = {
        "rows": rows,
        "probs": torch.softmax(torch.randn(len(rows), Vd), -1),
        "argmax": draft_ids[torch.randint(0, Vd, (len(rows),))],
        "in_draft": torch.tensor([True, False, True, True, False, True, True, True, False]),
    }
    outs = [torch.randn(B, T, H, requires_grad=True) for _ in range(2)]
    loss, stats = ttt_loss(outs, lm_head, draft_ids, targets)
    loss.backward()
    for j, out in enumerate(outs):
        # step j at base t is scored against q = t+1+j: a q without loss leaves base t without gradient
        for q, keep in zip(rows.tolist(), targets["in_draft"].tolist()):
            t = q - 1 - j
            if t >= 0:
                assert bool(out.grad[0, t].abs().sum() > 0) == keep
        assert stats[j, 1] == targets["in_draft"][rows % T >= 1 + j].sum()
    # changing the masked positions' draft logits leaves the loss unchanged
    moved = [o.detach().clone() for o in outs]
    moved[0][0, 1] += 5.0  # base 1 of step 0 is q = 2, masked
    assert torch.equal(ttt_loss(moved, lm_head, draft_ids, targets)[0], loss.detach())


def test_chunked_loss_matches_one_chunk():
    torch.manual_seed(0)
    h = torch.randn(37, H, requires_grad=True)
    w = torch.randn(VD, H, requires_grad=True)
    p = torch.softmax(torch.randn(37, VD), -1)
    rw = (torch.rand(37) > 0.3).float()
    one, top1 = soft_cross_entropy(h, w, p, rw, chunk=1000)
    g1 = torch.autograd.grad(one, (h, w))
    many, top2 = soft_cross_entropy(h, w, p, rw, chunk=8)
    g2 = torch.autograd.grad(many, (h, w))
    torch.testing.assert_close(one, many)
    assert torch.equal(top1, top2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


FAST_PATHS = [
    ("sdpa", True, False, False, False, False), ("sdpa", False, True, False, False, False), ("flex", True, True, False, False, False),
    ("flex", False, False, False, False, False), ("flex", True, False, True, False, False), ("flex", True, True, True, False, False),
    ("flex", True, False, False, True, False), ("flex", True, True, True, True, False), ("flex", False, False, True, True, False),
    ("flex", True, False, True, True, True), ("flex", True, True, True, True, True), ("flex", False, False, False, True, True),
]


# EAGLE-3.1 through one layout of each kind of step: recomputed, the key buffer with weight aliases,
# and the chains (whose steps take step 0's fed-forward output).
@pytest.mark.parametrize("attention,fused,recompute,split,diag,skip,kind", [(*v, "eagle3") for v in FAST_PATHS] + [
    ("sdpa", False, True, False, False, False, "eagle3.1"), ("flex", True, False, True, False, False, "eagle3.1"),
    ("flex", True, True, True, True, True, "eagle3.1"),
])
def test_fast_path_layouts_compute_the_reference(attention, fused, recompute, split, diag, skip, kind):
    """The GPU path's pieces (fixed-shape key buffer, fused loss, recomputation) give the reference
    path's loss, stats and gradients. On CPU the flex layout runs with dense masks over its buffer
    (flex attention has no CPU backward); the flex kernel itself is checked on the GPU
    (benchmarks/gpu_check.py). ``split``: each step's weight gradients apart, summed after backward;
    a second backward (a second micro-batch) adds to them. ``diag``: the later steps' keys attended
    on the diagonal, merged with step 0's causal part by log-sum-exp. ``skip``: the later steps run
    only at the chains that score a token (row 0 has a 40-token prompt, row 1 is padding from 90 on).
    ``kind``: the draft's (EAGLE-3.1 feeds the normed output forward and has fc_norm's gradients)."""
    torch.manual_seed(0)
    model = make_model(**KINDS[kind]).train()
    B, T = 2, 128  # the flex layout needs T a multiple of 128
    ids, aux = inputs(B=B, T=T)
    scored = (torch.rand(B, T) > 0.3) & torch.cat([torch.arange(T) >= 40, torch.arange(T) < 90]).view(B, T)
    rows = torch.nonzero(scored.flatten()).squeeze(1)
    targets = {"rows": rows, "probs": torch.softmax(torch.randn(len(rows), VD), -1),
               "argmax": model.draft_ids()[torch.randint(0, VD, (len(rows),))], "in_draft": torch.rand(len(rows)) > 0.2}
    results = []
    for variant in (("sdpa", False, False, False, False, False), (attention, fused, recompute, split, diag, skip)):
        model.runtime = Runtime(**dict(zip(("attention", "fused_loss", "recompute", "split_step_grads", "diag_split", "skip_unscored"), variant)))
        model.zero_grad(set_to_none=True)
        for _ in range(2):
            loss, stats = model(ids, aux, targets, ttt_length=J, chunk=50)  # several loss chunks
            loss.backward()
        results.append((loss.detach(), stats, [p.grad.clone() for p in model.parameters()]))
    (l0, s0, g0), (l1, s1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s1, s0, rtol=1e-5, atol=1e-3)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("diag", [False, True])
def test_step_with_weight_aliases_compiles_whole(diag):
    """The compiled TTT step (fullgraph) traces with per-step weight aliases, and with the diagonal
    split of its attention, and gives their gradients (dynamo and AOT autograd on CPU; inductor's
    kernels and flex attention are checked on the GPU)."""
    from eaglenest.draft.ttt import ttt_mask

    model = make_model().train()
    T = 16
    g = torch.Generator().manual_seed(3)
    embeds, hidden = torch.randn(1, T, H, generator=g), torch.randn(1, T, H, generator=g, requires_grad=True)
    cos, sin = model.rotary_emb(hidden, torch.arange(T).unsqueeze(0))
    attn = model.midlayer.self_attn
    kv = [torch.randn(1, attn.n_kv, 2 * T, attn.head_dim, generator=g) for _ in range(2)]  # step 1: step 0's keys written
    mask, valid = (ttt_mask(T, 0), torch.tensor([True])) if diag else (ttt_mask(T, 1), None)
    compiled = torch.compile(model._flex_step, backend="aot_eager", fullgraph=True, dynamic=False)
    grads = []
    for fn in (model._flex_step, compiled):
        weights = {n: p.detach().requires_grad_() for n, p in model.step_params().items()}
        out, normed, _, _ = fn(embeds, hidden, cos, sin, *kv, torch.arange(T) + T, mask, weights, valid)
        (out.sum() + normed.pow(2).sum()).backward()
        grads.append({n: w.grad for n, w in weights.items()})
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) > 5
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n])


def test_ttt_chains_are_the_positions_whose_chain_scores():
    """Brute force: base t of row b runs steps >= 1 iff some step j >= 1 scores token t+1+j of the
    same row; padded with unscored positions to a multiple of 16, sorted, distinct."""
    from eaglenest.draft.ttt import ttt_chains

    g = torch.Generator().manual_seed(5)
    B, T = 3, 128
    for density, J in ((0.05, 7), (0.5, 3), (0.0, 4), (1.0, 7)):
        scored = torch.rand(B, T, generator=g) < density
        scored[1, :60] = False  # a prompt
        rows = torch.nonzero(scored.flatten()).squeeze(1)
        chains = ttt_chains(rows, T, J, B * T)
        need = {b * T + t for b in range(B) for t in range(T) for j in range(1, J) if t + 1 + j < T and scored[b, t + 1 + j]}
        assert need <= set(chains.tolist()) and len(chains) == len(set(chains.tolist()))
        assert torch.equal(chains, chains.sort().values)
        assert len(chains) == max(16, -(-len(need) // 16) * 16)


def test_chains_step_compiles_once_for_any_chain_count():
    """The later steps' compiled graph (fullgraph, static shapes but the chains' count) serves
    batches of every chain count: dynamo and AOT autograd on CPU, against the eager step."""
    from eaglenest.draft.ttt import mark_chains_dynamic, ttt_mask

    model = make_model().train()
    attn = model.midlayer.self_attn
    B, T, Jn = 2, 16, 4
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(model._chains_step, backend=backend, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    k0, v0 = (torch.randn(B, attn.n_kv, T, attn.head_dim, generator=g, requires_grad=True) for _ in range(2))
    flat_embeds = torch.randn(B * (T + Jn - 1), H, generator=g)
    for n in (7, 12, 20, 9):
        chains = torch.randperm(B * T, generator=g)[:n].sort().values
        pos = chains % T
        h = torch.randn(n, H, generator=g, requires_grad=True)
        cos, sin = model.rotary_emb(h, (pos + 2).unsqueeze(0))
        kd = torch.randn(n, Jn - 1, attn.n_kv, attn.head_dim, generator=g, requires_grad=True)
        vd = torch.randn(n, Jn - 1, attn.n_kv, attn.head_dim, generator=g, requires_grad=True)
        args = (flat_embeds, chains // T * (T + Jn - 1) + pos + 2, h, cos, sin, k0, v0, kd, vd, torch.tensor([1]), chains)
        mark_chains_dynamic(args)
        results = []
        for fn in (model._chains_step, compiled):
            weights = {name: p.detach().requires_grad_() for name, p in model.step_params().items()}
            out, full, kd2, _ = fn(*args, ttt_mask(T, 0), weights, torch.arange(1, Jn) <= 2)
            (out.sum() + full.pow(2).sum() + kd2.sum()).backward()
            results.append((out.detach(), full.detach(), {name: w.grad for name, w in weights.items()}, h.grad))
            h.grad = None
        (o0, f0, g0, h0), (o1, f1, g1, h1) = results
        torch.testing.assert_close(o1, o0)
        torch.testing.assert_close(f1, f0)
        torch.testing.assert_close(h1, h0)
        off = torch.ones(B * T, dtype=torch.bool)
        off[chains] = False
        assert f0.view(B * T, H)[chains].abs().min() > 0 and not f0.view(B * T, H)[off].any()  # zero off the chains
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name])
    assert len(graphs) == 1


def test_flex_block_masks_share_shapes_and_mask_mod():
    """One compiled graph serves every TTT step only if the step's inputs differ in values alone."""
    from eaglenest.draft.ttt import ttt_block_masks

    masks = ttt_block_masks(256, 5, "cpu")
    assert len({m.mask_mod for m in masks}) == 1 and len({m.seq_lengths for m in masks}) == 1
    assert len({tuple(m.kv_indices.shape) for m in masks}) == 1
    dense = [m.to_dense()[0, 0] for m in masks]  # [q blocks, kv blocks]: step j reaches kv block row j
    for j, d in enumerate(dense):
        assert d[:, (j + 1) * 2 :].sum() == 0 and d[:, j * 2 : (j + 1) * 2].sum() > 0
    with pytest.raises(ValueError, match="multiple of 128"):
        ttt_block_masks(100, 3, "cpu")


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gc.get_objects meets a deprecated torch.distributed alias
def test_split_step_grads_leave_nothing_behind():
    """The step aliases and their gradients die with each backward (a hook that held them would keep
    ttt_length copies of the layer's gradient alive per step: the GPU ran out of memory that way)."""
    import gc

    model = make_model().train()
    model.runtime = Runtime(attention="flex", fused_loss=True, split_step_grads=True)
    B, T = 1, 128
    ids, aux = inputs(B=B, T=T)
    rows = torch.arange(1, B * T)
    targets = {"rows": rows, "probs": torch.softmax(torch.randn(len(rows), VD), -1),
               "argmax": model.draft_ids()[torch.randint(0, VD, (len(rows),))], "in_draft": torch.ones(len(rows), dtype=torch.bool)}

    def live_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    counts = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        loss, _ = model(ids, aux, targets, ttt_length=J, chunk=50)
        loss.backward()
        del loss
        counts.append(live_tensors())
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert counts[1] == counts[3], counts


# ----------------------------------------------------------------------------- P-EAGLE (parallel drafting)


def vllm_style_parallel(model, ids, aux, t, k):
    """What vLLM computes when it drafts after target position t with parallel drafting
    (llm_base_proposer.py, set_inputs_first_pass): ONE causal pass over the prefix (token s+1 with the
    target's fused features at s, rope position s, for s = 0..t; the last of them is the bonus token)
    and k-1 slots of the mask token with ``combine_hidden_states(mask_hidden)`` at positions t+1..t+k-1.
    Returns the normed outputs at t..t+k-1 (the k drafted tokens' states) and their greedy target ids."""
    cfg = model.config
    B = ids.shape[0]
    mask_embed = model.embed_weight[cfg.mask_token_id].expand(B, k - 1, H)
    embeds = torch.cat([F.embedding(ids[:, 1 : t + 2], model.embed_weight), mask_embed], dim=1)
    hidden = torch.cat([vllm_combine(model, aux[:, : t + 1]), vllm_combine(model, model.mask_hidden).expand(B, k - 1, H)], dim=1)
    cos, sin = model.rotary_emb(hidden, torch.arange(t + k)[None])
    causal = torch.ones(t + k, t + k, dtype=torch.bool).tril()
    out, _ = model.midlayer(embeds, hidden, cos, sin, [], causal)
    normed = rms_norm(out[:, t:], model.norm.weight, cfg.rms_norm_eps)
    return normed, model.draft_ids()[(normed @ model.lm_head.weight.T).argmax(-1)]


def test_peagle_has_vllms_mask_hidden_and_its_mask_token():
    model = make_model(**PEAGLE)
    assert model.config.kind == "peagle" and model.config.mask_token_id == 7
    shapes = tensor_shapes(model.config)
    assert shapes["mask_hidden"] == (1, 3 * H)  # vLLM's buffer: [1, n_aux·Ht]
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes  # mask_embed is not saved
    torch.testing.assert_close(model.mask_embed[0], model.embed_weight[7])  # the target's row, frozen
    assert "mask_hidden" not in tensor_shapes(make_model().config)
    with pytest.raises(ValueError, match="mask token id"):
        make_model(**KINDS["peagle"])  # no mask token
    with pytest.raises(ValueError, match="mask token id"):
        make_model(**{**PEAGLE, "mask_token_id": V})  # outside the target's vocabulary


def test_peagle_mask_token_defaults_to_the_targets_last_id():
    from transformers import LlamaConfig

    from eaglenest.states.target import TargetFacts

    info = TargetFacts.of(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2), [1, 2, 3], "t")
    assert DraftConfig.from_target(info, VD, "peagle").mask_token_id == V - 1
    assert DraftConfig.from_target(info, VD, "peagle", mask_token_id=3).mask_token_id == 3
    assert DraftConfig.from_target(info, VD, "eagle3", mask_token_id=3).mask_token_id is None  # sequential: none


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_peagle_one_forward_equals_vllms_parallel_drafting(attention):
    """Every position j of the training forward at base t is what vLLM's one parallel-drafting pass
    computes for its j-th drafted token after target position t: on the flex path one layer call over
    all positions (a dense mask on CPU), on the sdpa path the TTT's steps fed the mask's inputs."""
    model = make_model(**PEAGLE)
    model.runtime = Runtime(attention=attention)
    ids, aux = inputs(T=16)
    with torch.no_grad():
        outs = model(ids, aux, ttt_length=J)
        for t in (0, 5, 11):
            ref, _ = vllm_style_parallel(model, ids, aux, t, J)
            for j in range(J):
                torch.testing.assert_close(outs[j][:, t], ref[:, j], rtol=1e-5, atol=1e-5)


def test_peagle_positions_read_the_mask_not_the_chain():
    """Position j at base t sees the target's states up to t and the token at t+1 only: the tokens
    EAGLE-3's step j would read (t+2..t+1+j) change nothing, the mask token and mask_hidden do."""
    model = make_model(**PEAGLE)
    ids, aux = inputs(T=14)
    with torch.no_grad():
        ref = model(ids, aux, ttt_length=J)
        cut = 6
        ids2, aux2 = ids.clone(), aux.clone()
        ids2[:, cut + 2 :] = (ids2[:, cut + 2 :] + 7) % V
        aux2[:, cut + 1 :] += torch.randn_like(aux2[:, cut + 1 :])
        for j, out in enumerate(model(ids2, aux2, ttt_length=J)):
            torch.testing.assert_close(out[:, : cut + 1], ref[j][:, : cut + 1], rtol=0, atol=1e-5)
        ids3 = ids.clone()
        ids3[:, cut + 1] = (ids3[:, cut + 1] + 7) % V  # the token at t+1: every position of base t reads it
        assert all(not torch.allclose(out[:, cut], ref[j][:, cut]) for j, out in enumerate(model(ids3, aux, ttt_length=J)))
        model.mask_hidden.add_(1.0)
        moved = model(ids, aux, ttt_length=J)
        torch.testing.assert_close(moved[0], ref[0])  # position 0 is EAGLE-3's step 0
        assert all(not torch.allclose(moved[j], ref[j]) for j in range(1, J))


def test_peagle_propose_drafts_what_vllm_would():
    model = make_model(**PEAGLE)
    ids, aux = inputs(B=1, T=16)
    proposals = model.propose(ids[0], aux[0], J)
    with torch.no_grad():
        for t in (0, 5, 14):
            _, tokens = vllm_style_parallel(model, ids, aux, t, J)
            assert proposals[t].tolist() == tokens[0].tolist(), t
    assert proposals[15].tolist() == [-1] * J


def test_peagle_loss_weighs_positions_as_its_recipe():
    """A P-EAGLE draft's positions weigh max(0.7**j, 0.2) (speculators' COD shares), whatever decay is
    given; the one-call flex layout with the fused loss and recomputation gives the reference (the
    TTT's steps fed the mask's inputs) loss and gradients."""
    from eaglenest.draft.losses import COD_FLOOR, COD_RATIO

    model = make_model(**PEAGLE).train()
    B, T, Jn = 2, 20, 6  # deep enough for the floor to act
    ids, aux = inputs(B=B, T=T)
    rows = torch.arange(1, B * T)
    rows = rows[rows % T > 0]
    targets = {"rows": rows, "probs": torch.softmax(torch.randn(len(rows), VD), -1),
               "argmax": model.draft_ids()[torch.randint(0, VD, (len(rows),))], "in_draft": torch.rand(len(rows)) > 0.2}
    with torch.no_grad():
        outs = model(ids, aux, ttt_length=Jn)
        loss, _ = model(ids, aux, targets, ttt_length=Jn, decay=0.3)
    want = ttt_loss(outs, model.lm_head.weight, model.draft_ids(), targets, COD_RATIO, floor=COD_FLOOR)[0]
    torch.testing.assert_close(loss, want)
    assert not torch.allclose(loss, ttt_loss(outs, model.lm_head.weight, model.draft_ids(), targets, COD_RATIO)[0])
    results = []
    for runtime in (Runtime(), Runtime(attention="flex", fused_loss=True, recompute=True)):
        model.runtime = runtime
        model.zero_grad(set_to_none=True)
        loss, stats = model(ids, aux, targets, ttt_length=Jn, chunk=16)
        loss.backward()
        results.append((loss.detach(), stats, [p.grad.clone() for p in model.parameters()]))
    (l0, s0, g0), (l1, s1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s1, s0, rtol=1e-5, atol=1e-3)
    assert model.mask_hidden.grad.abs().sum() > 0  # the mask state learns
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the reference path, on purpose
def test_peagle_block_mask_is_the_dense_mask():
    """The flex BlockMask the GPU path uses admits exactly the dense mask's pairs, and flex attention
    under it gives SDPA's output (forward, on CPU; the kernel runs on the GPU in benchmarks/gpu_check.py)."""
    from torch.nn.attention.flex_attention import flex_attention

    from eaglenest.draft.ttt import parallel_block_mask, parallel_mask, ttt_mask

    T, Jn = 12, 3
    dense = parallel_mask(T, Jn)
    for j in range(Jn):  # step j's rows: ttt_mask(T, j) over the keys of steps <= j, nothing later
        assert torch.equal(dense[j * T : (j + 1) * T, : (j + 1) * T], ttt_mask(T, j))
        assert not dense[j * T : (j + 1) * T, (j + 1) * T :].any()
    block = parallel_block_mask(T, Jn, "cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, Jn * T, 8, generator=g) for _ in range(3))
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=dense), rtol=1e-5, atol=1e-5)
