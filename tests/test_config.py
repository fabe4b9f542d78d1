"""The workflow config is validated against schemas/config.schema.yaml before any job runs."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglenest.config import ConfigError, load_config, validate_config

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_are_filled():
    cfg = validate_config({"generation": {"max_tokens": 64}})
    assert cfg["generation"]["max_tokens"] == 64
    assert cfg["generation"]["concurrency"] == 200
    assert cfg["server"]["mode"] == "local"
    assert cfg["shards"] >= 1


def test_shipped_configs_are_valid():
    for path in [ROOT / "config.yaml", *sorted((ROOT / "configs").glob("*.yaml"))]:
        load_config(path)


@pytest.mark.parametrize("bad, key", [
    ({"generation": {"max_tokenz": 5}}, "max_tokenz"),
    ({"generation": {"max_tokens": "many"}}, "generation.max_tokens"),
    ({"shards": 0}, "shards"),
    ({"server": {"mode": "cloud"}}, "server.mode"),
    ({"server": {"urls": ["localhost:8000"]}}, "server.urls.0"),
    ({"datasett": {}}, "datasett"),
])
def test_bad_key_or_type_is_named(bad, key):
    with pytest.raises(ConfigError) as e:
        validate_config(bad)
    assert key in str(e.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_snakemake_refuses_bad_config_before_any_job(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"generation": {"max_tokenz": 5}}))
    out = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path),
                          "--cores", "1", "-n"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "max_tokenz" in out.stdout + out.stderr
    assert not (tmp_path / "data").exists()


def test_every_schema_default_reaches_the_code_unchanged():
    """The schema is the only place a default is written: what the library falls back to, when a
    key is not given, is exactly the schema's default."""
    import dataclasses

    from eaglenest.draft.checkpoint import train_record
    from eaglenest.settings import GenerationSettings
    from eaglenest.settings import TrainSettings
    from eaglenest.settings import ValidateSettings
    from eaglenest.validation.matrix import matrix_temperatures
    from eaglenest.config import defaults
    from eaglenest.serving.settings import ServerConfig
    from eaglenest.serving.settings import SlurmSettings

    resolved = validate_config({})
    assert defaults() == resolved
    assert dataclasses.asdict(ServerConfig()) == resolved["server"]
    assert ServerConfig.from_dict(resolved["server"]) == ServerConfig()
    assert dataclasses.asdict(SlurmSettings()) == resolved["server"]["slurm"]
    assert SlurmSettings.from_dict(resolved["server"]["slurm"]) == SlurmSettings()
    generation = GenerationSettings.defaults()
    assert {k: getattr(generation, k) for k in resolved["generation"]} == resolved["generation"]
    shape = ("kind", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "norm_before_residual",
             "mask_token_id")
    assert train_record(TrainSettings.defaults()) == {**{k: v for k, v in resolved["train"].items() if k not in ("device", "gpus", "nproc")},
                                                      **{k: resolved["draft"][k] for k in shape}, "dflash": resolved["draft"]["dflash"]}
    # validate: each key a field of the stage, as the schema gives it; the null defaults fall back to
    # generation's: its max_tokens and top_p, and 0 and its temperature.
    stage = ValidateSettings.defaults()
    assert {k: getattr(stage, k) for k in resolved["validate"] if k != "drafts"} == \
        {k: x for k, x in resolved["validate"].items() if k != "drafts"}
    assert stage.other_drafts == resolved["validate"]["drafts"]
    assert (stage.request_max_tokens, stage.request_top_p) == (resolved["generation"]["max_tokens"],
                                                              resolved["generation"]["top_p"])
    assert matrix_temperatures(stage.temperatures, resolved["generation"]["temperature"]) == [0.0]


def test_library_functions_take_their_stage_settings_instead_of_repeating_defaults():
    """The stages' entry points have no keyword that repeats a config key (and its default): they take
    their stage's settings object (the parametrized check of each: tests/test_settings.py)."""
    import inspect

    from eaglenest.data import prompts
    from eaglenest.config import defaults

    params = inspect.signature(prompts.prepare_prompts).parameters
    assert "settings" in params and not set(defaults("dataset")) & set(params)
