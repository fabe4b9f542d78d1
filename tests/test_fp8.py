import copy

import pytest
import torch

from eaglenest.draft import fp8
from eaglenest.draft.config import DraftConfig
from eaglenest.draft.device import resolve_runtime
from eaglenest.draft.model import Eagle3Draft
from eaglenest.draft.vocab import maps_from_ids
from tests.support.training import train_settings

V, VD, H = 64, 32, 32
HOPPER, AMPERE = (9, 0), (8, 0)


def test_fp8_is_auto_by_default_and_auto_takes_it_only_on_gpus_with_fp8():
    assert train_settings().fp8 == "auto"
    assert fp8.resolve_fp8("auto", "cpu") is False
    assert resolve_runtime(train_settings(), "cuda", capability=HOPPER).fp8 is True
    assert resolve_runtime(train_settings(), "cpu").fp8 is False
    assert fp8.resolve_fp8("auto", "cuda:0", capability=AMPERE) is False
    assert fp8.resolve_fp8("auto", "cuda:0", capability=(8, 9)) is True
    assert fp8.resolve_fp8("auto", "cuda", capability=HOPPER) is True
    assert fp8.resolve_fp8(False, "cuda", capability=HOPPER) is False
    assert fp8.resolve_fp8(True, "cuda", capability=HOPPER) is True


@pytest.mark.parametrize("device, capability, message", [
    ("cpu", None, "train.fp8: true needs a CUDA GPU of capability 8.9"),
    ("cuda:0", AMPERE, r"train.fp8: true needs a CUDA GPU .* here cuda:0, capability 8.0"),
])
def test_fp8_true_where_it_cannot_run_says_what_to_do(device, capability, message):
    with pytest.raises(ValueError, match=message):
        fp8.resolve_fp8(True, device, capability=capability)
    with pytest.raises(ValueError, match="train.fp8 must be auto, true or false"):
        fp8.resolve_fp8("yes", device, capability=capability)


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("rows", [(3, 7), (32,)])  # 21 rows: padded to 32 for the weight gradient's product
def test_float8_linears_match_bf16_products_and_their_gradients(rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*rows, 64, generator=g, requires_grad=True)
    ws = [(torch.randn(n, 64, generator=g) * 0.1).requires_grad_() for n in (32, 48)]
    got = fp8.float8_linears(x, *ws)
    want = [torch.nn.functional.linear(x, w) for w in ws]
    assert [o.shape for o in got] == [o.shape for o in want]
    assert all(0 < rel(a, b) < 0.08 for a, b in zip(got, want))  # e4m3 keeps ~2 significant digits
    loss = lambda outs: outs[0].square().sum() + outs[1].sum()  # noqa: E731
    grads = torch.autograd.grad(loss(got), [x, *ws], retain_graph=True)
    ref = torch.autograd.grad(loss(want), [x, *ws], retain_graph=True)
    assert all(0 < rel(a, b) < 0.1 for a, b in zip(grads, ref)), [rel(a, b) for a, b in zip(grads, ref)]
    # an output left out of the loss gives its weight no gradient and the input none from it
    gx, gw0, gw1 = torch.autograd.grad(got[1].sum(), [x, *ws], allow_unused=True)
    assert gw0 is None and rel(gx, torch.autograd.grad(want[1].sum(), x)[0]) < 0.1


def make_model(intermediate_size):
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=H, intermediate_size=intermediate_size, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, target_vocab_size=V, draft_vocab_size=VD, target_hidden_size=H,
                      rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    model = Eagle3Draft(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3 if p.dim() == 1 else 0.2)
    d2t, t2d = maps_from_ids(torch.arange(0, 2 * VD, 2), V)
    model.set_target(torch.randn(V, H), d2t, t2d)
    return model


def test_fp8_switches_the_large_products_only_and_keeps_the_checkpoint():
    model = make_model(intermediate_size=40)  # the MLP's 40 is no multiple of 16: it stays bf16
    ref = copy.deepcopy(model)
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    switched = fp8.use_fp8(model)
    assert switched == ["fc", "midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj", "midlayer.self_attn.v_proj",
                        "midlayer.self_attn.o_proj"]
    assert not any(getattr(m, "fp8", False) for m in (model.midlayer.mlp.up_proj, model.lm_head))
    # the same parameter objects (the optimizer's), and state_dict() as before: keys, shapes, dtypes, values
    assert all(p is params[n] for n, p in model.named_parameters()) and list(params) == [n for n, _ in model.named_parameters()]
    after = model.state_dict()
    assert list(after) == list(state)
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in state.items())
    # and the products now run in e4m3 (torch._scaled_mm runs on CPU too): close to the bf16 model, not equal
    g = torch.Generator().manual_seed(1)
    ids, aux = torch.randint(0, V, (2, 16), generator=g), torch.randn(2, 16, 3 * H, generator=g)
    got, want = model(ids, aux, ttt_length=3), ref(ids, aux, ttt_length=3)
    rels = [rel(a, b) for a, b in zip(got, want)]
    assert all(0 < r < 0.15 for r in rels), rels
    sum(o.square().sum() for o in got).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for n, p in model.named_parameters() if n != "lm_head.weight")


def test_fp8_on_the_split_step_path_casts_each_weight_once_a_step_and_learns_like_bf16(monkeypatch):
    """The GPU's default path (flex layout, per-step weight aliases, diagonal split, unscored positions
    skipped; dense masks on CPU): the layer's FP8 weights are cast once per forward (``weight_casts``),
    not again in any TTT step or in backward, and loss and gradients stay close to bf16's."""
    from eaglenest.draft.runtime import Runtime

    torch.manual_seed(0)
    model = make_model(intermediate_size=48)
    model.runtime = Runtime(attention="flex", fused_loss=True, split_step_grads=True, diag_split=True, skip_unscored=True)
    ref = copy.deepcopy(model)
    fp8.use_fp8(model)
    B, T = 2, 128
    g = torch.Generator().manual_seed(2)
    ids, aux = torch.randint(0, V, (B, T), generator=g), torch.randn(B, T, 3 * H, generator=g)
    rows = torch.nonzero((torch.rand(B, T, generator=g) > 0.3).flatten()).squeeze(1)
    targets = {"rows": rows, "probs": torch.softmax(torch.randn(len(rows), VD, generator=g), -1),
               "argmax": model.draft_ids()[torch.randint(0, VD, (len(rows),), generator=g)],
               "in_draft": torch.ones(len(rows), dtype=torch.bool)}
    layer_weights = {p.data_ptr() for n, p in model.named_parameters() if n.startswith("midlayer.") and p.dim() == 2}
    cast_weights = []
    real_cast = fp8._cast
    monkeypatch.setattr(fp8, "_cast", lambda t, dtype: cast_weights.append(t.data_ptr() in layer_weights) or real_cast(t, dtype))
    loss, _ = model(ids, aux, targets, ttt_length=3, chunk=50)
    loss.backward()
    assert sum(cast_weights) == len(layer_weights)  # q, k, v, o, gate, up, down: once each, for the 3 steps and backward
    want, _ = ref(ids, aux, targets, ttt_length=3, chunk=50)
    want.backward()
    assert 0 < rel(loss, want) < 0.05
    got_grads, ref_grads = dict(model.named_parameters()), dict(ref.named_parameters())
    for n, p in ref_grads.items():
        if p.grad is not None:
            assert rel(got_grads[n].grad, p.grad) < 0.2, n


def test_a_frozen_lm_head_is_switched_and_a_trained_one_is_not():
    trained = make_model(intermediate_size=48)
    assert "lm_head" not in fp8.use_fp8(trained) and not getattr(trained.lm_head, "fp8", False)
    frozen = make_model(intermediate_size=48)
    frozen.lm_head.weight.requires_grad_(False)
    assert fp8.use_fp8(frozen)[-1] == "lm_head" and frozen.lm_head.fp8


def fused_loss_case(n=48, h=64, v=96, seed=0):
    """One TTT step's rows (B=1, T=n, J=1) for ttt_loss_fused: bf16 hidden [1, n, h] and a frozen
    bf16 head [v, h], targets with four rows outside the draft vocabulary (weight 0)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, n, h, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.3).bfloat16()
    in_draft = torch.ones(n - 1, dtype=torch.bool)
    in_draft[::12] = False
    targets = {"rows": torch.arange(1, n), "probs": torch.softmax(torch.randn(n - 1, v, generator=g) * 2, -1) * 0.9,
               "argmax": torch.randint(0, v, (n - 1,), generator=g), "in_draft": in_draft}
    return hidden, weight, targets


@pytest.fixture
def eager_loss_kernels(monkeypatch):
    """The compiled fused loss's kernels run eagerly (the same functions; compiling them on this CPU
    costs a minute and the GPU check compiles them on the GPU)."""
    from eaglenest.draft import losses

    monkeypatch.setattr(losses, "_compiled_soft_ce_grad", lambda: losses._soft_ce_grad)
    monkeypatch.setattr(losses, "_compiled_soft_ce_grad_fp8", lambda: losses._soft_ce_grad_fp8)
    return losses


def test_the_fp8_head_gives_the_bf16_loss_and_gradient_within_fp8_precision(eager_loss_kernels):
    hidden, weight, targets = fused_loss_case()
    draft_ids = torch.arange(weight.shape[0])
    runs = {}
    for use in (False, True):
        loss, stats = eager_loss_kernels.ttt_loss_fused([hidden], weight, draft_ids, targets, compiled=True, fp8=use)
        (grad,) = torch.autograd.grad(loss, hidden)
        runs[use] = loss, stats, grad
    (l16, s16, g16), (l8, s8, g8) = runs[False], runs[True]
    assert torch.isfinite(l8) and torch.isfinite(g8).all()
    assert 0 < abs(float((l8 - l16).detach())) / float(l16.detach()) < 0.02
    assert 0 < rel(g8.float(), g16.float()) < 0.15  # e4m3 operands, an e5m2 gradient: ~2 significant digits
    assert torch.equal(s8[:, 1], s16[:, 1]) and torch.equal(s8[:, 3], s16[:, 3])  # the same rows weighed and counted
    # rows outside the draft vocabulary get no gradient, as in bf16
    assert torch.equal(g8[0, :-1][~targets["in_draft"]], torch.zeros_like(g8[0, :-1][~targets["in_draft"]]))


def test_a_trained_head_stays_bf16_in_the_fused_loss(eager_loss_kernels, monkeypatch):
    hidden, weight, targets = fused_loss_case()
    weight.requires_grad_()
    monkeypatch.setattr(eager_loss_kernels, "_fp8_chunks", lambda *a: pytest.fail("a trained head went FP8"))
    loss, _ = eager_loss_kernels.ttt_loss_fused([hidden], weight, torch.arange(weight.shape[0]), targets, compiled=True, fp8=True)
    gh, gw = torch.autograd.grad(loss, [hidden, weight])
    assert torch.isfinite(gw).all() and gw.abs().sum() > 0


def test_the_e5m2_loss_gradient_stays_within_its_scale_and_is_zero_where_nothing_weighs():
    from eaglenest.draft.losses import _soft_ce_grad, _soft_ce_grad_fp8

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(16, 80, generator=g) * 6).bfloat16()
    p = torch.softmax(torch.randn(16, 80, generator=g), -1)
    weight = torch.rand(16, generator=g)
    weight[5] = 0
    top = torch.finfo(fp8.E5M2).max
    scale = top / weight.max()
    ce, arg, g8 = _soft_ce_grad_fp8(logits, p, weight, scale)
    ce16, arg16, g16 = _soft_ce_grad(logits.float(), p, weight)
    assert g8.dtype == fp8.E5M2 and torch.equal(ce, ce16) and torch.equal(arg, arg16)
    back = g8.float() / scale
    assert torch.isfinite(back).all() and back.abs().max() <= weight.max() * (1 + 1e-6) and g8.float().abs().max() <= top
    assert torch.equal(back[5], torch.zeros(80)) and rel(back, g16) < 0.15
    # no row weighed at all (a batch with nothing in the draft vocabulary): zeros, not NaN
    _, _, none = _soft_ce_grad_fp8(logits, p, torch.zeros(16), top / torch.zeros(()).clamp(min=1e-30))
    assert torch.equal(none.float(), torch.zeros(16, 80))
