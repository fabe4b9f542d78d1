"""Rule fetch_inputs puts what the jobs read from the Hugging Face hub (the evaluation sets, the target's config
and tokenizer) in the caches before them, so compute nodes without internet never download. Without the hub,
what is cached passes and what is not is named, one line each, with the command that fetches it.

Every run here is offline (HF_HUB_OFFLINE=1) with an empty $HF_HOME of its own."""
import json
import os
import subprocess
import sys

import yaml

from eaglenest.config import validate_config
from eaglenest.fetch import hub_evalsets, hub_models
from eaglenest.gguf import converted_dir
from eaglenest.settings import FetchSettings
from tests.support.config import ROOT
from tests.support.hub import cache_hub_dataset, cache_hub_model
from tests.support.workflow import run_snakemake

FETCH = """
import sys, yaml
from eaglenest.config import validate_config
from eaglenest.fetch import FetchError, fetch_inputs
from eaglenest.settings import FetchSettings
try:
    fetch_inputs(FetchSettings.from_config(validate_config(yaml.safe_load(open("config.yaml")))), "data/fetched.json", log=print)
except FetchError as e:
    sys.exit(str(e))
"""


def _offline_env(tmp_path) -> dict:
    (tmp_path / "hf").mkdir(exist_ok=True)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}


def _fetch(wd, config: dict) -> subprocess.CompletedProcess:
    """fetch_inputs in a fresh process (as the rule runs it), working directory ``wd``, offline."""
    (wd / "config.yaml").write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-c", FETCH], cwd=wd, capture_output=True, text=True, timeout=300,
                          env=_offline_env(wd))


def test_the_embedded_default_run_elsewhere_fetches_nothing_and_needs_no_network(tmp_path, monkeypatch):
    """Its target and evaluation set are the workflow's own files: the rule passes offline, from any directory."""
    for key, value in _offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    run_snakemake(tmp_path / "run", "fetch_inputs")
    record = json.loads((tmp_path / "run/data/fetched.json").read_text())
    assert record["fetched"] == {} and record["local"] == 2
    assert "does not answer" in record["hub"] or "HF_HUB_OFFLINE" in record["hub"]
    assert "0 input(s) from the hub" in (tmp_path / "run/logs/fetch_inputs.log").read_text()


def test_what_is_neither_cached_nor_reachable_is_named_with_the_command_that_fetches_it(tmp_path):
    out = _fetch(tmp_path, {
        "server": {"model": str(ROOT / "toy/target")}, "hidden": {"target": "Org/Absent"},
        "validate": {"datasets": [{"name": "new_forms", "path": str(ROOT / "toy/eval_prompts.jsonl")},
                                  {"name": "gsm8k", "path": "openai/gsm8k", "subset": "main", "split": "test"}]}})
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2, out.stderr[-3000:]
    evalset, target = lines
    assert evalset.startswith("validate.datasets[1].path (gsm8k) openai/gsm8k: not in the datasets cache")
    assert "`hf download openai/gsm8k --repo-type dataset --local-dir <dir>`" in evalset
    assert "`snakemake fetch_inputs`" in evalset and "test split's file of subset main" in evalset
    assert target.startswith("the target Org/Absent: its config.json and tokenizer are not in the Hugging Face cache")
    assert f"`HF_HOME={tmp_path / 'hf'} hf download Org/Absent`" in target
    assert not (tmp_path / "data/fetched.json").exists()


def test_a_hub_set_and_target_already_cached_are_found_without_the_hub(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(10)]
    cache_hub_dataset(tmp_path / "data/.hf_cache", "org/tiny_evalset", "main", "test", rows)
    cache_hub_model(tmp_path / "hf", "Org/Tiny", {"config.json": {"model_type": "llama"}, "tokenizer_config.json": {}})
    out = _fetch(tmp_path, {
        "server": {"model": str(ROOT / "toy/target")}, "hidden": {"target": "Org/Tiny"},
        "validate": {"datasets": [{"name": "tiny", "path": "org/tiny_evalset", "subset": "main", "split": "test"}]}})
    assert out.returncode == 0, out.stderr[-3000:]
    fetched = json.loads((tmp_path / "data/fetched.json").read_text())["fetched"]
    assert fetched["validate.datasets[0].path (tiny)"].startswith("10 prompts, cached in data/.hf_cache")
    assert fetched["the target Org/Tiny"].endswith("snapshots/" + "0" * 40)


def test_only_hub_names_are_fetched_not_local_packaged_or_converted_files(tmp_path, monkeypatch):
    """The SmolLM2 preset: a GGUF target (converted to models/<name> by rule convert_target, not yet there) and
    evaluation sets in PyPI packages need nothing from the hub; a hub target and set beside them do."""
    monkeypatch.chdir(tmp_path)
    cfg = validate_config(yaml.safe_load((ROOT / "configs/smollm2-135m.yaml").read_text()))
    cfg["server"]["model"] = converted_dir(cfg["server"]["model"])  # as rules/common.smk rewrites it
    assert hub_evalsets(FetchSettings.from_config(cfg)) == [] and hub_models(FetchSettings.from_config(cfg)) == []
    cfg["hidden"]["target"] = "Org/Tiny"
    cfg["validate"]["datasets"].append({"name": "gsm8k", "path": "openai/gsm8k", "subset": "main", "split": "test"})
    settings = FetchSettings.from_config(cfg)
    assert [key for key, _ in hub_evalsets(settings)] == ["validate.datasets[2].path (gsm8k)"]
    assert hub_models(settings) == ["Org/Tiny"]
