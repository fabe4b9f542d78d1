"""The presets in configs/ are what they say, and their SLURM variants plan right from a login node.

Each preset is resolved as the workflow resolves it (a dry-run, which writes logs/config.resolved.yaml);
the SLURM variants are dry-run through profiles/slurm with no nvidia-smi on PATH, as on a login node."""
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglenest.config import defaults, load_schema, resolve_shipped_paths, validate_config
from eaglenest.errors import ConfigError
from eaglenest.gguf import is_gguf
from eaglenest.serving.settings import ServerConfig
from eaglenest.serving.port import LAUNCHER
from eaglenest.serving.settings import SlurmSettings
from eaglenest.serving.slurm_jobs import SlurmPaths, batch_script, sbatch_command
from eaglenest.settings import HiddenSettings, lookup
from eaglenest.states.preflight import check_logits_memory, preflight_logits_memory, target_vocab_size

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
THIS_MACHINE = {"smollm2-135m.yaml"}  # runs where it is started, CPU included: no SLURM variant
SLURM_PRESETS = [p for p in PRESETS if p.name.endswith(".slurm.yaml")]
# A GGUF target's config is read by transformers' GGUF loader, which imports torch (states/preflight.py)
GGUF_PRESETS = [p for p in PRESETS if is_gguf(yaml.safe_load(p.read_text())["server"]["model"])]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
# What a SLURM variant may change of its one-node preset
# (in stream mode the extraction server is its own job on its own node: its placement, and its full share)
SLURM_KEYS = ["server.mode", "server.slurm", "hidden.gpus", "hidden.vllm.gpu_memory_gib", "hidden.stream.placement",
              "hidden.vllm.gpu_memory_utilization", "train.gpus", "validate.gpus"]
GPU_RULES = {"extract_hidden": "hidden", "train_draft": "train", "validate_draft": "validate", "curve_point": "validate"}


def _no_gpu_env() -> dict:
    """This environment as a login node has it: no nvidia-smi on PATH, $SBATCH_PARTITION a CPU partition."""
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "EAGLENEST_GPU_PARTITION"))}
    return {**env, "PATH": os.pathsep.join(path), "SBATCH_PARTITION": "cpu", "PYTHONUNBUFFERED": "1"}


def dry_run(workdir: Path, *args, imports: list | None = None) -> str:
    """The dry run's output; ``imports``, a list: filled with the top-level modules the run imported."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = _no_gpu_env() | ({"PYTHONPROFILEIMPORTTIME": "1"} if imports is not None else {})
    assert shutil.which("nvidia-smi", path=env["PATH"]) is None
    out = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(workdir), "-n", *args],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    if imports is not None:  # "import time: self | cumulative | name" lines
        imports += [line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
        out.stderr = "\n".join(line for line in out.stderr.splitlines() if not line.startswith("import time:"))
    return out.stdout + out.stderr


def _leaves(d: dict, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def _get(d: dict, path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return KeyError
        d = d[k]
    return d


SMALL_DISK_BUDGET_GB = 10  # a stream budget (hidden.stream.max_disk_gb) the disk of any test machine holds


def on_this_disk(preset: dict) -> dict:
    """``preset`` with its stream budget lowered to SMALL_DISK_BUDGET_GB where this machine's disk has less free:
    the checks refuse a budget above the free disk before any job (tests/test_checks.py), not what these tests
    are about."""
    budget = preset.get("hidden", {}).get("stream", {}).get("max_disk_gb", defaults("hidden.stream")["max_disk_gb"])
    if preset.get("hidden", {}).get("mode") != "stream" or budget * 1e9 <= shutil.disk_usage(ROOT).free:
        return preset
    return {**preset, "hidden": {**preset["hidden"], "stream": {**preset["hidden"].get("stream", {}),
                                                                "max_disk_gb": SMALL_DISK_BUDGET_GB}}}


def preset_file(path: Path, workdir: Path) -> str:
    """The preset to dry-run: ``path``, or its copy ``on_this_disk`` where that differs."""
    preset = yaml.safe_load(path.read_text())
    if on_this_disk(preset) == preset:
        return str(path)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / path.name).write_text(yaml.safe_dump(on_this_disk(preset)))
    return str(workdir / path.name)


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """{preset name: (config the workflow resolved, dry-run output, the modules it imported)}; SLURM variants
    through the SLURM profile."""
    runs = {}
    for path in PRESETS:
        wd = tmp_path_factory.mktemp(path.stem.replace(".", "_"))
        args = ["--profile", str(ROOT / "profiles/slurm")] if path in SLURM_PRESETS else ["--cores", "1"]
        imports = []
        out = dry_run(wd, "--configfile", preset_file(path, wd / "preset"), *args, imports=imports)
        runs[path.name] = yaml.safe_load((wd / "logs/config.resolved.yaml").read_text()), out, imports
    return runs


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_the_dry_run_prints_the_plan_before_any_job(path, resolved):
    """`snakemake -n` shows what the run will cost (eaglenest.plan; its figures: tests/test_plan.py)."""
    cfg, out, _ = resolved[path.name]
    d = cfg["dataset"]
    counted = (f"{d['generate']['questions'] - d['heldout']:,} (dataset.generate.questions" if d["generate"]["questions"]
               else f"{d['limit']:,} (dataset.limit")
    assert "eaglenest: plan:" in out and counted in out
    assert f"replicas: {cfg['server']['replicas']}" in out and "GPUs, generate_traces:" in out


@pytest.mark.parametrize("path", [p for p in PRESETS if p not in GGUF_PRESETS], ids=lambda p: p.name)
def test_the_dry_run_imports_no_torch(path, resolved):
    """Snakemake parses the Snakefile, prints the plan and runs the checks at every start, SLURM jobs'
    included: none of it needs torch, which would add about a second to each (benchmarks/RESULTS.md,
    "Test suite"). Not for a GGUF target: transformers reads its config (GGUF_PRESETS)."""
    assert GGUF_PRESETS  # the list this test leaves out is made from the presets, not empty by mistake
    imports = resolved[path.name][2]
    assert "eaglenest.plan" in imports and "eaglenest.states.preflight" in imports
    assert "torch" not in imports, "a module the Snakefile imports pulls in torch: import it where a job needs it"


def test_there_are_presets_with_slurm_variants():
    names = {p.name for p in PRESETS}
    assert {"llama-3.1-8b-instruct.yaml", "qwen3-8b-thinking.yaml", "kimi-k2.5-int4.yaml"} <= names
    for p in PRESETS:
        if p.name in THIS_MACHINE:
            continue
        assert p.name.endswith(".slurm.yaml") or p.name.replace(".yaml", ".slurm.yaml") in names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_a_preset_resolves_to_itself_plus_schema_defaults(path, resolved, tmp_path):
    """No key a preset leaves out comes from config.yaml: it is the schema's default."""
    cfg, out, _ = resolved[path.name]
    preset = on_this_disk(yaml.safe_load(path.read_text()))
    expected = validate_config(preset)
    resolve_shipped_paths(expected, tmp_path, ROOT)  # the run's directory, like tmp_path, has no toy/: the checkout's
    assert cfg == expected
    embedded, schema = yaml.safe_load((ROOT / "config.yaml").read_text()), defaults()
    resolve_shipped_paths(schema, tmp_path, ROOT)
    for key, value in _leaves(cfg):
        if _get(preset, key) is KeyError:
            assert value == _get(schema, key), f"{'.'.join(key)} is not the schema's default"
            if _get(embedded, key) not in (KeyError, value):
                assert value != _get(embedded, key)  # the toy's value did not leak in
    assert "logs/config.resolved.yaml" in out


def test_the_embedded_default_and_config_overrides_still_apply(tmp_path):
    (tmp_path / "plain").mkdir()
    shutil.copy(ROOT / "config.yaml", tmp_path / "plain/config.yaml")  # the Snakefile's configfile, in the workdir
    (tmp_path / "plain/toy").symlink_to(ROOT / "toy")  # its dataset and target, which the checks read, as in the repo
    dry_run(tmp_path / "plain", "--cores", "1", "--config", "shards=3")  # no --configfile: config.yaml
    cfg = yaml.safe_load((tmp_path / "plain/logs/config.resolved.yaml").read_text())
    embedded = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert cfg == validate_config({**embedded, "shards": 3})
    preset = ROOT / "configs/qwen3-8b-thinking.yaml"
    dry_run(tmp_path / "preset", "--cores", "1", "--configfile", str(preset), "--config", "shards=3")
    cfg = yaml.safe_load((tmp_path / "preset/logs/config.resolved.yaml").read_text())
    assert cfg == validate_config({**yaml.safe_load(preset.read_text()), "shards": 3})


@pytest.mark.parametrize("path", SLURM_PRESETS, ids=lambda p: p.name)
def test_a_slurm_variant_is_its_preset_but_for_the_slurm_keys(path):
    variant = validate_config(yaml.safe_load(path.read_text()))
    base = validate_config(yaml.safe_load(path.with_name(path.name.replace(".slurm", "")).read_text()))
    assert variant["server"]["mode"] == "slurm" and variant["server"]["slurm"]["partition"]
    # null: $SBATCH_ACCOUNT, and (node_gpus) sinfo's figure alone, for a preset whose jobs fit any GPU node
    assert all(v is not None for k, v in variant["server"]["slurm"].items() if k not in ("account", "node_gpus"))
    for key in SLURM_KEYS:
        section, name = key.rsplit(".", 1)
        assert lookup(variant, key) is not None, f"{key} must be explicit in {path.name}"
        del lookup(variant, section)[name], lookup(base, section)[name]
    assert variant == base


def _dry_run_jobs(out: str) -> list[dict]:
    """[{rule, resources}] of the jobs a dry-run prints."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", out):
        m = re.match(r"(?:local)?rule (\w+):", block)
        res = re.search(r"^\s+resources: (.*)$", block, re.M)
        if m and res:
            jobs.append({"rule": m.group(1), "resources": dict(kv.split("=", 1) for kv in res.group(1).split(", "))})
    return jobs


@pytest.mark.parametrize("path", SLURM_PRESETS, ids=lambda p: p.name)
def test_a_slurm_preset_plans_its_gpus_and_partition_from_a_login_node(path, resolved, tmp_path):
    """No nvidia-smi on PATH and $SBATCH_PARTITION=cpu: every GPU rule still asks for its GPUs in the GPU
    partition, and so does the server's job (and the extraction server's, which shares its settings)."""
    cfg, out, _ = resolved[path.name]
    partition = cfg["server"]["slurm"]["partition"]
    if path.name.startswith("qwen3"):  # backend transformers too: its extract_hidden rule is a GPU rule
        files = tmp_path / "files.yaml"  # files mode (transformers has no stream), with shards this disk holds
        files.write_text(yaml.safe_dump({"hidden": {"backend": "transformers", "mode": "files"}, "dataset": {"limit": 50}}))
        out += dry_run(tmp_path, "--configfile", preset_file(path, tmp_path / "preset"), str(files), "--profile",
                       str(ROOT / "profiles/slurm"))
    jobs = _dry_run_jobs(out)
    planned = {j["rule"] for j in jobs}
    assert {"train_draft", "validate_draft", "server_ready"} <= planned
    for job in jobs:
        if job["rule"] in GPU_RULES:
            section = GPU_RULES[job["rule"]]
            assert int(job["resources"]["gpu"]) == cfg[section]["gpus"] > 0, job
            assert job["resources"]["slurm_partition"] == partition, job
        else:  # CPU jobs stay where $SBATCH_PARTITION sends them, without GPUs
            assert int(job["resources"].get("gpu", 0)) == 0, job
    server = ServerConfig.from_dict(cfg["server"])
    args = sbatch_command(server, SlurmSettings.from_dict(cfg["server"]["slurm"]), SlurmPaths(tmp_path), tmp_path)
    assert f"--partition={partition}" in args and f"--gres=gpu:{cfg['server']['slurm']['gpus']}" in args


# A workflow directory that exists nowhere, so the job's name (a hash of its resolved record directory) is fixed.
PINNED_WORKDIR = Path("/eaglenest-pinned/workdir")


def test_the_server_jobs_batch_script_for_the_default_config_is_this_text():
    """The script sbatch gets on stdin, to the byte: a rerun reuses a job only while this text (in the job's
    settings hash) stays the same. This interpreter and the port launcher's path stand in as PYTHON and LAUNCHER."""
    server = ServerConfig.from_config(validate_config(yaml.safe_load((ROOT / "config.yaml").read_text())))
    script = batch_script(server, SlurmPaths(PINNED_WORKDIR / "logs" / "server"))
    cmd = ("PYTHON -I LAUNCHER --host 0.0.0.0 --want auto --file /eaglenest-pinned/workdir/logs/server/port.json -- "
           "PYTHON -m vllm.entrypoints.openai.api_server --model toy/target --host 0.0.0.0 --tensor-parallel-size 1 "
           "--served-model-name toy --max-model-len 512 --reasoning-parser deepseek_r1 --kv-cache-memory-bytes "
           "1073741824 --dtype float32 --distributed-executor-backend uni --enforce-eager "
           "--middleware eaglenest.serving.guard.RequireApiKey")
    assert script.replace(LAUNCHER, "LAUNCHER").replace(sys.executable, "PYTHON") == (
        "#!/bin/bash\n"
        "# eaglenest generation server (server.mode: slurm). An API key, if any, comes by environment.\n"
        f"echo \"=== $(date '+%F %T') SLURM job $SLURM_JOB_ID on $(hostname): \"'{cmd}'\n"
        f"exec {cmd}\n")


def test_the_kimi_presets_sbatch_call_is_this_argument_list(monkeypatch):
    """sbatch's arguments for configs/kimi-k2.5-int4.slurm.yaml, in order, the job's name included (a rerun
    finds its job by that name); account and extra_sbatch_args come last, as given."""
    monkeypatch.delenv("EAGLENEST_GPU_PARTITION", raising=False)
    cfg = validate_config(yaml.safe_load((ROOT / "configs/kimi-k2.5-int4.slurm.yaml").read_text()))
    server, settings = ServerConfig.from_config(cfg), SlurmSettings.from_dict(cfg["server"]["slurm"])
    paths = SlurmPaths(PINNED_WORKDIR / "logs" / "server")
    args = sbatch_command(server, settings, paths, PINNED_WORKDIR)
    assert args == ["sbatch", "--parsable", "--job-name", "eaglenest-server-b7ceaf4e6d",
                    "--output", "/eaglenest-pinned/workdir/logs/server/vllm.slurm-%j.log", "--open-mode=append",
                    "--chdir", "/eaglenest-pinned/workdir", "--export=ALL", "--nodes=1", "--ntasks=1",
                    "--cpus-per-task=64", "--time=48:00:00", "--gres=gpu:8", "--mem=900G", "--partition=gpu"]
    settings = dataclasses.replace(settings, account="proj", extra_sbatch_args=["--qos=high", "--constraint", "h200"])
    assert sbatch_command(server, settings, paths, PINNED_WORKDIR)[len(args):] == [
        "--account=proj", "--qos=high", "--constraint", "h200"]


def test_server_job_partition_falls_back_to_eaglenest_gpu_partition(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLENEST_GPU_PARTITION", "gpu-env")
    server, paths = ServerConfig(mode="slurm", tensor_parallel_size=2), SlurmPaths(tmp_path)
    assert "--partition=gpu-env" in sbatch_command(server, SlurmSettings(), paths, tmp_path)
    assert "--partition=mine" in sbatch_command(server, SlurmSettings(partition="mine"), paths, tmp_path)
    assert "--gres=gpu:2" in sbatch_command(server, SlurmSettings(), paths, tmp_path)


def test_slurm_mode_without_a_gpu_partition_stops_when_sbatch_partition_would_take_the_gpu_jobs(tmp_path):
    env = _no_gpu_env()
    out = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path), "-n", "--cores", "1",
                          "--configfile", str(ROOT / "configs/qwen3-8b-thinking.yaml"), "--config", "server={mode: slurm}",
                          "hidden={stream: {placement: slurm}}"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0 and "server.slurm.partition" in out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# The extraction server's memory share and the prompt logits

QWEN3 = {"server": {"gpu_memory_utilization": 0.9},
         "hidden": HiddenSettings.defaults().replace(max_length=10240, gpu_memory_utilization=None)}


def test_a_share_that_cannot_hold_the_prompt_logits_is_refused_naming_the_key():
    # 10240 x 151,936 x 6 bytes = 8.7 GiB; 0.9 of an 80 GB GPU (79.6 GiB) leaves 8.0
    with pytest.raises(ConfigError) as e:
        check_logits_memory(QWEN3["server"], QWEN3["hidden"], 151936, 79.6)
    msg = str(e.value)
    assert "server.gpu_memory_utilization=0.9" in msg and "8.7 GiB" in msg and "8.0 GiB" in msg
    assert "set hidden.vllm.gpu_memory_utilization to 0.89 or less" in msg
    ok = check_logits_memory(QWEN3["server"], QWEN3["hidden"].replace(gpu_memory_utilization=0.85), 151936, 79.6)
    assert "hidden.vllm.gpu_memory_utilization=0.85" in ok and "11.9 GiB" in ok


def test_the_workflow_stops_before_any_job_when_the_share_is_too_large(tmp_path):
    # the toy: 512 tokens x 105 x 6 bytes = 0.3 MiB; 0.9 of a 1 MiB "GPU" leaves 0.1 MiB
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["server"]["model"] = str(ROOT / "toy/target")
    cfg["hidden"].update(backend="vllm", max_length=512, vllm={"gpu_memory_utilization": 0.9, "gpu_memory_gib": 1 / 1024})
    (tmp_path / "tight.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path), "-n", "--cores", "1",
                          "--configfile", str(tmp_path / "tight.yaml")],
                         capture_output=True, text=True, timeout=300, env=_no_gpu_env())
    assert out.returncode != 0
    assert "hidden.vllm.gpu_memory_utilization" in out.stdout + out.stderr and "prompt logits" in out.stdout + out.stderr
    assert not (tmp_path / "data").exists()


def test_vocabulary_from_a_local_target_or_the_hf_cache(tmp_path, monkeypatch):
    assert target_vocab_size(str(ROOT / "toy/target")) == 105
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm/config.json").write_text('{"text_config": {"vocab_size": 163840}}')
    assert target_vocab_size(str(tmp_path / "mm")) == 163840
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snap = cache / "models--Org--Model/snapshots/abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"vocab_size": 151936}')
    (cache / "models--Org--Model/refs").mkdir()
    (cache / "models--Org--Model/refs/main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert target_vocab_size("Org/Model") == 151936
    assert target_vocab_size("Org/Absent") is None


def test_the_check_is_skipped_with_a_note_when_gpu_memory_or_vocabulary_is_unknown(monkeypatch):
    monkeypatch.setenv("PATH", _no_gpu_env()["PATH"])
    note = preflight_logits_memory({"model": str(ROOT / "toy/target")},
                                   HiddenSettings.defaults().replace(max_length=512, gpu_memory_gib=None))
    assert note.startswith("extraction memory not checked") and "hidden.vllm.gpu_memory_gib" in note
    note = preflight_logits_memory({"model": "Org/Absent"}, HiddenSettings.defaults().replace(max_length=512, gpu_memory_gib=80))
    assert "vocabulary of Org/Absent" in note


# ---------------------------------------------------------------------------------------------
# The schema


@pytest.mark.parametrize("path", [ROOT / "config.yaml", *PRESETS], ids=lambda p: p.name)
def test_a_regrouped_preset_validates_and_its_flat_form_is_refused_naming_the_new_places(path):
    """The presets are written with hidden's parts (hidden.vllm, .transformers, .stream); the same preset with
    those keys flat under hidden:, as written before, stops naming where each went."""
    preset = yaml.safe_load(path.read_text())
    validate_config(preset, source=str(path))
    parts = {k: v for k, v in preset["hidden"].items() if k in ("vllm", "transformers", "stream")}
    if parts:
        flat = {**{k: v for k, v in preset["hidden"].items() if k not in parts},
                **{k: v for keys in parts.values() for k, v in keys.items()}}
        with pytest.raises(ConfigError) as err:
            validate_config({**preset, "hidden": flat}, source=str(path))
        for part, keys in parts.items():
            for key in keys:
                assert f"hidden.{key} moved to hidden.{part}.{key}" in str(err.value)


def test_every_schema_key_has_a_description():
    missing = []

    def walk(node, path):
        for key, sub in node.get("properties", {}).items():
            if not str(sub.get("description", "")).strip():
                missing.append(".".join((*path, key)))
            walk(sub, (*path, key))

    walk(load_schema(), ())
    assert not missing, f"schemas/config.schema.yaml: no description for {', '.join(missing)}"


def test_validation_that_outgrows_its_slurm_time_stops_the_dry_run_with_the_figures(tmp_path):
    """The Kimi preset's validation (4.7 h at its stated speed) fits the profile's 8 h, not 2 h: refused before
    any job, with the hours and what to lower."""
    args = ["--cores", "1", "--configfile", preset_file(ROOT / "configs/kimi-k2.5-int4.slurm.yaml", tmp_path / "preset")]
    text = dry_run(tmp_path / "fits", *args, "--set-resources", "validate_draft:runtime=8h")
    assert "validation time: about 4.7 h: 4 server starts x 106,496 tokens" in text
    out = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path / "short"), "-n", *args,
                          "--set-resources", "validate_draft:runtime=2h"],
                         capture_output=True, text=True, timeout=300, env=_no_gpu_env())
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "validation needs about 4.7 h (4 server starts x 1.2 h" in text, text[-3000:]
    assert "SLURM time of 2 h" in text and "validate.matrix_prompts" in text
