"""export_draft: vLLM's EAGLE-3 config keys and tensors, reloaded identical; the untrained baseline."""

import json

import pytest
import torch

from eaglenest.draft.checkpoint import load_checkpoint
from eaglenest.draft.config import KINDS
from eaglenest.draft.export import export_draft, load_exported, write_draft
from eaglenest.draft.vllm_format import ARCHITECTURE, FORMATS, flat_config, tensor_shapes, vllm_tensors
from tests.support.tiny_draft import inputs, make_model
from tests.support.training_run import run
from tests.support.untrained import export_untrained

REQUIRED_KEYS = {
    "architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size",
    "draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "fc_norm", "norm_output",
    "tie_word_embeddings", "torch_dtype",
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
    assert config["fc_norm"] is True and config["norm_output"] is True  # eagle3.1, the default kind
    assert config["norm_before_fc"] is False  # speculators' switch, written out all the same
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
    export_untrained(data["vocab_path"], data["head_path"], tmp_path / "untrained")
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


@pytest.mark.parametrize("fmt", FORMATS)
def test_eagle31_round_trips_through_either_format(fmt, tmp_path):
    """An EAGLE-3.1 draft exported in either format: config.json says fc_norm and norm_output (read as
    vLLM reads them, in the speculators format by vLLM's own code), the fc_norm tensors are there, and
    the draft validation reads back is the same config, weights and outputs; a config.json whose
    switch differs from training is named by the export check."""
    from transformers import LlamaConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    from eaglenest.draft.checkpoint import save_checkpoint
    from eaglenest.states.target import TargetFacts
    from eaglenest.validation.predict import load_exported_draft
    from eaglenest.validation.report import export_differences

    model = make_model(**KINDS["eagle3.1"])
    cfg = model.config
    info = TargetFacts.of(LlamaConfig(vocab_size=cfg.target_vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=4,
                                      intermediate_size=64, num_attention_heads=4, num_key_value_heads=2), [1, 2, 3], "org/t")
    config = write_draft(tmp_path / "d", cfg, info, model.state_dict(), None, None, "float32", fmt=fmt, verifier="org/t")
    flat = flat_config(config)
    assert flat["fc_norm"] is True and flat["norm_output"] is True
    if fmt == "speculators":
        parsed = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(config)))
        assert parsed["fc_norm"] is True and parsed["norm_output"] is True
    _, tensors = load_exported(tmp_path / "d")
    for i in range(cfg.num_aux_layers):
        torch.testing.assert_close(tensors[f"fc_norm.{i}.weight"], model.fc_norm[i].weight.detach(), rtol=0, atol=0)
    back, _ = load_exported_draft(tmp_path / "d", model.embed_weight)
    assert back.config == cfg and back.config.kind == "eagle3.1"
    ids, aux = inputs()
    with torch.no_grad():
        for a, b in zip(back(ids, aux, ttt_length=3), model(ids, aux, ttt_length=3)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    save_checkpoint(tmp_path / "ckpt.safetensors", model.state_dict(), cfg, info, {})
    assert export_differences(tmp_path / "d", tmp_path / "ckpt.safetensors") == []
    config["norm_output"] = False
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    assert export_differences(tmp_path / "d", tmp_path / "ckpt.safetensors") == ["norm_output: config.json False, trained with True"]
