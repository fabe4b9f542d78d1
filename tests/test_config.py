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
