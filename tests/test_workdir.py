"""Runs in their own directory (`snakemake --directory runs/a`): the outputs land there, a relative path in the
config is the working directory's, and the files the workflow ships (toy/..., what the embedded default names)
are found from any directory. Two configs then run side by side without mixing outputs."""
import json

import yaml

from eaglenest.config import resolve_shipped_paths, validate_config
from tests.support.config import ROOT
from tests.support.workflow import rules_run, run_snakemake


def _config(**datasets) -> dict:
    return validate_config({"server": {"model": "toy/target"}, "dataset": {"path": "toy/prompts.jsonl"},
                            "validate": {"datasets": [{"name": n, "path": p} for n, p in datasets.items()]}})


def test_a_relative_path_is_the_working_directorys_else_the_workflows_own(tmp_path):
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy/prompts.jsonl").write_text('{"question": "mine"}\n')  # the user's own file of the same name
    cfg = _config(new_forms="toy/eval_prompts.jsonl", gsm8k="openai/gsm8k", mine="toy/nowhere.jsonl")
    notes = resolve_shipped_paths(cfg, tmp_path, ROOT)
    assert cfg["dataset"]["path"] == "toy/prompts.jsonl"
    assert cfg["server"]["model"] == str(ROOT / "toy/target")
    assert [d["path"] for d in cfg["validate"]["datasets"]] == [str(ROOT / "toy/eval_prompts.jsonl"), "openai/gsm8k",
                                                                "toy/nowhere.jsonl"]
    assert [n.split(":")[0] for n in notes] == ["server.model toy/target", "validate.datasets[0].path toy/eval_prompts.jsonl"]
    assert all(f"not in the working directory {tmp_path}" in n for n in notes)


def test_in_the_workflows_own_directory_nothing_is_resolved():
    cfg = _config(new_forms="toy/eval_prompts.jsonl")
    assert resolve_shipped_paths(cfg, ROOT, ROOT) == [] and cfg["server"]["model"] == "toy/target"


def test_the_embedded_default_dry_runs_in_another_directory_with_its_outputs_there(tmp_path):
    wd = tmp_path / "a"
    out = run_snakemake(wd, "-n")
    text = out.stdout + out.stderr
    assert f"Working directory: {wd}" in text and "output: reports/validation.json" in text
    assert f"the workflow's own {ROOT / 'toy/eval_prompts.jsonl'}" in text  # said in the log ...
    resolved = (wd / "logs/config.resolved.yaml").read_text()  # ... and in the resolved config
    assert f"# validate.datasets[0].path toy/eval_prompts.jsonl: not in the working directory {wd}" in resolved
    assert yaml.safe_load(resolved)["dataset"]["path"] == str(ROOT / "toy/prompts.jsonl")
    assert {"fetch_inputs", "prepare_prompts", "validate_draft"} <= rules_run(out)


def test_two_configs_run_side_by_side_without_mixing_outputs(tmp_path):
    """The embedded default in runs/a, a config.yaml of its own in runs/b (relative toy paths, read from the
    workflow's directory): each run's prompts are its own."""
    (tmp_path / "runs/b").mkdir(parents=True)
    other = yaml.safe_load((ROOT / "config.yaml").read_text())
    other["dataset"]["limit"] = 100
    (tmp_path / "runs/b/config.yaml").write_text(yaml.safe_dump(other))
    for run in ("a", "b"):
        run_snakemake(tmp_path / "runs" / run, "prepare_prompts")
    stats = {run: json.loads((tmp_path / "runs" / run / "data/prompts/stats.json").read_text()) for run in "ab"}
    assert (stats["a"]["train"], stats["b"]["train"]) == (600, 100)  # dataset.limit: the training prompts, beside 40 held out
    assert not (tmp_path / "data").exists()
