"""The two export formats (vLLM's EAGLE-3 format and the speculators format) from the same weights.

Fast tests check what export writes against vLLM's own speculators config code (no server). The
tests marked ``vllm`` take the embedded default's run (shared with tests/test_default_workflow.py),
whose draft vocabulary is smaller than the target's (48 of 105 tokens, so vLLM maps draft ids
through ``d2t``) and whose validation report serves both formats in real vLLM (the speculators one as its users start it: its directory as
``--model``), and then serve a copy with a deliberately wrong ``d2t``: the check that vLLM's
acceptance stays within 10% of the offline prediction must fail for it, which proves vLLM reads the
mapping. One vLLM start beyond the shared run.
"""
import json
import shutil

import pytest
import torch
import yaml

from eaglenest.draft.export import export_draft, load_exported
from eaglenest.draft.vllm_format import (SPECULATORS_DEFAULTS, draft_config_from_json, draft_to_target_ids,
                                         flat_config, how_to_serve, speculators_config_json)
from eaglenest.settings import ExportSettings
from eaglenest.util import save_safetensors
from eaglenest.validation.card import VALIDATION_MARK, write_validation
from eaglenest.validation.predict import load_exported_draft
from tests.support.config import TOY_TARGET, eager, write_config
from tests.support.measure import K, measure_draft
from tests.support.workflow import run_snakemake
from tests.support.training_run import CONFIG, run

DRAFT_VOCAB = 48  # of the toy's 105 tokens
WITHIN = 0.10  # vLLM's acceptance length against the offline prediction


def within_prediction(vllm_al: float, offline_al: float) -> bool:
    return abs(vllm_al / offline_al - 1) <= WITHIN


# ----------------------------------------------------------------------------- no server


@pytest.fixture(scope="module")
def both(data, tmp_path_factory):
    """One small trained checkpoint exported in both formats."""
    out = tmp_path_factory.mktemp("formats")
    run(data, out)
    settings = ExportSettings.defaults().replace(verifier="org/tiny-target", k=4)
    export_draft(out / "checkpoint.safetensors", out / "vllm", settings, speculators_dir=out / "speculators",
                 card={"target": "org/tiny-target", "dataset": "org/prompts", "license": "apache-2.0"})
    return out


def test_vllm_parses_the_speculators_config(both):
    """vLLM's own speculators code reads what export wrote: the speculative config `vllm serve DIR`
    builds, and the draft config, equal to the one vLLM builds from the other format."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    spec_config, _ = load_exported(both / "speculators")
    vllm_config, _ = load_exported(both / "vllm")
    assert "model_type" not in spec_config  # vLLM takes a config without it as a speculators config
    assert SpeculatorsConfig.extract_vllm_speculative_config(spec_config) == {"method": "eagle3", "num_speculative_tokens": 4}
    assert spec_config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    for key in SPECULATORS_DEFAULTS:  # every key whose default differs between the formats is written out
        assert key in spec_config, key
    parsed = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(spec_config)))
    assert parsed["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert parsed["norm_before_residual"] is False and parsed["draft_vocab_size"] == 40
    assert parsed["eagle_aux_hidden_state_layer_ids"] == vllm_config["eagle_aux_hidden_state_layer_ids"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "num_hidden_layers"):
        assert parsed[key] == vllm_config[key], key
    assert draft_config_from_json(spec_config) == draft_config_from_json(vllm_config)


def test_norm_before_residual_defaults_differ_between_formats(both):
    """Why the key is always written: absent, the two formats read it differently."""
    spec_config, _ = load_exported(both / "speculators")
    vllm_config, _ = load_exported(both / "vllm")
    spec_config.pop("norm_before_residual")
    vllm_config.pop("norm_before_residual")
    assert draft_config_from_json(spec_config).norm_before_residual is True
    assert draft_config_from_json(vllm_config).norm_before_residual is False


def test_export_check_reads_the_speculators_format_as_vllm_does(both, tmp_path):
    """The report's export-against-training check reads a speculators draft with that format's
    defaults: without norm_before_residual, vLLM would run it with true, not as trained."""
    from eaglenest.validation.report import export_differences

    ckpt = both / "checkpoint.safetensors"
    assert export_differences(both / "speculators", ckpt) == [] == export_differences(both / "vllm", ckpt)
    shutil.copytree(both / "speculators", tmp_path / "s")
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    del config["norm_before_residual"]
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    assert export_differences(tmp_path / "s", ckpt) == ["norm_before_residual: config.json (absent: True), trained with False"]


def test_same_weights_in_both_formats(both):
    _, spec_tensors = load_exported(both / "speculators")
    _, vllm_tensors = load_exported(both / "vllm")
    assert any(n.startswith("layers.0.") for n in spec_tensors) and not any(n.startswith("midlayer.") for n in spec_tensors)
    renamed = {n.replace("layers.0.", "midlayer.", 1): t for n, t in spec_tensors.items()}
    assert renamed.keys() == vllm_tensors.keys()
    assert all(torch.equal(renamed[n], vllm_tensors[n]) for n in renamed)
    embed = torch.zeros(100, 32)
    a, _ = load_exported_draft(both / "speculators", embed)
    b, _ = load_exported_draft(both / "vllm", embed)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


def test_model_cards_have_hub_front_matter_and_take_the_validation_figures(both):
    for fmt, serve in (("vllm", "--speculative-config"), ("speculators", "vllm serve THIS_DIR")):
        text = (both / fmt / "README.md").read_text()
        meta = yaml.safe_load(text.split("---")[1])
        assert meta["base_model"] == "org/tiny-target" and meta["library_name"] == "vllm"
        assert meta["license"] == "apache-2.0" and meta["datasets"] == ["org/prompts"] and "eagle3" in meta["tags"]
        assert serve in text
        report = {"prompts": 8, "num_speculative_tokens": 3, "max_tokens": 64, "baseline": {"output_tokens_per_s": 100.0},
                  "formats": {fmt: {"tokens_per_step": 2.3, "acceptance_length": 2.345, "per_position": [0.8, 0.5, 0.2],
                                    "output_tokens_per_s": 150.0}},
                  "offline": {"tokens_per_step": 2.4, "acceptance_length": 2.45},
                  "ngram": {"tokens_per_step": 1.25, "acceptance_length": 2.25, "drafted_share": 0.2}}
        write_validation(both / fmt, report, fmt)
        second = {fmt: {"tokens_per_step": 2.5, "acceptance_length": 2.6}}
        write_validation(both / fmt, {**report, "formats": second}, fmt)  # replaces, not appends
        text = (both / fmt / "README.md").read_text()
        assert text.count(VALIDATION_MARK) == 1 and "2.345" not in text and "2.300" not in text
        assert "| tokens per target step in vLLM (the target alone: 1) | 2.500 |" in text
        assert "| offline prediction, tokens per target step | 2.400 |" in text
        assert "| n-gram speculation in vLLM, tokens per target step | 1.250 |" in text
        assert ("| acceptance length per drafted step (vLLM's figure): this draft, n-gram | 2.600, 2.250 "
                "(n-gram drafted on 20% of steps) |") in text
        assert yaml.safe_load(text.split("---")[1]) == meta


def test_a_speculators_draft_is_served_as_the_model_where_its_verifier_resolves(both, tmp_path):
    model, spec, how = how_to_serve("speculators", both / "speculators", 4, "org/tiny-target")  # k as in the file
    assert spec is not None and spec["model"] == str((both / "speculators").resolve())  # a hub name, no hub here
    assert model == "org/tiny-target" and "does not resolve" in how
    local = tmp_path / "local"
    shutil.copytree(both / "speculators", local)
    config = json.loads((local / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = str(TOY_TARGET)
    (local / "config.json").write_text(json.dumps(config))
    # a local verifier: served as the model where vLLM takes one (0.32), else through the target
    assert how_to_serve("speculators", local, 4, "x", "0.32.0") == (str(local.resolve()), None,
                                                             f"vllm serve <draft dir> (verifier {TOY_TARGET})")
    assert how_to_serve("speculators", local, 3, "x", "0.32.0")[1] == {"num_speculative_tokens": 3}  # k differs from the file's
    for version in ("0.33.0", "0.34.0", None):
        model, spec, how = how_to_serve("speculators", local, 4, "x", version)
        assert model == "x" and spec["model"] == str(local.resolve()) and "export.verifier" in how, version


def test_speculators_config_names_the_verifier_as_given():
    from eaglenest.draft.config import DraftConfig

    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      target_vocab_size=100, draft_vocab_size=40, target_hidden_size=32, norm_before_residual=True)
    config = speculators_config_json(cfg, [1, 2, 3], verifier="toy/target", k=3)
    assert config["speculators_config"]["verifier"]["name_or_path"] == "toy/target"  # as the config gives it
    assert config["norm_before_residual"] is True and config["target_hidden_size"] == 32
    assert draft_config_from_json(config) == cfg


@pytest.fixture(scope="module")
def peagle_both(data, tmp_path_factory):
    """A small trained P-EAGLE checkpoint (draft.kind peagle) exported in both formats."""
    out = tmp_path_factory.mktemp("peagle_formats")
    run(data, out, {**CONFIG, "kind": "peagle", "max_steps": 2})
    settings = ExportSettings.defaults().replace(verifier="org/tiny-target", k=4)
    export_draft(out / "checkpoint.safetensors", out / "vllm", settings, speculators_dir=out / "speculators",
                 card={"target": "org/tiny-target"})
    return out


def test_a_peagle_draft_is_served_with_parallel_drafting_from_either_format(peagle_both):
    """vLLM's own speculators code reads the P-EAGLE speculators config as eagle3 with parallel drafting
    and the mask token as pard_token; both formats read back as the same parallel draft; vLLM's format is
    served with parallel_drafting in the speculative config; the cards say what the draft is."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    spec_config, spec_tensors = load_exported(peagle_both / "speculators")
    vllm_config, vllm_tensors = load_exported(peagle_both / "vllm")
    assert spec_config["speculators_model_type"] == "peagle" and spec_config["mask_token_id"] == 99
    assert SpeculatorsConfig.extract_vllm_speculative_config(spec_config) == {
        "method": "eagle3", "num_speculative_tokens": 4, "parallel_drafting": True}
    parsed = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(spec_config)))
    assert parsed["architectures"] == ["PeagleLlamaForCausalLM"] and parsed["pard_token"] == 99
    assert "mask_token_id" not in spec_config["transformer_layer_config"]  # one place: the top level
    assert vllm_config["mask_token_id"] == 99 and vllm_config["parallel_drafting"] is True
    read = draft_config_from_json(spec_config)
    assert read == draft_config_from_json(vllm_config) and (read.kind, read.mask_token_id) == ("peagle", 99)
    assert vllm_tensors["mask_hidden"].shape == spec_tensors["mask_hidden"].shape == (1, 3 * 64)
    from eaglenest.validation.report import export_differences

    ckpt = peagle_both / "checkpoint.safetensors"
    assert export_differences(peagle_both / "vllm", ckpt) == [] == export_differences(peagle_both / "speculators", ckpt)
    _, spec, _ = how_to_serve("vllm", peagle_both / "vllm", 3, "org/tiny-target")
    assert spec == {"method": "eagle3", "model": str((peagle_both / "vllm").resolve()), "num_speculative_tokens": 3,
                    "parallel_drafting": True}
    card = (peagle_both / "vllm" / "README.md").read_text()
    assert "# P-EAGLE draft for org/tiny-target" in card and '"parallel_drafting":true' in card
    assert "p-eagle" in yaml.safe_load(card.split("---")[1])["tags"]


@pytest.mark.parametrize("fmt, dirs", [("both", ["draft/checkpoint", "draft/speculators"]),
                                       ("speculators", ["draft/speculators"]), ("vllm", ["draft/checkpoint"])])
def test_export_format_picks_the_draft_dirs(tmp_path, fmt, dirs):
    """export.format decides which directories export_draft writes and validate_draft measures."""
    import re

    write_config(tmp_path, export={"format": fmt})
    out = run_snakemake(tmp_path, "-n", "--printshellcmds").stdout
    blocks = {m.group(1): m.group(2) for m in re.finditer(r"rule (export_draft|validate_draft):\n(.*?)\n\n", out, re.S)}
    outputs = re.search(r"output: (.*)", blocks["export_draft"]).group(1).split(", ")
    assert outputs == dirs, blocks["export_draft"]
    inputs = re.search(r"input: (.*)", blocks["validate_draft"]).group(1).split(", ")
    assert [i for i in inputs if i in ("draft/checkpoint", "draft/speculators")] == dirs


def test_export_format_defaults_to_both():
    from eaglenest.config import defaults

    assert defaults("export") == {"format": "both", "verifier": None, "license": None}


# ----------------------------------------------------------------------------- real vLLM


@pytest.fixture(scope="module")
def validated(default_run):
    """The default workflow's run (conftest.default_run: the embedded default, a 48-token draft
    vocabulary, both formats measured in its report), then a copy of its vLLM-format draft with d2t
    shifted by one place served in real vLLM."""
    wd, cfg, report = default_run
    assert cfg["draft"]["vocab_size"] == DRAFT_VOCAB, "the embedded default's draft vocabulary changed"

    # The same draft with every draft id mapped to its neighbour's target id (a permutation: in range).
    wrong = wd / "wrong_d2t"
    shutil.rmtree(wrong, ignore_errors=True)
    shutil.copytree(wd / "draft/checkpoint", wrong)
    config, tensors = load_exported(wrong)
    d2t = tensors["d2t"]
    shifted = torch.roll(draft_to_target_ids(d2t), 1)
    tensors["d2t"] = shifted - torch.arange(len(d2t))
    save_safetensors(tensors, wrong / "model.safetensors", {"format": "pt"})
    model, spec, _ = how_to_serve("vllm", wrong, K, cfg["server"]["model"])
    wrong_run = measure_draft("wrong_d2t", wd, cfg, spec, server=eager(cfg["server"]))
    return wd, report, wrong_run


@pytest.mark.vllm
@pytest.mark.timeout(3600)  # the session-wide default run, when these run first
def test_both_formats_are_written_with_a_smaller_draft_vocabulary(validated):
    wd, report, _ = validated
    for fmt in ("checkpoint", "speculators"):
        config, tensors = load_exported(wd / "draft" / fmt)
        flat = flat_config(config)
        assert flat["draft_vocab_size"] == DRAFT_VOCAB < flat["vocab_size"] == 105, fmt
        assert "d2t" in tensors and len(tensors["d2t"]) == DRAFT_VOCAB and tensors["d2t"].any()  # not the identity
        text = (wd / "draft" / fmt / "README.md").read_text()
        assert VALIDATION_MARK in text and f"{report['formats']['vllm' if fmt == 'checkpoint' else fmt]['acceptance_length']:.3f}" in text
    assert report["settings"]["draft_vocab_size"] == DRAFT_VOCAB and report["settings"]["vocab_size"] == 105


@pytest.mark.vllm
@pytest.mark.timeout(3600)  # the session-wide default run, when these run first
def test_both_formats_agree_in_vllm(validated):
    """Real vLLM serves each format with speculative decoding; greedy, the same weights give the same acceptance."""
    wd, report, _ = validated
    vllm, spec = report["formats"]["vllm"], report["formats"]["speculators"]
    summary = f"vllm format {vllm['acceptance_length']:.4f}, speculators {spec['acceptance_length']:.4f}; {wd}"
    assert vllm["drafts"] > 0 and spec["drafts"] > 0, summary
    assert spec["served_as"].startswith("vllm serve <draft dir>"), spec["served_as"]  # as its users start it
    assert abs(vllm["acceptance_length"] - spec["acceptance_length"]) <= 0.01, summary
    assert report["formats_agree"]["agree"], report["formats_agree"]
    assert report["checks"]["export_vs_training"] == []  # both formats read back as trained
    assert not [w for w in report["warnings"] if w["kind"] in ("formats", "disagreement")], report["warnings"]


@pytest.mark.vllm
@pytest.mark.timeout(3600)  # the session-wide default run, when these run first
def test_vllm_reads_d2t(validated):
    """vLLM stays within 10% of the offline prediction with the right d2t, and falls clearly below
    it with d2t shifted by one: the check catches a mapping vLLM would read wrongly."""
    wd, report, wrong = validated
    offline = report["offline"]["acceptance_length"]
    summary = (f"offline {offline:.3f}, vLLM {report['eagle3']['acceptance_length']:.3f}, wrong d2t "
               f"{wrong['acceptance_length']:.3f}; {wd}")
    assert report["offline"]["target_agreement"] > 0.98, report["offline"]
    assert offline > 1.5, summary  # a draft worth checking: a small vocabulary still gives a good acceptance
    for fmt in ("vllm", "speculators"):
        assert within_prediction(report["formats"][fmt]["acceptance_length"], offline), summary
    assert not within_prediction(wrong["acceptance_length"], offline), summary
    assert wrong["acceptance_length"] < 0.75 * offline, summary
    (wd / "formats.json").write_text(json.dumps({"offline": offline, "wrong_d2t": wrong["acceptance_length"],
                                                 **{f: r["acceptance_length"] for f, r in report["formats"].items()}}))
