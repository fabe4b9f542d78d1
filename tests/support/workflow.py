"""The workflow run on a test's directory: Snakemake in the foreground or in the background (a test
that interrupts it), what it ran, and the files a run leaves (prompts, traces)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.config import ROOT


def snakemake_cmd(workdir: Path, *args) -> list[str]:
    return [str(Path(sys.executable).parent / "snakemake"), "-s", str(ROOT / "Snakefile"), "-d", str(workdir),
            "--cores", "2", *args]


def run_snakemake(workdir: Path, *args, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(snakemake_cmd(workdir, *args), capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if check and out.returncode != 0:
        pytest.fail(f"snakemake {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}")
    return out


def rules_run(out: subprocess.CompletedProcess) -> set[str]:
    """The rules of the jobs a Snakemake run (or dry run) printed ("rule X:" / "localrule X:"), not
    the other lines that name rules (the plan's, for one)."""
    return set(re.findall(r"^(?:local)?rule (\w+):$", out.stdout + out.stderr, re.M))


def _default_sigint():
    # A shell that starts a command in the background (`make test &`, CI runners) starts it with SIGINT
    # ignored, and every process below inherits that: Ctrl-C would then reach a Snakemake that ignores
    # it. A user's terminal leaves SIGINT at its default; so does this, for the workflows the tests start.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_workflow(wd, *args) -> subprocess.Popen:
    """Snakemake on `wd` in the background, in its own session, with SIGINT at its default (as in a terminal)."""
    return subprocess.Popen(snakemake_cmd(wd, *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_default_sigint)


def read_lines(path) -> list[dict]:
    """The records of a JSON-lines file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def prompt_ids(wd, shards) -> list[str]:
    """The sorted prompt ids of the first `shards` prompt shards of the run in `wd`."""
    return sorted(r["id"] for i in range(shards) for r in read_lines(wd / f"data/prompts/shard_{i}.jsonl"))


def wait_partial(wd, n, proc, timeout=600):
    """The partial trace file of shard 0 once it holds `n` records (fails if `proc` ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parts = list((wd / "traces/partial").glob("shard_0*.jsonl")) if (wd / "traces/partial").exists() else []
        if parts and parts[0].read_text().count("\n") >= n:
            return parts[0]
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    pytest.fail("no partial records appeared")


def finished_before(partial):
    """The complete records of a partial trace file (its last line may be cut)."""
    return [l for l in partial.read_text().split("\n")[:-1] if l.strip()]


def assert_traces_complete(wd, before_lines):
    """Shard 0 answers every prompt exactly once and keeps each record finished before a crash as it was."""
    final = (wd / "traces/shard_0.jsonl").read_text().splitlines()
    ids = [json.loads(l)["id"] for l in final]
    assert sorted(ids) == prompt_ids(wd, 1), "every prompt answered exactly once"
    by_id = {json.loads(l)["id"]: json.loads(l) for l in final}
    for line in before_lines:
        rec = json.loads(line)
        assert by_id[rec["id"]] == rec, "a record finished before the crash is kept as it was"


def copy_traces(src: Path, dst: Path) -> None:
    """`src`'s prompts and traces (mtimes kept, with its server.stopped) into `dst`: nothing upstream
    of the hidden states reruns there."""
    for part in ("data", "traces"):
        shutil.copytree(src / part, dst / part)
    shutil.copy2(src / "server.stopped", dst / "server.stopped")
