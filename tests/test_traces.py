"""generate_traces against the stub server (tests/stub_server.py): faults the real server cannot
be made to produce on demand. The end-to-end tests against a real vLLM server live elsewhere."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eaglenest.data.traces import TracesError, answers_key, generate_shard
from eaglenest.serving.probe import describe_os_error, probe
from eaglenest.settings import GenerationSettings
from tests.stub_server import MODEL, StubServer
from tests.support.servers import free_port

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
FAST = {"backoff_base": 0.01, "backoff_max": 0.05, "concurrency": 16}


def settings(generation=FAST, model=MODEL):
    """The GenerationSettings of ``generation``'s keys over the schema's defaults."""
    return GenerationSettings.defaults().replace(model=model, **generation)
STUB_SCRIPT = str(Path(__file__).parent / "stub_server.py")


def write_shard(path, n, tag=lambda i: ""):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{i:08x}", "source": "test", "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"question {i}{tag(i)}"}]}) + "\n")
    return path


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def generate(tmp_path, urls, n=None, shard=None, **kw):
    shard = shard or tmp_path / "prompts.jsonl"
    if n is not None:
        write_shard(shard, n)
    kw.setdefault("progress", False)
    return generate_shard(shard, tmp_path / "traces" / "shard_0.jsonl", settings(kw.pop("generation", FAST)), urls=urls,
                          **kw)


def partial_files(tmp_path):
    return sorted((tmp_path / "traces" / "partial").glob("*.partial.jsonl"))


def unfinished_partials(tmp_path):
    """Partial files other than the finished shard's, which stays as a hard link to the output."""
    out = tmp_path / "traces" / "shard_0.jsonl"
    return [p for p in partial_files(tmp_path) if not (out.exists() and p.samefile(out))]


@pytest.fixture
def stub():
    with StubServer() as s:
        yield s


def start_stub_process(*args):
    proc = subprocess.Popen([sys.executable, STUB_SCRIPT, "--port", "0", *args], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("LISTENING "), line
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


def stop_stub_process(proc):
    proc.kill()
    proc.wait()
    proc.stdout.close()


# -- the happy path -------------------------------------------------------------------------------


def test_stats_table_holds_what_each_shards_stats_json_says(tmp_path, stub):
    import pandas as pd

    from eaglenest.data.traces import write_stats_table

    generate(tmp_path, [stub.url], n=12)
    stats_json = tmp_path / "traces" / "shard_0.stats.json"
    second = tmp_path / "traces" / "shard_1.stats.json"
    second.write_text(json.dumps({**json.loads(stats_json.read_text()), "shard": "shard_1"}))
    write_stats_table([stats_json, second], tmp_path / "traces" / "stats.csv")
    table = pd.read_csv(tmp_path / "traces" / "stats.csv")
    assert list(table["shard"]) == ["shard_0", "shard_1"]
    expected = pd.json_normalize(json.loads(stats_json.read_text()))
    for column in expected.columns:
        value = expected[column][0]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert table[column].tolist() == pytest.approx([value, value]), column


def test_records_are_complete_token_exact_and_in_prompt_order(tmp_path, stub, capsys):
    stats = generate(tmp_path, [stub.url], n=30)
    out = tmp_path / "traces" / "shard_0.jsonl"
    records = read_jsonl(out)
    assert [r["id"] for r in records] == [f"{i:08x}" for i in range(30)]
    r = records[7]
    assert list(r) == ["id", "source", "messages", "reasoning", "content", "finish_reason", "truncated",
                       "prompt_token_ids", "completion_token_ids", "usage", "latency_s", "server", "attempts"]
    assert r["source"] == "test" and r["messages"][1]["content"] == "question 7"
    assert r["reasoning"].startswith("Think about 'question 7'") and r["content"] == "Answer to 'question 7': 10."
    assert r["finish_reason"] == "stop" and r["truncated"] is False
    # the stub's tokens are code points: the ids are exactly the text
    assert "".join(map(chr, r["completion_token_ids"])) == f"<think>{r['reasoning']}</think>{r['content']}"
    assert "".join(map(chr, r["prompt_token_ids"])).endswith("question 7<|assistant|>")
    assert r["usage"]["completion_tokens"] == len(r["completion_token_ids"])
    assert r["server"] == stub.url and r["attempts"] == 1 and r["latency_s"] >= 0
    # request: the answer settings, return_token_ids, pass-throughs
    assert stub.last_body["return_token_ids"] is True and stub.last_body["max_tokens"] == 8192
    assert stub.last_body["temperature"] == 0.0 and stub.last_body["seed"] == 0
    # stats, side files, no partial left, summary line
    assert stats["requests"] == stats["completed"] == stats["records"] == 30
    assert stats["errors"] == stats["retries"] == stats["resumed"] == stats["truncated"] == 0
    assert stats["completion_tokens"] == sum(len(r["completion_token_ids"]) for r in records)
    assert stats["fingerprint"] == answers_key(settings()) and stats["urls"] == [stub.url]
    assert json.loads((tmp_path / "traces" / "shard_0.stats.json").read_text()) == stats
    assert (tmp_path / "traces" / "shard_0.errors.jsonl").read_text() == ""
    assert unfinished_partials(tmp_path) == [] and len(partial_files(tmp_path)) == 1
    assert "shard_0: 30 answers (0 truncated, 0 errors, 0 retries)" in capsys.readouterr().err


def test_pass_through_settings_and_api_key(tmp_path, stub):
    gen = dict(FAST, max_tokens=100, temperature=0.6, top_p=0.95, seed=7,
               chat_template_kwargs={"enable_thinking": True}, extra_body={"top_k": 20})
    generate(tmp_path, [stub.url + "/v1/"], n=3, generation=gen, api_key="sk-secret-123")
    body = stub.last_body
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["seed"], body["top_k"]) == (100, 0.6, 0.95, 7, 20)
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["return_token_ids"] is True
    assert stub.authorizations == {"Bearer sk-secret-123"}
    for path in (tmp_path / "traces").rglob("*"):
        if path.is_file():
            assert "sk-secret-123" not in path.read_text()
    assert read_jsonl(tmp_path / "traces" / "shard_0.jsonl")[0]["server"] == stub.url  # base URL, no /v1


def test_reasoning_content_fallback_missing_reasoning_and_truncation(tmp_path):
    with StubServer(reasoning_field="reasoning_content") as s:
        generate(tmp_path, [s.url], n=3)
    assert all(r["reasoning"].startswith("Think about") for r in read_jsonl(tmp_path / "traces" / "shard_0.jsonl"))
    with StubServer(reasoning_field=None) as s:
        stats = generate(tmp_path, [s.url], n=3, generation=dict(FAST, max_tokens=12))
    records = read_jsonl(tmp_path / "traces" / "shard_0.jsonl")
    assert all(r["reasoning"] is None and r["truncated"] and r["finish_reason"] == "length" for r in records)
    assert all(len(r["completion_token_ids"]) == 12 for r in records)
    assert stats["truncated"] == stats["no_reasoning"] == stats["empty_content"] == 3


# -- failures -------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 503])
def test_retryable_statuses_are_retried_and_counted(tmp_path, status):
    with StubServer(fail_times=2, fail_status=status, fail_match="question 1", retry_after="0") as s:
        stats = generate(tmp_path, [s.url], n=20)  # questions 1 and 10..19 fail twice each
    records = {r["id"]: r for r in read_jsonl(tmp_path / "traces" / "shard_0.jsonl")}
    assert len(records) == 20 and stats["errors"] == 0
    assert stats["retries"] == 2 * 11
    assert records[f"{1:08x}"]["attempts"] == 3 and records[f"{2:08x}"]["attempts"] == 1


def test_retries_exhausted_count_as_errors(tmp_path):
    write_shard(tmp_path / "prompts.jsonl", 60, tag=lambda i: " FLAKY" if i == 3 else "")
    with StubServer(fail_times=100, fail_match="FLAKY") as s:
        stats = generate(tmp_path, [s.url], generation=dict(FAST, max_retries=2))
    assert stats["errors"] == 1 and stats["retries"] == 2
    (error,) = read_jsonl(tmp_path / "traces" / "shard_0.errors.jsonl")
    assert error["id"] == f"{3:08x}" and error["status"] == 503 and "gave up after 3 attempts" in error["body"]


def test_client_errors_go_to_the_errors_file_without_retry(tmp_path):
    write_shard(tmp_path / "prompts.jsonl", 60, tag=lambda i: " TOO_LONG" if i == 5 else "")
    with StubServer(reject_match="TOO_LONG") as s:
        stats = generate(tmp_path, [s.url])
        assert s.per_prompt["Be brief.question 5 TOO_LONG"] == 1
    assert stats["errors"] == 1 and stats["retries"] == 0 and stats["completed"] == 59
    (error,) = read_jsonl(tmp_path / "traces" / "shard_0.errors.jsonl")
    assert error["id"] == f"{5:08x}" and error["status"] == 400 and error["server"] == s.url
    assert "maximum context length" in error["body"]
    ids = [r["id"] for r in read_jsonl(tmp_path / "traces" / "shard_0.jsonl")]
    assert len(ids) == 59 and f"{5:08x}" not in ids


def test_too_many_errors_fail_the_shard_and_keep_finished_records(tmp_path):
    write_shard(tmp_path / "prompts.jsonl", 40, tag=lambda i: " TOO_LONG" if i % 4 == 3 else "")
    with StubServer(reject_match="TOO_LONG") as s:
        with pytest.raises(TracesError) as e:
            generate(tmp_path, [s.url], generation=dict(FAST, concurrency=1))
    msg = str(e.value)
    assert "shard_0" in msg and "HTTP 400" in msg and "shard_0.errors.jsonl" in msg and "rerun" in msg
    out = tmp_path / "traces" / "shard_0.jsonl"
    assert not out.exists()
    (partial,) = partial_files(tmp_path)
    finished = read_jsonl(partial)
    assert finished and all(not r["messages"][1]["content"].endswith("TOO_LONG") for r in finished)
    stats = json.loads((tmp_path / "traces" / "shard_0.stats.json").read_text())
    assert stats["complete"] is False and stats["errors"] == 1  # sending stopped at the first error
    # the cause is fixed: the rerun resumes the finished records and retries the failed ones
    with StubServer() as s:
        stats = generate(tmp_path, [s.url])
    assert stats["resumed"] == len(finished) and stats["completed"] == 40 - len(finished)
    assert len(read_jsonl(out)) == 40 and unfinished_partials(tmp_path) == []


def test_answers_without_token_ids_are_refused(tmp_path):
    with StubServer(token_ids=False) as s:
        with pytest.raises(TracesError, match="return_token_ids") as e:
            generate(tmp_path, [s.url], n=5)
    assert s.url in str(e.value)
    assert not (tmp_path / "traces" / "shard_0.jsonl").exists()


def test_the_servers_are_rechecked_before_the_shard_starts(tmp_path):
    with StubServer(api_key="right") as s:
        with pytest.raises(TracesError, match="HTTP 401 \\(refused: the API key sent is not the server's.*server.api_key_env"):
            generate(tmp_path, [s.url], n=5, api_key="wrong")
        with pytest.raises(TracesError, match="HTTP 401 \\(refused: no API key was sent.*server.api_key_env"):
            generate(tmp_path, [s.url], n=5)
        with pytest.raises(TracesError, match=f"server at {s.url} serves \\['stub-model'\\], not 'other'"):
            generate_shard(tmp_path / "prompts.jsonl", tmp_path / "out.jsonl", settings(model="other"), urls=[s.url],
                           api_key="right", progress=False)
        assert s.requests == 0
        assert generate(tmp_path, [s.url], api_key="right")["completed"] == 5


def test_answers_key_covers_the_answer_settings_only():
    base = answers_key(settings({}))
    assert answers_key(settings({"temperature": 0, "seed": 0, "concurrency": 7, "max_retries": 1})) == base
    assert answers_key(settings({"max_turns": 9, "max_context_tokens": 100})) == base  # single questions
    for change in ({"temperature": 0.6}, {"max_tokens": 10}, {"top_p": 0.9}, {"seed": 1},
                   {"chat_template_kwargs": {"enable_thinking": False}}, {"extra_body": {"top_k": 5}}):
        assert answers_key(settings(change)) != base, change
    assert answers_key(settings({}, model="other")) != base
    conversations = answers_key(settings({}), conversations=True)
    assert conversations != base and answers_key(settings({"max_turns": 9}), conversations=True) != conversations


# -- crash safety ---------------------------------------------------------------------------------

CLIENT = """
import sys
from eaglenest.data.traces import generate_shard
from eaglenest.settings import GenerationSettings
generate_shard(sys.argv[1], sys.argv[2], GenerationSettings.defaults().replace(model="stub-model", concurrency=4),
               urls=[sys.argv[3]], progress=False)
"""


def test_kill_9_mid_shard_then_rerun_loses_and_duplicates_nothing(tmp_path):
    prompts = write_shard(tmp_path / "prompts.jsonl", 120)
    out = tmp_path / "traces" / "shard_0.jsonl"
    finished = []  # complete partial lines after each kill
    with StubServer(delay=0.1) as s:
        for kill_at in (12, 30):  # killed twice: the second run resumes, then dies too
            client = subprocess.Popen([sys.executable, "-c", CLIENT, str(prompts), str(out), s.url], cwd=REPO,
                                      env={**os.environ, "PYTHONPATH": str(REPO)})
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                parts = partial_files(tmp_path)
                if parts and parts[0].read_bytes().count(b"\n") >= kill_at:
                    break
                time.sleep(0.01)
            client.send_signal(signal.SIGKILL)
            client.wait()
            assert client.returncode == -signal.SIGKILL and not out.exists()
            (partial,) = partial_files(tmp_path)
            lines = [x for x in partial.read_bytes().splitlines(keepends=True) if x.endswith(b"\n")]
            assert kill_at <= len(lines) < 120
            assert lines[: len(finished)] == finished  # the rerun kept what the killed run finished
            finished = lines
        s.delay = 0
        stats = generate(tmp_path, [s.url], shard=prompts)
    assert stats["resumed"] == len(finished) and stats["completed"] == 120 - len(finished)
    lines = out.read_bytes().splitlines(keepends=True)
    assert [json.loads(x)["id"] for x in lines] == [f"{i:08x}" for i in range(120)]
    assert set(finished) <= set(lines)  # finished before a kill: kept byte for byte, not regenerated


def test_dead_server_fails_clearly_then_torn_line_is_dropped_on_rerun(tmp_path):
    prompts = write_shard(tmp_path / "prompts.jsonl", 40)
    proc, url = start_stub_process("--die-after", "10")
    try:
        with pytest.raises(TracesError) as e:
            generate(tmp_path, [url], shard=prompts, generation=dict(FAST, concurrency=1, max_retries=3))
    finally:
        stop_stub_process(proc)
    msg = str(e.value)
    assert f"server at {url} stopped answering (connection refused) after 10 finished records" in msg
    (partial,) = partial_files(tmp_path)
    assert str(partial) in msg and "restart the server and rerun" in msg
    assert len(read_jsonl(partial)) == 10
    # a crash mid-write left half a record of the next prompt
    whole = partial.read_bytes()
    with open(partial, "ab") as f:
        f.write(b'{"id":"%s","source":"test","messages":[{"ro' % f"{10:08x}".encode())
    proc, url = start_stub_process()  # "restart the server"
    try:
        stats = generate(tmp_path, [url], shard=prompts)
    finally:
        stop_stub_process(proc)
    assert stats["resumed"] == 10 and stats["completed"] == 30
    lines = (tmp_path / "traces" / "shard_0.jsonl").read_bytes()
    assert lines.startswith(whole) and len(lines.splitlines()) == 40
    assert [json.loads(x)["id"] for x in lines.splitlines()] == [f"{i:08x}" for i in range(40)]


def test_no_server_at_all_names_the_url(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TracesError, match=f"server at {url} is not answering \\(connection refused\\)"):
        generate(tmp_path, [url], n=5, generation=dict(FAST, max_retries=2))


def test_a_rerun_with_every_record_finished_needs_no_server(tmp_path, stub):
    # as after a crash between the output's rename and the partial file's removal
    prompts = write_shard(tmp_path / "prompts.jsonl", 10)
    generate(tmp_path, [stub.url], shard=prompts)
    out = tmp_path / "traces" / "shard_0.jsonl"
    partial = tmp_path / "traces" / "partial" / f"shard_0.{answers_key(settings())}.partial.jsonl"
    done = out.read_bytes()
    lines = done.splitlines(keepends=True)
    partial.write_bytes(b"".join(lines[3:] + lines[:3]))  # finished in another order
    out.unlink()
    stats = generate(tmp_path, [f"http://127.0.0.1:{free_port()}"], shard=prompts)
    assert stats["resumed"] == 10 and stats["completed"] == 0 and out.read_bytes() == done


def test_a_settings_change_starts_a_fresh_partial_file(tmp_path):
    prompts = write_shard(tmp_path / "prompts.jsonl", 20)
    with StubServer(die_after=5) as s:
        with pytest.raises(TracesError):
            generate(tmp_path, [s.url], shard=prompts, generation=dict(FAST, concurrency=1, max_retries=1))
    (old,) = partial_files(tmp_path)
    assert len(read_jsonl(old)) == 5
    with StubServer() as s:
        stats = generate(tmp_path, [s.url], shard=prompts, generation=dict(FAST, temperature=0.7))
        assert s.answered == 20
    assert stats["resumed"] == 0 and stats["completed"] == 20
    assert unfinished_partials(tmp_path) == [old]  # the other settings' records stay for their own rerun
    assert stats["fingerprint"] != answers_key(settings()) and stats["fingerprint"] not in old.name


def test_output_appears_only_when_the_shard_is_complete(tmp_path):
    prompts = write_shard(tmp_path / "prompts.jsonl", 40)
    out = tmp_path / "traces" / "shard_0.jsonl"
    seen = []
    with StubServer(delay=0.05) as s:
        t = threading.Thread(target=lambda: seen.append(
            generate(tmp_path, [s.url], shard=prompts, generation=dict(FAST, concurrency=4))))
        t.start()
        while t.is_alive():
            exists = out.exists()  # looked at first: the partial file becomes the output's link after it appears
            try:
                finished = max((p.read_bytes().count(b"\n") for p in partial_files(tmp_path)), default=0)
            except FileNotFoundError:
                finished = 40
            if 0 < finished < 40:
                assert not exists
                seen.append("partial")
            time.sleep(0.02)
        t.join()
    assert "partial" in seen and seen[-1]["completed"] == 40
    assert out.exists() and unfinished_partials(tmp_path) == []
    assert not list(out.parent.glob(".*tmp*"))


# -- replicas and the server check ---------------------------------------------------------------


def test_replicas_share_the_load(tmp_path):
    with StubServer(delay=0.02) as a, StubServer(delay=0.02) as b:
        stats = generate(tmp_path, [a.url, b.url], n=60, generation=dict(FAST, concurrency=8))
    assert a.answered >= 20 and b.answered >= 20 and a.answered + b.answered == 60
    servers = [r["server"] for r in read_jsonl(tmp_path / "traces" / "shard_0.jsonl")]
    assert servers.count(a.url) == a.answered and stats["answered_per_url"] == {a.url: a.answered, b.url: b.answered}


def test_a_dead_replica_is_routed_around(tmp_path, stub):
    dead = f"http://127.0.0.1:{free_port()}"
    stats = generate(tmp_path, [dead, stub.url], n=40, generation=dict(FAST, max_retries=3))
    assert stats["completed"] == 40 and stats["errors"] == 0 and stub.answered == 40


def test_probe_reads_the_served_models_and_names_a_refused_connection(stub):
    assert probe(stub.url) == {"models": [MODEL], "max_model_len": {MODEL: 4096}, "version": "0.0.0-stub"}
    with pytest.raises(OSError) as e:
        probe(f"http://127.0.0.1:{free_port()}")
    assert describe_os_error(e.value) == "connection refused"


def test_a_forced_rerun_of_a_finished_shard_sends_nothing(tmp_path):
    # Snakemake reruns every consumer of a rebuilt server.ready: a finished shard must cost nothing.
    prompts = write_shard(tmp_path / "prompts.jsonl", 12)
    out = tmp_path / "traces" / "shard_0.jsonl"
    with StubServer() as s:
        generate(tmp_path, [s.url], shard=prompts)
    done = out.read_bytes()
    out.unlink()  # what Snakemake does to an output before rerunning its job
    stats = generate(tmp_path, [f"http://127.0.0.1:{free_port()}"], shard=prompts)
    assert stats["resumed"] == 12 and stats["completed"] == 0 and out.read_bytes() == done
