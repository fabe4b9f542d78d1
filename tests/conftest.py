"""The suite's hooks and shared fixtures: how xdist's processes split the tests (tests/support/scheduling.py)
and the costly things tests share (a whole workflow run, the vLLM-backend run, the SLURM cluster, the toy
server, a tiny target's files). Helpers live in tests/support/."""
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.support.config import VLLM_BACKEND_RUN, default_config, write_config
from tests.support.drafts import toy_states as make_toy_states
from tests.support.drafts import train_toy_dflash
from tests.support.measure import train_on_run
from tests.support.scheduling import (UNITS_KEY, make_scheduler, pin_share, schedule_order, schedule_units,
                                      shared_run, write_units)
from tests.support.servers import server_gone, start_toy_server
from tests.support.slurm import script_values, slurm_command, slurm_script
from tests.support.tiny_target import fake_traces, tiny_target
from tests.support.workflow import copy_traces, rules_run, run_snakemake

# ----------------------------------------------------------------------------- two test processes (pytest-xdist)

_UNITS_DIR = pytest.StashKey[Path]()


def _units_dir(config) -> Path:
    """The controller's directory for the test processes' units files, made at its first use."""
    if _UNITS_DIR not in config.stash:
        config.stash[_UNITS_DIR] = Path(tempfile.mkdtemp(prefix="eaglenest-units-"))
    return config.stash[_UNITS_DIR]


def pytest_configure(config):
    pin_share()


def pytest_unconfigure(config):
    if _UNITS_DIR in config.stash:
        shutil.rmtree(config.stash[_UNITS_DIR], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput[UNITS_KEY] = str(_units_dir(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return make_scheduler(config, log, _units_dir(config))


def pytest_collection_modifyitems(config, items):
    units = schedule_units(items)
    schedule_order(items, units)
    workerinput = getattr(config, "workerinput", {})
    if UNITS_KEY in workerinput:
        write_units(workerinput[UNITS_KEY], workerinput["workerid"], units)


# ----------------------------------------------------------------------------- the shared runs, longest first

@pytest.fixture(scope="session")
@shared_run
def default_run(tmp_path_factory, toy_dflash):
    """The default workflow (config.yaml, made portable) run to the end, the suite's most expensive run:
    (wd, cfg, its validation report). Its validation serves two drafts of the other kinds beside its own
    (validate.drafts, added to its config.yaml once its states are made): ``peagle``, trained on its states
    with draft.kind peagle (its training settings), and ``dflash``, the toy's DFlash draft (``toy_dflash``):
    one vLLM start each, the starts the tests that served them alone made. EAGLENEST_DEFAULT_RUN: a
    directory of an earlier run of this fixture to finish or reuse (Snakemake redoes only what is stale
    there), for working on the assertions without a fresh run."""
    reuse = os.environ.get("EAGLENEST_DEFAULT_RUN")
    wd = Path(reuse) if reuse else tmp_path_factory.mktemp("default")
    if not (wd / "config.yaml").exists():
        (wd / "config.yaml").write_text(yaml.safe_dump(default_config()))
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    t0 = time.monotonic()
    run_snakemake(wd, "draft/checkpoint", timeout=3600)
    if not (wd / "peagle/draft/config.json").exists():  # kept on reuse: a new one would rerun the validation
        train_on_run(wd, cfg, wd / "peagle", kind="peagle")
    if not (wd / "dflash/config.json").exists():
        shutil.copytree(toy_dflash / "export", wd / "dflash")
    cfg.setdefault("validate", {})["drafts"] = [{"name": "peagle", "path": str(wd / "peagle/draft")},
                                                {"name": "dflash", "path": str(wd / "dflash")}]
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg))
    run_snakemake(wd, timeout=3600)
    seconds = time.monotonic() - t0
    (wd / "wall_seconds.txt").write_text(f"{seconds:.0f}\n")
    print(f"default workflow: {seconds:.0f} s in {wd}")
    return wd, cfg, json.loads((wd / "reports/validation.json").read_text())


@pytest.fixture(scope="session")
@shared_run
def vllm_backend_run(tmp_path_factory):
    """The workflow with `hidden.backend: vllm` in files mode up to draft/checkpoint (trace server,
    extraction server, one shard, training, export): (wd, cfg). Tests compare another way of getting
    the hidden states with it, check its extraction or train from its files; they copy its prompts and
    traces and write nothing into it but the measurement's logs."""
    wd = tmp_path_factory.mktemp("vllm_backend")
    cfg = write_config(wd, **VLLM_BACKEND_RUN)
    run_snakemake(wd, "draft/checkpoint", timeout=1500)
    return wd, cfg


@pytest.fixture(scope="session")
def transformers_backend_run(vllm_backend_run, tmp_path_factory):
    """The same run with `hidden.backend: transformers` on the vLLM-backend run's prompts and traces
    (copied: only the hidden states differ), up to draft/checkpoint; starts no server: (wd, cfg).
    Its users share the vLLM-backend run's process, as they request that run through this fixture."""
    wd_v, cfg_v = vllm_backend_run
    wd = tmp_path_factory.mktemp("transformers_backend")
    cfg = write_config(wd, **{**VLLM_BACKEND_RUN, "hidden": {"backend": "transformers", "dtype": "float32"}})
    copy_traces(wd_v, wd)
    out = run_snakemake(wd, "draft/checkpoint", timeout=1200)
    assert "generate_traces" not in rules_run(out), "the copied traces were used as they are"
    return wd, cfg


@pytest.fixture(scope="session")
@shared_run
def slurm_cluster():
    """The tests' private one-node SLURM cluster (ci/slurm.sh): its SLURM_CONF path. The session's
    environment gets SLURM_CONF, so every SLURM command of the tests and of what they start (eaglenest,
    Snakemake's SLURM executor, the jobs) talks to it and never to a system cluster. Skips with the
    reason where this machine cannot run it (not root, no slurm-wlm); fails where it should start and
    does not. Stopped at the end if this session started it; one already running is reused and left up."""
    out = slurm_script("up")
    if out.returncode == 77:
        pytest.skip(out.stderr.strip().splitlines()[-1])
    if out.returncode != 0:
        pytest.fail(f"the tests' SLURM cluster did not start (ci/slurm.sh up, exit {out.returncode}):\n{out.stderr[-6000:]}")
    values = script_values(out)
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = values["SLURM_CONF"]
    try:
        yield values["SLURM_CONF"]
    finally:
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        if values.get("STARTED") == "yes":
            slurm_script("down")


@pytest.fixture
def cluster(slurm_cluster):
    """A list a test appends its SLURM job names to before it submits: every job of those names is
    cancelled when the test ends, passed or failed (scancel --name matches whole names)."""
    submitted = []
    yield submitted
    for name in submitted:
        slurm_command(["scancel", "--me", "--name", name])


# ----------------------------------------------------------------------------- once a process

@pytest.fixture(scope="session")
def toy_server(tmp_path_factory):
    """One toy server for the tests that only send it requests or point a workflow at it in
    `server.mode: external` (which never stops it): (ServerConfig, pidfile record). Tests that kill,
    fault or key a server start their own. Stopped at the end of the session, and checked gone."""
    from eaglenest.serving.local import LocalPaths, stop_local

    log_dir = tmp_path_factory.mktemp("toy_server")
    cfg, record = start_toy_server(log_dir)
    yield cfg, record
    stop_local(LocalPaths(log_dir))
    server_gone(cfg.port, pgids=[record["pgid"]])


@pytest.fixture(scope="session")
def toy_states(tmp_path_factory):
    """The toy's own greedy answers, their hidden states and a draft vocabulary, made without a server
    (tests/support/drafts.py): the DFlash tests train on them."""
    return make_toy_states(tmp_path_factory.mktemp("dflash_toy"))


@pytest.fixture(scope="session")
def toy_dflash(toy_states, tmp_path_factory):
    """A DFlash draft trained on ``toy_states`` and exported (``export/``): its directory."""
    return train_toy_dflash(toy_states, tmp_path_factory.mktemp("dflash_trained"))


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """Traces -> hidden shard + target head + vocab of a tiny random target, for the training, export,
    report and DDP tests (no server, no Snakemake). Tests read these files and write only under their
    own directories."""
    from eaglenest.draft.vocab import build_vocab
    from eaglenest.settings import DraftSettings, HiddenSettings
    from eaglenest.states.hidden import extract_hidden
    from eaglenest.states.target import save_target_head

    root = tmp_path_factory.mktemp("pipeline")
    target = tiny_target(root / "target")
    traces = fake_traces(root / "traces.jsonl", n=24)
    extract_hidden(traces, root / "hidden" / "shard_0.safetensors", HiddenSettings.defaults().replace(target=target, max_length=48), progress=False)
    save_target_head(root / "hidden" / "target_head.safetensors", HiddenSettings.defaults().replace(target=target))
    build_vocab(traces, root / "vocab.safetensors", 100, DraftSettings.defaults().replace(vocab_size=40))
    return {
        "hidden_paths": [root / "hidden" / "shard_0.safetensors"],
        "vocab_path": root / "vocab.safetensors",
        "head_path": root / "hidden" / "target_head.safetensors",
    }
