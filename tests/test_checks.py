"""Checks before any job (eaglenest.checks): a config the target or the disk cannot run stops `snakemake -n`
and `python -m eaglenest.checks` with one line naming the key, the value, the limit and the fix, before
any output is made. The target is a directory holding only a config.json (the toy's, changed)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglenest.checks import check_config, review_config
from eaglenest.config import validate_config
from eaglenest.errors import ConfigError
from eaglenest.gpus import known_gpu
from eaglenest.plan import format_plan, make_plan
from eaglenest.serving.settings import SlurmSettings
from eaglenest.serving.slurm_cluster import cluster_partitions, partition_nodes, slurm_time_ok
from eaglenest.settings import PromptSettings

ROOT = Path(__file__).resolve().parent.parent
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
TOY = json.loads((ROOT / "toy/target/config.json").read_text())  # 28 layers, 4 heads, vocabulary 105


def target(tmp_path: Path, **changes) -> str:
    d = tmp_path / "target"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**TOY, **changes}))
    return str(d)


def toy_config(model: str, **sections) -> dict:
    """The embedded default with absolute paths, the given target and a stated GPU memory; ``sections`` update its
    sections."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["dataset"]["path"] = str(ROOT / "toy/prompts.jsonl")
    cfg["validate"]["datasets"][0]["path"] = str(ROOT / "toy/eval_prompts.jsonl")
    cfg["server"]["model"] = model
    cfg["hidden"].setdefault("vllm", {})["gpu_memory_gib"] = 80  # no nvidia-smi here: the extraction memory is checked
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


# (name, target config.json changes, config changes, what the one line names)
CASES = [
    ("aux_out_of_range", {}, {"draft": {"aux_layers": [2, 14, 28]}},
     ["draft.aux_layers", "[2, 14, 28]", "num_hidden_layers 28", "from 1 to 27"]),
    ("aux_0_on_kimi_k25", {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                           "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": 28}},
     {"draft": {"aux_layers": [0, 14, 25]}}, ["draft.aux_layers", "[0, 14, 25]", "id 0", "from 1 to 27"]),
    ("aux_0_on_kimi_k2", {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]},
     {"draft": {"aux_layers": [0, 14, 25]}}, ["draft.aux_layers", "id 0", "DeepseekV3ForCausalLM"]),
    ("draft_vocab_above_target", {}, {"draft": {"vocab_size": 200}},
     ["draft.vocab_size 200", "(105, vocab_size", "set draft.vocab_size to 105 or less"]),
    ("max_tokens_fill_max_model_len", {}, {"generation": {"max_tokens": 512}},
     ["generation.max_tokens 512", "server.max_model_len 512", "below 512"]),
    ("max_length_above_max_model_len", {}, {"hidden": {"max_length": 1024}},
     ["hidden.max_length 1,024", "server.max_model_len 512", "to 512 or less"]),
    ("max_model_len_above_the_context", {"max_position_embeddings": 256}, {"hidden": {"max_length": 256}},
     ["server.max_model_len 512", "256 tokens", "max_position_embeddings", "set it to 256 or less"]),
    ("max_tokens_fill_the_context_with_max_model_len_null", {"max_position_embeddings": 300},
     {"server": {"max_model_len": None}, "hidden": {"max_length": 300}, "generation": {"max_tokens": 300}},
     ["generation.max_tokens 300", "the target's context of 300 tokens", "below 300"]),
    ("tensor_parallel_3_of_4_heads", {}, {"server": {"tensor_parallel_size": 3}},
     ["server.tensor_parallel_size 3", "4 attention heads", "[1, 2, 4]"]),
    ("tensor_parallel_of_text_config_heads", {"text_config": {"num_attention_heads": 6}},
     {"server": {"tensor_parallel_size": 4}}, ["server.tensor_parallel_size 4", "6 attention heads"]),
    ("missing_local_dataset", {}, {"dataset": {"path": "/nonexistent/prompts.jsonl"}},
     ["dataset.path /nonexistent/prompts.jsonl", "no such file", "Hugging Face dataset name"]),
    ("missing_validate_draft", {}, {"validate": {"drafts": [{"name": "peagle", "path": "runs/peagle/draft/checkpoint"}]}},
     ["validate.drafts 'peagle'", "runs/peagle/draft/checkpoint is not a directory", "exported draft directory"]),
    # the target's own hidden size sizes the shards (plan.hidden_size only stands in for a config.json not here)
    ("files_mode_beyond_the_disk", {"hidden_size": 10**6}, {"plan": {"hidden_size": 8}, "hidden": {"mode": "files"}},
     ["hidden.mode files", "TB", "set hidden.mode: stream"]),
]


def bad_config(tmp_path, target_changes, changes) -> dict:
    cfg = toy_config(target(tmp_path, **target_changes))
    for section, values in changes.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


@pytest.mark.parametrize("name, target_changes, changes, words", CASES, ids=[c[0] for c in CASES])
def test_a_bad_config_is_refused_with_one_line(name, target_changes, changes, words, tmp_path):
    cfg = validate_config(bad_config(tmp_path, target_changes, changes))
    with pytest.raises(ConfigError) as e:
        check_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path)
    line = str(e.value)
    assert "\n" not in line and all(w in line for w in words), line


def _no_gpu_env() -> dict:
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()]
    return {**os.environ, "PATH": os.pathsep.join(path)}


# The wiring, once for a check against the target's config.json and once for the disk's verdict (each
# dry run costs seconds; every case's line is checked in-process above).
WIRED = [c for c in CASES if c[0] in ("aux_0_on_kimi_k25", "files_mode_beyond_the_disk")]


@pytest.mark.parametrize("name, target_changes, changes, words", WIRED, ids=[c[0] for c in WIRED])
def test_the_dry_run_and_the_plan_stop_before_any_job(name, target_changes, changes, words, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(bad_config(tmp_path, target_changes, changes)))
    plan = subprocess.run([sys.executable, "-m", "eaglenest.checks", "--configfile", str(config), "-d", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=_no_gpu_env())
    assert plan.returncode == 1 and plan.stdout.startswith("plan:\n")  # what it would cost, then what to fix
    assert len(plan.stderr.strip().splitlines()) == 1 and all(w in plan.stderr for w in words), plan.stderr
    run = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path / "wd"), "-n", "--cores", "1",
                          "--configfile", str(config)], capture_output=True, text=True, timeout=300, env=_no_gpu_env())
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in out
    assert any(all(w in line for w in words) for line in out.splitlines()), out[-2000:]
    assert not (tmp_path / "wd/data").exists() and not (tmp_path / "wd/traces").exists()


def test_the_embedded_default_passes_every_check(tmp_path):
    cfg = validate_config(toy_config(str(ROOT / "toy/target")))
    assert check_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path) == []


def test_stream_mode_is_the_fix_for_files_mode_beyond_the_disk(tmp_path):
    cfg = validate_config(toy_config(str(ROOT / "toy/target"), plan={"hidden_size": 10**6}, hidden={"mode": "stream"}))
    assert check_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path) == []


def test_a_target_not_here_skips_its_checks_and_the_plan_says_so(tmp_path):
    cfg = validate_config(toy_config("Org/Absent", server={"max_model_len": None}, draft={"vocab_size": 10**6}))
    plan = make_plan(cfg, tmp_path, has_gpu=False)
    plan.skipped = check_config(cfg, plan, tmp_path)
    text = format_plan(plan)
    assert "skipped check: aux layer ids, draft vocabulary and tensor_parallel_size not checked" in text
    assert "hf download Org/Absent config.json" in text and "server.max_model_len is null" in text


def test_a_relative_target_and_dataset_are_read_from_the_working_directory(tmp_path):
    (tmp_path / "toy").symlink_to(ROOT / "toy")
    raw = yaml.safe_load((ROOT / "config.yaml").read_text())  # toy/target, toy/prompts.jsonl
    raw["hidden"].setdefault("vllm", {})["gpu_memory_gib"] = 80  # no nvidia-smi here: the extraction memory is checked
    cfg = validate_config(raw)
    assert check_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path) == []
    bad = validate_config({**cfg, "draft": {**cfg["draft"], "vocab_size": 200}})
    with pytest.raises(ConfigError, match="draft.vocab_size 200"):
        check_config(bad, make_plan(bad, tmp_path, has_gpu=False), tmp_path)


def test_a_hub_target_not_cached_is_fetched_where_the_hub_answers_then_checked(tmp_path, monkeypatch):
    """Online: the plan downloads the one config.json into the Hugging Face cache and the checks run on it (here
    the download is faked into a temporary cache: no machine of the suite reaches the hub). Offline
    (HF_HUB_OFFLINE): nothing is tried and the checks are skipped, said so."""
    import huggingface_hub

    from eaglenest import checks

    cache = tmp_path / "hub"
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    asked = []

    def fake_download(repo, filename, **_):
        asked.append((repo, filename))
        snap = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
        snap.mkdir(parents=True)
        (snap / filename).write_text(json.dumps({**TOY, "num_hidden_layers": 4}))
        (cache / f"models--{repo.replace('/', '--')}" / "refs").mkdir()
        (cache / f"models--{repo.replace('/', '--')}" / "refs" / "main").write_text("0" * 40)
        return str(snap / filename)

    monkeypatch.setattr("requests.head", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    cfg = validate_config(toy_config("org/target", draft={"aux_layers": [1, 2, 9]}))
    with pytest.raises(ConfigError) as e:
        check_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path)
    assert asked == [("org/target", "config.json")] and "draft.aux_layers" in str(e.value), str(e.value)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("tried the hub offline"))
    assert checks.fetch_config("org/other") is False
    cfg = validate_config(toy_config("org/other"))
    skipped = check_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path)
    assert any("no config.json for org/other" in note for note in skipped), skipped


def test_the_longest_prompt_in_the_chat_template_plus_max_tokens_must_fit_the_context(tmp_path):
    """Once prepare_prompts has run for this config, its longest prompt is counted with the target's chat template:
    with max_tokens leaving too little room the run stops before generation (vLLM would refuse that request);
    with room, it passes; stats made for another dataset are not read."""
    from eaglenest.data.prompts import prepare_prompts

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": "What is 1 + 2?" * (1 if i else 20)}]} for i in range(6)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = validate_config(toy_config(str(ROOT / "toy/target"), dataset={"path": str(prompts), "heldout": 1},
                                     server={"max_model_len": 512}, generation={"max_tokens": 300}))
    stats = prepare_prompts(tmp_path / "data/prompts", PromptSettings.from_config(cfg).replace(shards=1), progress=False)
    longest = stats["longest_prompt"]
    assert longest["chars"] == 280 and longest["messages"][0]["content"] == rows[0]["messages"][0]["content"]
    with pytest.raises(ConfigError) as e:
        check_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path)
    line = str(e.value)
    assert f"the longest prompt ({longest['id']}" in line and "generation.max_tokens 300" in line and "512" in line, line
    assert (tmp_path / "data/prompts/longest_prompt.tokens.json").is_file(), "the count is kept for the next plan"
    fits = validate_config(toy_config(str(ROOT / "toy/target"), dataset={"path": str(prompts), "heldout": 1},
                                      server={"max_model_len": 512}, generation={"max_tokens": 100}))
    check_config(fits, make_plan(fits, tmp_path, has_gpu=False), tmp_path)
    other = validate_config(toy_config(str(ROOT / "toy/target"), server={"max_model_len": 512}, generation={"max_tokens": 300}))
    check_config(other, make_plan(other, tmp_path, has_gpu=False), tmp_path)  # the toy's prompts: not prepared here


def text_only_dataset(path: Path, n: int = 30) -> str:
    path.write_text("".join(json.dumps({"text": f"What is {i} + {i}?"}) + "\n" for i in range(n)))
    return str(path)


def test_a_text_only_dataset_is_refused_in_the_dry_run_until_dataset_columns_names_its_column(tmp_path):
    """A dataset whose only column is `text` gave "prompts: 0" later and passed the dry-run: now the dry-run stops
    on it, naming the file, its columns and the setting; with dataset.columns.question: text it passes, the plan
    counts its rows and prepare_prompts reads them."""
    data = text_only_dataset(tmp_path / "text.jsonl")
    cfg = toy_config(str(ROOT / "toy/target"), dataset={"path": data, "heldout": 5})
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    run = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path / "wd"), "-n", "--cores", "1",
                          "--configfile", str(tmp_path / "bad.yaml")], capture_output=True, text=True, timeout=300,
                         env=_no_gpu_env())
    out = run.stdout + run.stderr
    words = [f"dataset.path {data}", "no question column", "['text']", "dataset.columns.question: text"]
    assert run.returncode != 0 and "Traceback" not in out
    assert any(all(w in line for w in words) for line in out.splitlines()), out[-2000:]
    assert not (tmp_path / "wd/data").exists()

    mapped = {**cfg, "dataset": {**cfg["dataset"], "columns": {"question": "text"}}}
    (tmp_path / "mapped.yaml").write_text(yaml.safe_dump(mapped))
    run = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path / "wd"), "-n", "--cores", "1",
                          "--configfile", str(tmp_path / "mapped.yaml")], capture_output=True, text=True, timeout=300,
                         env=_no_gpu_env())
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-2000:]
    assert f"prompts: 25 ({data}: 30 rows, at most)" in out and "prepare_prompts" in out
    from eaglenest.data.prompts import prepare_prompts

    stats = prepare_prompts(tmp_path / "prompts", PromptSettings.from_config(validate_config(mapped)), progress=False)
    assert (stats["kept"], stats["train"], stats["format"]) == (30, 25, "text")


def test_an_evaluation_sets_columns_are_checked_and_mapped_like_the_datasets(tmp_path):
    """validate.datasets[i].columns maps an evaluation set's columns as dataset.columns does (a misspelt column
    is refused naming the columns there), load_set reads it so, and a hub set is not read, said in one note."""
    from eaglenest.validation.evalsets import load_set, resolve_sets

    data = text_only_dataset(tmp_path / "eval.jsonl", 4)
    model = str(ROOT / "toy/target")
    for columns, words in [(None, ["validate.datasets[1].path (texts)", "validate.datasets[1].columns.question: text"]),
                           ({"question": "txt"}, ["validate.datasets[1].columns.question is 'txt'", "['text']"])]:
        cfg = toy_config(model)
        cfg["validate"]["datasets"].append({"name": "texts", "path": data, **({"columns": columns} if columns else {})})
        cfg = validate_config(cfg)
        with pytest.raises(ConfigError) as e:
            check_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    cfg = toy_config(model)
    cfg["validate"]["datasets"] += [{"name": "texts", "path": data, "columns": {"question": "text"}},
                                    {"name": "bench", "path": "org/bench"}]
    cfg = validate_config(cfg)
    skipped = check_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path)
    assert skipped == ["columns of the hub dataset(s) org/bench not checked: only local files are read before a job "
                       "(prepare_prompts and validate_draft check them)"]
    texts = resolve_sets(cfg["validate"]["datasets"], tmp_path / "heldout.jsonl")[2]
    rows = load_set(texts, cache_dir=str(tmp_path / "cache"))
    assert sorted(r["messages"][0]["content"] for r in rows) == sorted(f"What is {i} + {i}?" for i in range(4))


# ---------------------------------------------------------------------------------------------
# Settings that used to pass the dry-run and fail hours in: each refused by `snakemake -n`, key named

PRESET = {name: ROOT / "configs" / name for name in ("kimi-k2.5-int4.slurm.yaml", "kimi-k2.5-int4.yaml",
                                                     "llama-3.1-8b-instruct.slurm.yaml")}
# sinfo on a cluster whose GPU partition has nodes of 8 GPUs of the given type
H100_NODES, H200_NODES = "gpu*|gpu:h100:8(S:0-1)|h100,ib", "gpu*|gpu:h200:8(S:0-1)|h200,ib"


def dry_run(tmp_path: Path, *configs, sinfo: str | None = None, profile: bool = False) -> str:
    """`snakemake -n` with these config files (a preset's path, or a dict written as an overlay) from a login node:
    no nvidia-smi, no $SBATCH_*, the hub offline; ``sinfo``: the line a fake sinfo answers with. Refused: its
    output (a run that passes fails the test)."""
    files = []
    for i, c in enumerate(configs):
        if isinstance(c, dict):
            (tmp_path / f"overlay_{i}.yaml").write_text(yaml.safe_dump(c))
            c = tmp_path / f"overlay_{i}.yaml"
        files.append(str(c))
    env = {k: v for k, v in _no_gpu_env().items() if not k.startswith(("SBATCH_", "SLURM_", "EAGLENEST_GPU"))}
    env["HF_HUB_OFFLINE"] = "1"
    if sinfo is not None:
        (tmp_path / "bin").mkdir(exist_ok=True)
        (tmp_path / "bin/sinfo").write_text(f"#!/bin/sh\necho '{sinfo}'\n")
        (tmp_path / "bin/sinfo").chmod(0o755)
        env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
    how = ["--profile", str(ROOT / "profiles/slurm")] if profile else ["--cores", "1"]
    run = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path / "wd"), "-n", *how,
                          "--configfile", *files], capture_output=True, text=True, timeout=300, env=env)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "wd/data").exists() and not (tmp_path / "wd/traces").exists()
    return out


def refused_line(out: str, words) -> str:
    """The one line of ``out`` holding every one of ``words``."""
    lines = [line for line in out.splitlines() if all(w in line for w in words)]
    assert lines, out[-3000:]
    return lines[0]


def review_with_sinfo(cfg: dict, tmp_path: Path, line: str, monkeypatch):
    """review_config of ``cfg`` where a fake sinfo answers ``line``, with no nvidia-smi and the hub offline."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin/sinfo").write_text(f"#!/bin/sh\necho '{line}'\n")
    (tmp_path / "bin/sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{_no_gpu_env()['PATH']}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return review_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path)


def toy(tmp_path, **changes) -> dict:
    """The embedded default as a whole config (absolute paths), with ``changes`` to its sections."""
    return bad_config(tmp_path, {}, changes)


# (name, configs, dry-run options, words of the refusal's line)
TABLE = [
    ("tensor_parallel_above_the_server_jobs_gpus",
     lambda t: [PRESET["llama-3.1-8b-instruct.slurm.yaml"], {"server": {"tensor_parallel_size": 16}}], {},
     ["server.tensor_parallel_size 16 needs 16 GPUs a server", "server.slurm.gpus 1", "set server.slurm.gpus to 16"]),
    ("kimi_server_job_of_4_gpus_at_tensor_parallel_8",
     lambda t: [PRESET["kimi-k2.5-int4.slurm.yaml"], {"server": {"slurm": {"gpus": 4}}}], {},
     ["server.tensor_parallel_size 8 needs 8 GPUs a server", "asks for 4 (server.slurm.gpus 4)"]),
    ("kimi_validation_on_1_gpu_at_tensor_parallel_8",
     lambda t: [PRESET["kimi-k2.5-int4.slurm.yaml"], {"validate": {"gpus": 1}}], {},
     ["validate.gpus 1 is fewer than the 8 GPUs a validation server uses", "set validate.gpus to 8"]),
    ("training_on_16_gpus_of_8_gpu_nodes_by_sinfo",
     lambda t: [PRESET["kimi-k2.5-int4.slurm.yaml"], {"train": {"gpus": 16}}], {"sinfo": H200_NODES},
     ["train.gpus 16 asks for more GPUs than one node has", "at most 8 (sinfo gres gpu:h200:8(S:0-1))",
      "lower train.gpus to fit 8"]),
    ("training_on_16_gpus_of_the_8_gpu_nodes_a_preset_states",
     lambda t: [PRESET["kimi-k2.5-int4.slurm.yaml"], {"train": {"gpus": 16}}], {},
     ["train.gpus 16 asks for more GPUs than one node has", "(server.slurm.node_gpus)"]),
    ("k_above_ttt_length", lambda t: [toy(t, validate={"num_speculative_tokens": 12}, train={"ttt_length": 7})], {},
     ["validate.num_speculative_tokens 12 is more than train.ttt_length 7", "or less"]),
    ("stream_budget_below_one_request_file",
     lambda t: [PRESET["kimi-k2.5-int4.slurm.yaml"], {"hidden": {"stream": {"max_disk_gb": 0.5}}}], {},
     ["hidden.stream.max_disk_gb 0.5 is below", "10,240 tokens x 4 layers x hidden size 7168", "1.17 GB"]),
    ("stream_budget_above_the_free_disk",
     lambda t: [PRESET["kimi-k2.5-int4.slurm.yaml"], {"hidden": {"stream": {"max_disk_gb": 10**6}}}], {},
     ["hidden.stream.max_disk_gb 1e+06 is more than the working directory's disk has free"]),
    ("temperature_5", lambda t: [toy(t, generation={"temperature": 5.0})], {},
     ["generation.temperature: 5.0 is greater than the maximum of 2"]),
    ("slurm_time_sbatch_refuses",
     lambda t: [PRESET["llama-3.1-8b-instruct.slurm.yaml"], {"server": {"slurm": {"time": "2 days"}}}], {},
     ["server.slurm.time '2 days' is not a time sbatch takes", "days-hours:minutes:seconds"]),
    ("the_local_kimi_preset_under_the_slurm_profile", lambda t: [PRESET["kimi-k2.5-int4.yaml"]], {"profile": True},
     ["server.mode: local under the slurm executor", "--configfile", "kimi-k2.5-int4.slurm.yaml"]),
    ("the_h200_kimi_preset_on_an_h100_partition", lambda t: [PRESET["kimi-k2.5-int4.slurm.yaml"]],
     {"sinfo": H100_NODES},
     ["server.slurm.gpu_type H200: this config was sized for H200 GPUs (140.4 GiB each, 8 a server: 1,123 GiB)",
      "partition gpu has H100 (79.6 GiB each, sinfo gres gpu:h100:8(S:0-1)): 8 x 79.6 = 637 GiB"]),
]


@pytest.mark.parametrize("name, configs, options, words", TABLE, ids=[c[0] for c in TABLE])
def test_the_dry_run_refuses_a_setting_that_would_fail_hours_in(name, configs, options, words, tmp_path):
    refused_line(dry_run(tmp_path, *configs(tmp_path), **options), words)


def test_every_failure_is_reported_together(tmp_path):
    """Five wrong settings, one dry-run: each on its own line under one error, with its key, value and fix."""
    wrong = {"server": {"slurm": {"gpus": 4, "time": "2 days"}}, "validate": {"num_speculative_tokens": 12},
             "hidden": {"stream": {"max_disk_gb": 0.5}}, "train": {"gpus": 16}}
    out = dry_run(tmp_path, PRESET["kimi-k2.5-int4.slurm.yaml"], wrong, sinfo=H100_NODES)
    for words in (["server.slurm.gpus 4"], ["server.slurm.time '2 days'"], ["validate.num_speculative_tokens 12"],
                  ["hidden.stream.max_disk_gb 0.5 is below"], ["train.gpus 16 asks for more GPUs"],
                  ["server.slurm.gpu_type H200", "H100"]):
        assert refused_line(out, words).startswith("  - "), words
    assert re.search(r"\): \d+ settings to fix before any job:", out), out[-3000:]


def test_every_schema_violation_is_listed_at_once(tmp_path):
    out = dry_run(tmp_path, toy(tmp_path, generation={"temperature": 5.0, "top_p": 2}, train={"lr": -1}))
    for words in (["generation.temperature: 5.0"], ["generation.top_p: 2"], ["train.lr: -1"]):
        refused_line(out, words)


def test_the_plan_reports_every_failure_too(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(toy(tmp_path, validate={"num_speculative_tokens": 12}, draft={"vocab_size": 200})))
    plan = subprocess.run([sys.executable, "-m", "eaglenest.checks", "--configfile", str(config), "-d", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=_no_gpu_env())
    assert plan.returncode == 1 and "validate.num_speculative_tokens 12" in plan.stderr
    assert "draft.vocab_size 200" in plan.stderr, plan.stderr


def test_a_preset_on_the_gpus_it_was_sized_for_passes_the_gpu_checks(tmp_path, monkeypatch):
    """The Kimi preset on a partition of 8-GPU H200 nodes: no GPU line among the refusals (a small disk may refuse
    its stream budget here) and nothing left unchecked about the GPUs."""
    cfg = validate_config(yaml.safe_load(PRESET["kimi-k2.5-int4.slurm.yaml"].read_text()))
    review = review_with_sinfo(cfg, tmp_path, H200_NODES, monkeypatch)
    assert not [e for e in review.errors if "GPU" in e or "gpus" in e], review.errors
    assert not [n for n in review.skipped if "GPUs a node" in n or "partition's GPU" in n], review.skipped


def test_without_sinfo_what_the_gpus_are_is_said_in_one_line_each(tmp_path, monkeypatch):
    cfg = validate_config(yaml.safe_load(PRESET["llama-3.1-8b-instruct.slurm.yaml"].read_text()))
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo, no nvidia-smi
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    review = review_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path)
    assert any(n.startswith("GPUs a node has not known: sinfo does not answer here") for n in review.skipped)
    assert any("not compared with the H100 GPUs this config was sized for" in n for n in review.skipped)


def test_pipeline_parallel_in_extra_args_counts_in_a_servers_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = validate_config(yaml.safe_load(PRESET["kimi-k2.5-int4.slurm.yaml"].read_text()))
    cfg["server"]["extra_args"] += ["--pipeline-parallel-size", "2"]
    review = review_config(cfg, make_plan(cfg, tmp_path, has_gpu=False), tmp_path)
    line = next(e for e in review.errors if "needs 16 GPUs a server" in e)
    assert "server.tensor_parallel_size 8 x pipeline-parallel 2 (server.extra_args)" in line and "server.slurm.gpus 8" in line


def test_weights_beyond_one_servers_gpus_are_refused_with_the_arithmetic(tmp_path, monkeypatch):
    """Kimi-K2.5's INT4 weights (595 GB by its index) on 4 H200s at a 0.92 share: 4 x 140.4 GiB x 0.92 = 555 GB."""
    model = Path(target(tmp_path, num_attention_heads=64))
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 595 * 10**9}}))
    cfg = validate_config(yaml.safe_load(PRESET["kimi-k2.5-int4.slurm.yaml"].read_text()))
    cfg["server"].update(model=str(model), tensor_parallel_size=4)
    cfg["server"]["slurm"]["gpus"] = 4
    review = review_with_sinfo(cfg, tmp_path, H200_NODES, monkeypatch)
    line = next(e for e in review.errors if e.startswith("the weights of"))
    assert "(595 GB" in line and "4 GPUs of 140.4 GiB (partition gpu's H200)" in line and "= 555 GB" in line, line
    cfg["server"].update(tensor_parallel_size=8)
    cfg["server"]["slurm"]["gpus"] = 8
    assert not [e for e in review_with_sinfo(cfg, tmp_path, H200_NODES, monkeypatch).errors
                if e.startswith("the weights of")]


@pytest.mark.parametrize("value, ok", [("30", True), ("30:00", True), ("24:00:00", True), ("2-0", True),
                                       ("2-12:00", True), ("2-00:00:00", True), (90, True), ("UNLIMITED", True),
                                       ("2 days", False), ("1h", False), ("1:00:00:00", False), ("2-", False), (-5, False)])
def test_the_slurm_times_sbatch_takes(value, ok):
    assert slurm_time_ok(value) is ok


def test_sinfo_gives_each_partitions_node_kinds_and_a_plain_constraint_picks_among_them(tmp_path, monkeypatch):
    lines = ["gpu*|gpu:h100:8(S:0-1)|h100,ib", "gpu*|gpu:a100:4,gpu:v100:2|a100&big", "cpu|(null)|(null)"]
    (tmp_path / "sinfo").write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(f"'{line}'" for line in lines) + "\n")
    (tmp_path / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("EAGLENEST_GPU_PARTITION", raising=False)
    kinds = partition_nodes(SlurmSettings())  # no partition set: sinfo's default, gpu
    assert [(k.gpus, k.gpu_type) for k in kinds] == [(8, "h100"), (4, "a100"), (2, "v100")]
    assert kinds[1].features == ("a100", "big") and partition_nodes(SlurmSettings(partition="cpu"))[0].gpus == 0
    picked = partition_nodes(SlurmSettings(partition="gpu", extra_sbatch_args=["--constraint=a100"]))
    assert [k.gpu_type for k in picked] == ["a100", "v100"]
    assert cluster_partitions() == (["gpu", "cpu"], "gpu")
    assert known_gpu(kinds[0].gpu_type) == ("H100", 79.6) and known_gpu("nvidia_h200") == ("H200", 140.4)
