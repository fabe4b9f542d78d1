"""End to end against a real vLLM serving the toy target: prompts -> server -> traces, with faults.

The traces whose content and staleness the first tests check come from the session's toy server
(conftest.toy_server) in `server.mode: external`; the fault tests start their own local servers (about
half a minute each on 2 cores), and the last rerun of one checks that the workflow stops its server."""
import json
import os
import signal
import time

import pytest
from transformers import AutoTokenizer

from eaglenest.serving.local import LocalPaths, read_pidfile, stop_local
from tests.support.config import TOY_TARGET, write_config
from tests.support.processes import descendants_running
from tests.support.servers import servers_gone
from tests.support.workflow import (assert_traces_complete, finished_before, prompt_ids, read_lines, run_snakemake,
                                    start_workflow, wait_partial)

pytestmark = pytest.mark.vllm
TRACES = ["traces/shard_0.jsonl", "traces/shard_1.jsonl"]


@pytest.fixture(scope="module")
def traced(toy_server, tmp_path_factory):
    server, _ = toy_server
    wd = tmp_path_factory.mktemp("wf")
    cfg = write_config(wd, server={"mode": "external", "urls": [server.url_at(server.port)], "port": server.port})
    t0 = time.monotonic()
    run_snakemake(wd, "server.stopped")
    return wd, cfg, time.monotonic() - t0


def test_traces_hold_reasoning_content_and_exact_tokens(traced):
    wd, cfg, _ = traced
    tok = AutoTokenizer.from_pretrained(TOY_TARGET)
    records = [r for p in TRACES for r in read_lines(wd / p)]
    assert sorted(r["id"] for r in records) == prompt_ids(wd, 2)
    assert len(records) == 48
    for r in records:
        assert r["reasoning"] and r["content"], r
        assert r["prompt_token_ids"] and r["completion_token_ids"]
        # Token-exact: the prompt ids are the chat template's, the completion decodes to the answer.
        assert r["prompt_token_ids"] == tok.apply_chat_template(r["messages"], add_generation_prompt=True,
                                                                tokenize=True, return_dict=False)
        text = tok.decode(r["completion_token_ids"], skip_special_tokens=True)
        assert r["reasoning"].strip() in text and r["content"].strip() in text
        assert r["finish_reason"] in ("stop", "length") and r["truncated"] == (r["finish_reason"] == "length")
        assert r["server"].endswith(str(cfg["server"]["port"]))
    stats = json.loads((wd / "traces/shard_0.stats.json").read_text())
    assert stats["requests"] == len(read_lines(wd / TRACES[0])) and stats["errors"] == 0


def test_rerun_after_success_does_nothing(traced):
    wd, _, _ = traced
    out = run_snakemake(wd, "server.stopped", "-n")
    assert "Nothing to be done" in out.stdout + out.stderr


def _planned_jobs(out):
    """Rule names in the last 'Job stats' table of a dry run."""
    import re
    text = out.stdout + out.stderr
    if "Job stats:" not in text:
        return set()
    table = text.rsplit("Job stats:", 1)[1].split("total")[0]
    return set(re.findall(r"^(\w+)\s+\d+\s*$", table, re.M))


def test_changing_max_tokens_reruns_only_traces(traced):
    wd, cfg, _ = traced
    (wd / "other.yaml").write_text(json.dumps({"generation": {**cfg["generation"], "max_tokens": 128}}))
    out = run_snakemake(wd, "server.stopped", "-n", "--configfile", str(wd / "config.yaml"), str(wd / "other.yaml"))
    assert _planned_jobs(out) == {"server_ready", "generate_traces", "stop_server"}


def test_changing_concurrency_reruns_nothing(traced):
    wd, cfg, _ = traced
    (wd / "other.yaml").write_text(json.dumps({"generation": {**cfg["generation"], "concurrency": 3}}))
    out = run_snakemake(wd, "server.stopped", "-n", "--configfile", str(wd / "config.yaml"), str(wd / "other.yaml"))
    assert "Nothing to be done" in out.stdout + out.stderr


def test_changing_limit_reruns_prompts_and_traces(traced):
    wd, cfg, _ = traced
    (wd / "other.yaml").write_text(json.dumps({"dataset": {**cfg["dataset"], "limit": 60}}))
    out = run_snakemake(wd, "server.stopped", "-n", "--configfile", str(wd / "config.yaml"), str(wd / "other.yaml"))
    assert _planned_jobs(out) == {"prepare_prompts", "server_ready", "generate_traces", "stop_server"}


# The fault tests' shard: enough questions that a fault lands mid-shard after the first 20 answers.
FAULT_PROMPTS = 48


def test_kill_9_mid_shard_then_rerun_loses_and_duplicates_nothing(tmp_path):
    wd = tmp_path / "kill"
    write_config(wd, dataset={"limit": FAULT_PROMPTS, "heldout": 0}, shards=1, server={"keep_server": True},
                 generation={"concurrency": 4})
    try:
        proc = start_workflow(wd, "traces/shard_0.jsonl")
        partial = wait_partial(wd, 20, proc)
        server_pid = read_pidfile(LocalPaths(wd / "logs/server"))["pid"]
        jobs = descendants_running(proc.pid, "generate_traces.py")  # this test's job only
        assert jobs, "the generate_traces job of this workflow is running"
        for pid in jobs:
            os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
        before = finished_before(partial)
        assert 20 <= len(before) < FAULT_PROMPTS
        assert not (wd / "traces/shard_0.jsonl").exists()
        run_snakemake(wd, "traces/shard_0.jsonl")
        # keep_server: the rerun used the server that was still up instead of starting another.
        assert read_pidfile(LocalPaths(wd / "logs/server"))["pid"] == server_pid
        assert (wd / "logs/server/vllm.log").read_text().count("=== ") == 1
        assert_traces_complete(wd, before)
        stats = json.loads((wd / "traces/shard_0.stats.json").read_text())
        assert stats["resumed"] == len(before)
    finally:
        stop_local(LocalPaths(wd / "logs/server"))


def test_server_death_mid_shard_fails_clearly_and_rerun_completes_then_stops_its_server(tmp_path):
    wd = tmp_path / "dies"
    write_config(wd, dataset={"limit": FAULT_PROMPTS, "heldout": 0}, shards=1,
                       generation={"concurrency": 4, "max_retries": 2})
    try:
        proc = start_workflow(wd, "traces/shard_0.jsonl")
        partial = wait_partial(wd, 20, proc)
        record = read_pidfile(LocalPaths(wd / "logs/server"))
        os.killpg(record["pgid"], signal.SIGKILL)
        assert proc.wait(timeout=600) != 0
        log = (wd / "logs/generate_traces/shard_0.log").read_text()
        assert "stopped answering" in log or "connection" in log.lower(), log[-2000:]
        before = finished_before(partial)
        assert len(before) >= 20
        run_snakemake(wd, "traces/shard_0.jsonl")
        assert_traces_complete(wd, before)
        # The rerun's server (a local one, not kept) is stopped once the workflow is done.
        assert not (wd / "server.ready").exists()
        assert read_pidfile(LocalPaths(wd / "logs/server")) is None
        assert "server ready" in (wd / "logs/server_ready.log").read_text()
        servers_gone(wd)
    finally:
        stop_local(LocalPaths(wd / "logs/server"))


def test_server_that_never_becomes_ready_fails_within_timeout_with_log_tail(tmp_path):
    wd = tmp_path / "slow"
    write_config(wd, server={"ready_timeout": 5})
    t0 = time.monotonic()
    out = run_snakemake(wd, "traces/shard_0.jsonl", check=False, timeout=300)
    assert out.returncode != 0
    assert time.monotonic() - t0 < 90
    log = (wd / "logs/server_ready.log").read_text()
    assert "did not serve 'toy' within server.ready_timeout=5 s" in log
    assert "Last lines of" in log
    record = read_pidfile(LocalPaths(wd / "logs/server"))
    assert record is None, "the server that never became ready was stopped"
