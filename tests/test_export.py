"""export_draft: vLLM's EAGLE-3 config keys and tensors, reloaded identical; the untrained baseline."""

import pytest
import torch

from eaglenest.draft.checkpoint import load_checkpoint
from eaglenest.draft.export import export_draft, export_untrained, load_exported
from eaglenest.draft.vllm_format import ARCHITECTURE, tensor_shapes, vllm_tensors
from tests.test_model import make_model
from tests.test_train import run

REQUIRED_KEYS = {
    "architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size",
    "draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "tie_word_embeddings", "torch_dtype",
}


@pytest.fixture(scope="module")
def checkpoint(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    run(data, out)
    return out / "checkpoint.safetensors"


def test_export_then_reload_is_identical(checkpoint, tmp_path):
    from transformers import AutoConfig

    export_draft(checkpoint, tmp_path / "draft", card={"target": "tiny", "traces": 24})
    config, tensors = load_exported(tmp_path / "draft")
    assert REQUIRED_KEYS <= set(config)
    assert config["architectures"] == [ARCHITECTURE] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == 100 and config["draft_vocab_size"] == 40
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["norm_before_residual"] is False
    assert config["tie_word_embeddings"] is False and "target_hidden_size" not in config  # same width as the target
    saved, cfg, _, _ = load_checkpoint(checkpoint)
    assert set(tensors) == set(tensor_shapes(cfg)) and "embed_tokens.weight" not in tensors
    for name, t in tensors.items():
        expected = saved[name].to(torch.bfloat16) if saved[name].is_floating_point() else saved[name]
        assert t.dtype == expected.dtype and torch.equal(t, expected), name
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    hf = AutoConfig.from_pretrained(tmp_path / "draft")  # what vLLM parses it with
    assert hf.draft_vocab_size == 40 and hf.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    assert hf.rope_parameters == config["rope_parameters"] and hf.norm_before_residual is False
    readme = (tmp_path / "draft" / "README.md").read_text()
    assert "tiny" in readme and "6 steps" in readme and "eagle3" in readme


def test_untrained_export_has_the_same_shape(checkpoint, data, tmp_path):
    export_draft(checkpoint, tmp_path / "trained")
    export_untrained(data["vocab_path"], data["head_path"], tmp_path / "untrained", config={"ttt_length": 3})
    c1, t1 = load_exported(tmp_path / "trained")
    c2, t2 = load_exported(tmp_path / "untrained")
    assert c1 == c2
    assert {k: v.shape for k, v in t1.items()} == {k: v.shape for k, v in t2.items()}
    assert torch.equal(t1["d2t"], t2["d2t"]) and not torch.equal(t1["fc.weight"], t2["fc.weight"])
    assert "randomly initialised" in (tmp_path / "untrained" / "README.md").read_text()


def test_a_checkpoint_stores_the_target_vocabulary_under_vllms_key():
    cfg = make_model().config
    stored = cfg.to_dict()
    assert stored["vocab_size"] == cfg.target_vocab_size and "target_vocab_size" not in stored
    assert type(cfg).from_dict(stored) == cfg


def test_full_size_draft_vocab_leaves_d2t_out():
    model = make_model()
    cfg = model.config
    cfg.draft_vocab_size = cfg.target_vocab_size  # a toy vocabulary: the draft keeps all of it
    full = type(model)(cfg).state_dict()
    tensors = vllm_tensors(full, cfg)
    assert "d2t" not in tensors and tensors["t2d"].all()  # vLLM builds no draft_id_to_target_id then
    with pytest.raises(ValueError, match="do not match"):
        vllm_tensors({**full, "embed_tokens.weight": torch.zeros(1)}, cfg)
