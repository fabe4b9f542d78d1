import copy

import pytest
import torch

from eaglenest.draft import fp8, train
from eaglenest.draft.checkpoint import resolve_config
from eaglenest.draft.config import DraftConfig
from eaglenest.draft.model import Eagle3Draft
from eaglenest.draft.vocab import maps_from_ids

V, VD, H = 64, 32, 32
HOPPER, AMPERE = (9, 0), (8, 0)


def test_fp8_is_off_by_default_and_auto_takes_it_only_on_gpus_with_fp8_and_torchao():
    assert resolve_config({})["fp8"] is False
    assert fp8.resolve_fp8("auto", "cpu") is False
    assert train.resolve_runtime(resolve_config({}), "cpu")["fp8"] is False
    assert fp8.resolve_fp8("auto", "cuda:0", capability=AMPERE, has_torchao=True) is False
    assert fp8.resolve_fp8("auto", "cuda:0", capability=(8, 9), has_torchao=True) is True
    assert fp8.resolve_fp8("auto", "cuda", capability=HOPPER, has_torchao=True) is True
    assert train.resolve_runtime(resolve_config({}), "cuda", capability=HOPPER)["fp8"] is fp8.torchao_available()
    assert fp8.resolve_fp8(False, "cuda", capability=HOPPER, has_torchao=True) is False
    assert fp8.resolve_fp8(True, "cuda", capability=HOPPER, has_torchao=True) is True


def test_fp8_auto_without_torchao_trains_in_bf16_with_one_line(capsys, monkeypatch):
    monkeypatch.setattr(fp8, "_said_fallback", False)
    assert fp8.resolve_fp8("auto", "cuda", capability=HOPPER, has_torchao=False) is False
    assert fp8.resolve_fp8("auto", "cuda", capability=HOPPER, has_torchao=False) is False
    said = capsys.readouterr().err
    assert said.count("torchao is not installed") == 1 and "training in bf16" in said


@pytest.mark.parametrize("device,capability,has_torchao,message", [
    ("cpu", None, True, "train.fp8: true needs a CUDA GPU of capability 8.9"),
    ("cuda:0", AMPERE, True, r"train.fp8: true needs a CUDA GPU .* here cuda:0, capability 8.0"),
    ("cuda:0", HOPPER, False, r"train.fp8: true needs torchao, which is not installed: `pip install torchao=="),
])
def test_fp8_true_where_it_cannot_run_says_what_to_do(device, capability, has_torchao, message):
    with pytest.raises(ValueError, match=message):
        fp8.resolve_fp8(True, device, capability=capability, has_torchao=has_torchao)
    with pytest.raises(ValueError, match="train.fp8 must be auto, true or false"):
        fp8.resolve_fp8("yes", device, capability=capability)


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


def test_fp8_swaps_the_large_products_only_and_keeps_the_checkpoint():
    pytest.importorskip("torchao.float8")
    model = make_model(intermediate_size=40)  # the MLP's 40 is no multiple of 16: it stays bf16
    ref = copy.deepcopy(model)
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    swapped = fp8.convert_to_fp8(model, emulate=True)  # torchao's FP8 emulation: runs on CPU
    assert swapped == ["fc", "midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj", "midlayer.self_attn.v_proj",
                       "midlayer.self_attn.o_proj"]
    assert [type(getattr(model.midlayer.self_attn, n)).__name__ for n in ("q_proj", "o_proj")] == ["Float8Linear"] * 2
    assert type(model.midlayer.mlp.up_proj) is torch.nn.Linear and type(model.lm_head) is torch.nn.Linear
    # the same parameter objects (the optimizer's), and state_dict() as before: keys, shapes, dtypes, values
    assert all(p is params[n] for n, p in model.named_parameters()) and list(params) == [n for n, _ in model.named_parameters()]
    after = model.state_dict()
    assert list(after) == list(state)
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in state.items())
    # and the products now run in (emulated) e4m3: close to the unconverted model, not equal to it
    g = torch.Generator().manual_seed(1)
    ids, aux = torch.randint(0, V, (2, 16), generator=g), torch.randn(2, 16, 3 * H, generator=g)
    got, want = model(ids, aux, ttt_length=3), ref(ids, aux, ttt_length=3)
    rel = [float((a - b).detach().norm() / b.detach().norm()) for a, b in zip(got, want)]
    assert all(0 < r < 0.15 for r in rel), rel
    sum(o.square().sum() for o in got).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for n, p in model.named_parameters() if n != "lm_head.weight")
