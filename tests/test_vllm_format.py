"""vllm_format: the facts about vLLM's formats and interfaces, each checked against what vLLM itself
parses or does (its /metrics text, its SpeculativeConfig, its config defaults). Fast: no server."""

import re

import pytest

from eaglenest.draft.config import DraftConfig
from eaglenest.draft.vllm_format import CONFIG_DEFAULTS, draft_config_from_json, draft_config_json, served_aux_layers
from eaglenest.vllm_facts import (check_aux_layers, default_aux_layers, reasoning_of, served_dtype, spec_counters,
                                 speculative_config)

# What vLLM 0.32's /metrics serves with a speculative config (prometheus_client text format), two engines.
METRICS_BEFORE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="toy"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="toy"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="toy"} 5.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="toy"} 1.7629e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="toy"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="toy"} 15.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="toy"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="toy"} 3.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="toy",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="toy",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="toy",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="toy",position="0"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="toy",position="1"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="toy",position="2"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="toy",position="0"} 1.7629e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="toy"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="toy"} 2.0
python_info{implementation="CPython",major="3",minor="11",patchlevel="9",version="3.11.9"} 1.0
weird_metric{path="a \\"quoted\\", {braced} value\\\\",other="x"} NaN 1700000000000
"""


def _after(before: str, scale: dict) -> str:
    """The same exposition with each spec counter's value raised: value + scale[name] * (1 + position)."""
    out = []
    for line in before.splitlines():
        m = re.match(r"^(vllm:spec_decode_\w+_total)(\{.*\}) (\S+)$", line)
        if m and m.group(1) in scale:
            pos = re.search(r'position="(\d)"', line)
            add = scale[m.group(1)] * (1 if pos is None else 3 - int(pos.group(1)))
            line = f"{m.group(1)}{m.group(2)} {float(m.group(3)) + add}"
        out.append(line)
    return "\n".join(out) + "\n"


def test_spec_counters_refuse_text_that_is_not_prometheus():
    with pytest.raises(ValueError):
        spec_counters("not a metric line at all {\n")


def test_spec_counters_sum_engines_and_keep_positions():
    c = spec_counters(METRICS_BEFORE)
    assert c == {"drafts": 15.0, "draft_tokens": 45.0, "accepted": 15.0, "accepted_per_pos": {0: 9.0, 1: 5.0, 2: 1.0}}
    assert spec_counters("# no speculation here\nvllm:num_requests_running 0\n")["drafts"] == 0.0


def test_speculative_configs_are_what_vllm_parses(tmp_path):
    from vllm.config.speculative import SpeculativeConfig

    assert speculative_config("baseline", 3) is None
    e = speculative_config("eagle3", 3, tmp_path / "d")
    assert e == {"method": "eagle3", "model": str((tmp_path / "d").resolve()), "num_speculative_tokens": 3}
    n = speculative_config("ngram", 3, ngram={"prompt_lookup_max": 4, "prompt_lookup_min": 2})
    fields = SpeculativeConfig.__dataclass_fields__ if hasattr(SpeculativeConfig, "__dataclass_fields__") else SpeculativeConfig.model_fields
    assert set(n) <= set(fields) and set(e) <= set(fields)


def test_default_aux_layers():
    assert default_aux_layers(32) == (2, 16, 29)  # vLLM's (2, N//2, N-3)
    assert default_aux_layers(61) == (2, 30, 58)
    assert default_aux_layers(4) == (1, 2, 3)  # vLLM's would be (2, 2, 1): collides
    assert check_aux_layers([3, 0, 2], 4) == (0, 2, 3)
    with pytest.raises(ValueError, match="out of range"):
        check_aux_layers([1, 2, 4], 4)  # id N is post-norm in transformers: refused
    with pytest.raises(ValueError, match="distinct"):
        check_aux_layers([1, 1, 2], 4)
    # an exported config.json's ids win (sorted and distinct, as vLLM takes them); absent: the default
    assert served_aux_layers({"eagle_aux_hidden_state_layer_ids": [9, 1, 5]}, 32) == [1, 5, 9]
    assert served_aux_layers({}, 32) == [2, 16, 29]


DRAFT = DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    target_vocab_size=100, draft_vocab_size=40, target_hidden_size=64, max_position_embeddings=256,
                    norm_before_residual=True, rope_parameters={"rope_type": "default", "rope_theta": 5e5})


def test_config_json_reads_back_as_written():
    """Export writes config.json and validation reads it back through the same module: nothing is lost."""
    config = draft_config_json(DRAFT, [1, 2, 3], "bfloat16")
    assert draft_config_from_json(config) == DRAFT
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["norm_before_residual"] is True


def test_absent_keys_read_as_vllm_defaults_them():
    """Keys vLLM's loader defaults when absent are read with vLLM's values, not ours."""
    from transformers import LlamaConfig

    config = draft_config_json(DRAFT, [1, 2, 3])
    for key in ("norm_before_residual", "max_position_embeddings", "rope_parameters", "rope_theta"):
        config.pop(key)
    read = draft_config_from_json(config)
    assert read.norm_before_residual is False  # llama_eagle3.py: getattr(config, "norm_before_residual", False)
    llama = LlamaConfig()  # what transformers gives vLLM for the other absent keys
    assert read.max_position_embeddings == llama.max_position_embeddings == CONFIG_DEFAULTS["max_position_embeddings"]
    assert read.rope_parameters["rope_theta"] == llama.rope_parameters["rope_theta"] == CONFIG_DEFAULTS["rope_theta"]


def test_reasoning_field_under_either_name():
    assert reasoning_of({"reasoning": "a", "reasoning_content": "b"}) == "a"
    assert reasoning_of({"reasoning_content": "b"}) == "b"
    assert reasoning_of({"reasoning": None, "content": "c"}) is None


def test_served_dtype_is_read_from_the_last_start(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("=== start 1\nInitializing engine (v0.32) with config: model='m', dtype=torch.float32, seed=0\n"
                   "=== start 2\nInitializing engine (v0.32) with config: model='m', dtype=torch.bfloat16, seed=0\n")
    assert served_dtype(log) == "bfloat16"
    assert served_dtype(tmp_path / "absent.log") is None
