"""A tiny EAGLE-3 draft with random weights (``make_model``) and inputs for it (``inputs``): the model tests'
and the export tests' draft, no target needed."""
import torch

from eaglenest.draft.config import DraftConfig
from eaglenest.draft.model import Eagle3Draft
from eaglenest.draft.vocab import maps_from_ids

V, VD, H = 50, 20, 32  # target vocabulary, draft vocabulary, hidden size


def make_model(seed=0, **overrides):
    """A draft of the sizes above (``overrides``: DraftConfig fields), its weights random and away from a norm's 1."""
    torch.manual_seed(seed)
    cfg = DraftConfig(
        hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        target_vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        **overrides,
    )
    model = Eagle3Draft(cfg)
    for p in model.parameters():  # norms away from 1 so that every weight matters
        torch.nn.init.normal_(p, std=0.3 if p.dim() == 1 else 0.2)
    d2t, t2d = maps_from_ids(torch.arange(0, 2 * VD, 2), V)
    model.set_target(torch.randn(V, H), d2t, t2d)
    return model.eval()


def inputs(B=2, T=12, seed=1):
    """``(input_ids [B, T], aux hidden states [B, T, 3H])`` for ``make_model``'s draft."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randn(B, T, 3 * H, generator=g)
