"""One settings object per stage (eaglenest.settings): built from the validated config, its defaults the
schema's, and a fingerprint that changes exactly when the stage's outputs would."""
import copy
import inspect
from dataclasses import fields

import pytest

from eaglenest.config import MOVED_KEYS, ConfigError, defaults, validate_config
from eaglenest.serving.settings import ServerConfig, SlurmSettings
from eaglenest.settings import (DFlashSettings, DraftSettings, ExportSettings, FetchSettings, GenerationSettings,
                                HiddenSettings, PlanSettings, PromptSettings, QuestionSettings, Stage, TrainSettings,
                                ValidateSettings, lookup)
from eaglenest.states.target import TargetFacts

STAGES = (PromptSettings, QuestionSettings, GenerationSettings, HiddenSettings, DraftSettings, DFlashSettings, TrainSettings,
          ValidateSettings, ExportSettings, FetchSettings, ServerConfig, SlurmSettings)


def _with(changes: dict) -> dict:
    """The default config with dotted keys changed, validated as the workflow validates it."""
    config = copy.deepcopy(defaults())
    for key, value in changes.items():
        section, name = key.rsplit(".", 1) if "." in key else ("", key)
        (lookup(config, section) if section else config)[name] = value
    return validate_config(config)


@pytest.mark.parametrize("old, new", [("train.intermediate_size", "draft.intermediate_size"),
                                      ("train.head_dim", "draft.head_dim"),
                                      ("hidden.concurrency", "hidden.vllm.concurrency"),
                                      ("hidden.gpu_memory_gib", "hidden.vllm.gpu_memory_gib"),
                                      ("hidden.batch_tokens", "hidden.transformers.batch_tokens"),
                                      ("hidden.max_disk_gb", "hidden.stream.max_disk_gb")])
def test_a_moved_key_is_refused_naming_its_new_place(old, new):
    section, key = old.split(".")
    with pytest.raises(ConfigError) as err:
        validate_config({section: {key: 64}})
    assert f"{old} moved to {new}" in str(err.value)


def test_every_flat_hidden_key_of_old_is_refused_and_its_new_place_is_a_schema_key():
    """A config written before `hidden:` was grouped by backend and mode: every one of its keys either stays
    at hidden's top or is refused, all of them in one message, each naming a key the schema has."""
    flat = {"backend": "vllm", "mode": "stream", "target": None, "dtype": "bfloat16", "max_length": 64,
            "use_truncated": True, "temporary": False, "gpus": 1, "concurrency": 8, "port": 9000,
            "request_timeout": 60, "max_retries": 1, "backoff_base": 1.0, "backoff_max": 2.0, "states_dir": "s",
            "server_env": {}, "gpu_memory_utilization": 0.5, "gpu_memory_gib": 80, "device": "cpu",
            "batch_tokens": 64, "max_disk_gb": 1, "cache": False, "stream_ahead": 2, "placement": "node"}
    with pytest.raises(ConfigError) as err:
        validate_config({"hidden": flat})
    moved = {old: new for old, new in MOVED_KEYS.items() if old.startswith("hidden.")}
    stays = {k for k in flat if f"hidden.{k}" not in moved}
    assert stays == {"backend", "mode", "target", "dtype", "max_length", "use_truncated", "temporary", "gpus"}
    for old, new in moved.items():
        assert f"{old} moved to {new}" in str(err.value)
        lookup(defaults(), new)  # a KeyError: the new place is not in the schema
    assert validate_config({"hidden": {k: flat[k] for k in stays}})["hidden"]["mode"] == "stream"


def test_a_regrouped_hidden_section_validates_and_reaches_the_settings():
    config = validate_config({"hidden": {"backend": "vllm", "mode": "stream", "max_length": 64,
                                         "vllm": {"concurrency": 8, "gpu_memory_utilization": 0.5},
                                         "transformers": {"batch_tokens": 128},
                                         "stream": {"max_disk_gb": 2, "placement": "slurm"}}})
    hidden = HiddenSettings.from_config(config)
    assert (hidden.concurrency, hidden.gpu_memory_utilization, hidden.batch_tokens) == (8, 0.5, 128)
    assert (hidden.max_disk_gb, hidden.placement, hidden.stream_ahead) == (2, "slurm", defaults("hidden.stream")["stream_ahead"])
    with pytest.raises(ConfigError, match=r"hidden.vllm: .*'max_disk_gb' was unexpected"):
        validate_config({"hidden": {"vllm": {"max_disk_gb": 2}}})  # a key in another part than its own


def test_every_key_of_a_stage_section_is_a_field_of_a_stage():
    """A new schema key without a field (or a field without a schema key) fails here: a setting is written
    in two places, the schema and its stage's field."""
    read = {key for cls in STAGES for f in fields(cls) for key in f.metadata["keys"]}
    for section in ("generation", "hidden", "hidden.vllm", "hidden.transformers", "hidden.stream", "draft", "draft.dflash",
                    "train", "export", "server", "server.slurm"):
        missing = {f"{section}.{k}" for k in defaults(section)} - read - {"hidden.vllm", "hidden.transformers",
                                                                          "hidden.stream", "draft.dflash"}
        assert not missing, f"schema keys no stage reads: {sorted(missing)}"
    assert {f"dataset.{k}" for k in defaults("dataset") if k != "generate"} <= read
    assert {f"dataset.generate.{k}" for k in defaults("dataset.generate")} <= read
    for key in read:
        lookup(defaults(), key)  # a KeyError: a field reads a key the schema does not have


def test_the_plan_reads_every_plan_key_as_a_field():
    """`plan:` is read by the plan and the checks alone, through PlanSettings: each key one field, its default the
    schema's."""
    assert {f"plan.{k}" for k in defaults("plan")} <= {key for f in fields(PlanSettings) for key in f.metadata["keys"]}
    assert PlanSettings.defaults() == PlanSettings.from_config(validate_config({})) == PlanSettings()


@pytest.mark.parametrize("cls", STAGES)
def test_defaults_are_the_schemas(cls):
    assert cls.defaults() == cls.from_config(validate_config({}))
    assert cls() == cls.defaults()


@pytest.mark.parametrize("cls, base, key, value, reruns", [
    (PromptSettings, {}, "dataset.cache_dir", None, False),
    (PromptSettings, {}, "dataset.heldout", 3, True),
    (PromptSettings, {}, "shards", 2, True),
    (PromptSettings, {}, "dataset.generate.questions", 5, True),  # the dataset read becomes the questions
    (QuestionSettings, {}, "dataset.generate.temperature", 0.7, True),
    (QuestionSettings, {}, "validate.datasets", [{"name": "x", "path": "toy/eval_prompts.jsonl"}], True),
    (QuestionSettings, {}, "generation.concurrency", 7, False),
    (QuestionSettings, {}, "generation.max_tokens", 7, False),  # first questions alone: no answers asked
    (QuestionSettings, {"dataset.generate.turns": 2}, "generation.max_tokens", 7, True),  # the answers between turns
    (QuestionSettings, {}, "dataset.generate.turns", 2, True),
    (GenerationSettings, {}, "generation.concurrency", 7, False),
    (GenerationSettings, {}, "generation.request_timeout", 5, False),
    (GenerationSettings, {}, "generation.temperature", 0.6, True),
    (GenerationSettings, {}, "server.served_model_name", "other", True),
    (HiddenSettings, {}, "hidden.transformers.batch_tokens", 64, False),
    (HiddenSettings, {}, "hidden.vllm.concurrency", 2, False),
    (HiddenSettings, {}, "hidden.dtype", "float32", False),  # backend vllm: the server's dtype counts
    (HiddenSettings, {}, "server.dtype", "float32", True),
    (HiddenSettings, {}, "hidden.max_length", 99, True),
    (HiddenSettings, {"hidden.backend": "transformers"}, "hidden.dtype", "float32", True),
    (HiddenSettings, {"hidden.backend": "transformers"}, "server.dtype", "float32", False),
    (HiddenSettings, {"hidden.backend": "transformers"}, "draft.aux_layers", [1, 2, 3], True),
    (DraftSettings, {}, "draft.head_dim", 8, True),
    (DraftSettings, {}, "hidden.use_truncated", False, False),
    (TrainSettings, {}, "train.device", "cpu", False),
    (TrainSettings, {}, "train.nproc", 2, False),
    (TrainSettings, {}, "train.lr", 0.01, True),
    (TrainSettings, {}, "draft.num_attention_heads", 2, True),
    (TrainSettings, {}, "hidden.max_length", 99, False),  # files mode: the shards carry it
    (TrainSettings, {"hidden.mode": "stream"}, "hidden.max_length", 99, True),
    (TrainSettings, {"hidden.mode": "stream"}, "hidden.stream.stream_ahead", 2, False),
    (ValidateSettings, {}, "dataset.cache_dir", None, False),
    (ValidateSettings, {}, "validate.concurrency", 2, True),
    (ValidateSettings, {}, "generation.max_tokens", 7, True),
    (ExportSettings, {}, "export.format", "vllm", False),
    (ExportSettings, {}, "export.license", "mit", True),
    (ExportSettings, {}, "validate.num_speculative_tokens", 2, True),
    (FetchSettings, {}, "dataset.cache_dir", None, False),
    (FetchSettings, {}, "hidden.target", "Org/Other", True),
    (FetchSettings, {}, "validate.datasets", [{"name": "gsm8k", "path": "openai/gsm8k"}], True),
])
def test_a_key_changes_the_fingerprint_exactly_when_it_changes_the_outputs(cls, base, key, value, reruns):
    before = cls.from_config(_with(base))
    after = cls.from_config(_with({**base, key: value}))
    assert before != after, f"{key} is not read by {cls.__name__}"
    assert (before.fingerprint() != after.fingerprint()) is reruns


def test_fingerprints_are_plain_data():
    """A rule's settings param: plain values Snakemake records and compares (and the lint reads as no path)."""
    def plain(v):
        return v is None or isinstance(v, (str, int, float, bool)) or \
            (isinstance(v, list) and all(map(plain, v))) or \
            (isinstance(v, dict) and all(isinstance(k, str) and plain(x) for k, x in v.items()))
    config = _with({"hidden.mode": "stream"})
    for cls in STAGES:
        assert isinstance(cls.from_config(config).fingerprint(), dict) and plain(cls.from_config(config).fingerprint())
    assert plain(ServerConfig.from_config(config).fingerprint())
    assert plain(DraftSettings.defaults().vocab_fingerprint()) and plain(HiddenSettings.defaults().head_fingerprint())


def test_the_head_fingerprint_changes_with_the_target_and_aux_layers_only():
    base = HiddenSettings.defaults()
    assert base.replace(max_length=7, backend="transformers").head_fingerprint() == base.head_fingerprint()
    assert base.replace(aux_layers=[1, 2, 3]).head_fingerprint() != base.head_fingerprint()
    assert base.replace(target="org/other").head_fingerprint() != base.head_fingerprint()


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        TrainSettings.defaults().lr = 1.0
    with pytest.raises(AttributeError):
        ServerConfig().model = "other"


def test_training_config_takes_the_drafts_shape_from_draft():
    from eaglenest.draft.checkpoint import train_record

    settings = TrainSettings.from_config(_with({"draft.intermediate_size": 48, "draft.norm_before_residual": True}))
    record = train_record(settings)  # what the checkpoint records of the run
    assert record["intermediate_size"] == 48 and record["norm_before_residual"] is True
    assert not {"device", "gpus", "nproc", "draft", "hidden"} & set(record)


def test_draft_kind_reaches_the_draft_and_retrains_it():
    """draft.kind travels like the draft's other shape keys (DraftSettings -> the training config ->
    DraftConfig) and is in train_draft's fingerprint; the schema refuses a kind vLLM does not serve."""
    from eaglenest.draft.checkpoint import draft_config
    from eaglenest.states.target import TargetFacts

    eagle31, eagle3 = TrainSettings.defaults(), TrainSettings.from_config(_with({"draft.kind": "eagle3"}))
    assert eagle3.draft.kind == "eagle3" and eagle31.draft.kind == "eagle3.1"  # the default: eagle3.1
    assert eagle3.fingerprint() != eagle31.fingerprint()
    from transformers import LlamaConfig

    target = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2)
    info = TargetFacts.of(target, [1, 2, 3], "t")
    for settings, on in ((eagle3, False), (eagle31, True)):
        dcfg = draft_config(info, 20, settings.draft)
        assert (dcfg.fc_norm, dcfg.norm_output, dcfg.kind) == (on, on, settings.draft.kind)
        assert (dcfg.parallel_drafting, dcfg.mask_token_id) == (False, None)
    # P-EAGLE: parallel drafting, its mask token the target's last id unless draft.mask_token_id names one
    peagle = TrainSettings.from_config(_with({"draft.kind": "peagle"}))
    masked = TrainSettings.from_config(_with({"draft.kind": "peagle", "draft.mask_token_id": 7}))
    assert peagle.fingerprint() != eagle3.fingerprint() and masked.fingerprint() != peagle.fingerprint()
    for settings, mask in ((peagle, 49), (masked, 7)):
        dcfg = draft_config(info, 20, settings.draft)
        assert (dcfg.kind, dcfg.parallel_drafting, dcfg.mask_token_id) == ("peagle", True, mask)
    with pytest.raises(Exception, match="eagle3.2|enum|not one of"):
        _with({"draft.kind": "eagle3.2"})


@pytest.mark.parametrize("fn, cls", [
    ("eaglenest.states.hidden:extract_hidden", HiddenSettings),
    ("eaglenest.states.extract:extract_hidden_vllm", HiddenSettings),
    ("eaglenest.states.target:save_target_head", HiddenSettings),
    ("eaglenest.draft.vocab:build_vocab", DraftSettings),
    ("eaglenest.data.prompts:prepare_prompts", PromptSettings),
    ("eaglenest.validation.validate:validate_draft", ValidateSettings),
    ("eaglenest.validation.curve:measure_point", ValidateSettings),
    ("eaglenest.draft.export:export_draft", ExportSettings),
    ("eaglenest.data.questions:write_questions", QuestionSettings),
    ("eaglenest.fetch:fetch_inputs", FetchSettings),
])
def test_a_stage_function_takes_its_settings_object_not_keywords_that_repeat_the_schema(fn, cls):
    import importlib

    module, name = fn.split(":")
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    assert "settings" in params
    assert not {f.name for f in fields(cls)} & set(params), f"{name} repeats a setting of {cls.__name__}"


def test_target_facts_are_written_and_read_by_one_pair(tmp_path):
    facts = TargetFacts(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8, intermediate_size=16,
                        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=10,
                        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                        max_position_embeddings=64, aux_layers=[1, 2, 3], last_hidden="post_norm", target="t")
    facts.write(tmp_path / "target_head.safetensors")
    assert (tmp_path / "target_head.json").is_file()
    assert TargetFacts.read(tmp_path / "target_head.safetensors") == facts
    (tmp_path / "target_head.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match=r"target_head.json does not hold.*missing \['architectures'"):
        TargetFacts.read(tmp_path / "target_head.safetensors")


def test_stage_is_the_base_of_every_stage():
    assert all(issubclass(cls, Stage) for cls in STAGES)


def test_schema_descriptions_are_short_and_the_long_ones_link_to_the_docs():
    """A description is at most 200 characters; where a key needs more, it links to docs/settings.md,
    which has a section for it."""
    from eaglenest.config import SCHEMA_PATH, load_schema

    docs = (SCHEMA_PATH.parent.parent / "docs" / "settings.md").read_text()
    too_long, linked = [], 0

    def walk(node, path):
        nonlocal linked
        if not isinstance(node, dict):
            return
        text = node.get("description")
        if isinstance(text, str):
            if len(text) > 200:
                too_long.append(f"{path} ({len(text)})")
            if "docs/settings.md" in text and path.count(".") > 0:
                linked += 1
                assert f"### {path}" in docs, f"docs/settings.md has no section on {path}"
        for key, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{key}" if path else key)

    walk(load_schema(), "")
    assert not too_long, too_long
    assert linked >= 15


def test_any_hidden_key_restarts_the_extraction_server_but_only_some_re_extract():
    base = HiddenSettings.defaults()
    changed = base.replace(port=8999)
    assert changed.fingerprint() == base.fingerprint() and changed.server_fingerprint() != base.server_fingerprint()
