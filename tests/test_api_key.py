"""A server the workflow starts beyond loopback requires the run's own API key, and the key stays private.

Real vLLM (the toy target) started by the workflow itself (`snakemake traces/shard_0.jsonl`, so the
server_ready and generate_traces rules are the jobs under test), once through the one-node SLURM
cluster of the tests (ci/slurm.sh) and once as a local server bound to 0.0.0.0. Each server is shared by the
tests of its module-scoped fixture and stopped at the end. server.keep_server keeps it up after the
run so the tests can look at its process, job and files; --notemp keeps server.ready."""
import contextlib
import json
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from eaglenest.errors import ServerError
from eaglenest.serving.lifecycle import stop_server
from eaglenest.serving.local import read_pidfile, LocalPaths
from eaglenest.serving.probe import probe
from eaglenest.serving.settings import RUN_KEY_FILE, ServerConfig
from eaglenest.serving.slurm_jobs import read_record, SlurmPaths
from tests.support.config import TOY_PROMPTS, write_config
from tests.support.slurm import scontrol_job, slurm_command
from tests.support.workflow import run_snakemake

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SMALL = {"dataset": {"path": str(TOY_PROMPTS), "limit": 8, "heldout": 2}, "shards": 2,
         "generation": {"max_tokens": 16, "concurrency": 4, "request_timeout": 300, "max_retries": 1}}


def _start(wd: Path, server: dict, targets=("traces/shard_0.jsonl",)) -> dict:
    """Run the workflow up to `targets`; the server it starts stays up (keep_server)."""
    cfg = write_config(wd, **SMALL, server={**server, "keep_server": True})
    out = run_snakemake(wd, *targets, "--notemp", timeout=800)
    key = (wd / RUN_KEY_FILE).read_text().strip()
    ready = json.loads((wd / "server.ready").read_text())
    assert ready["version"] and ready["model"] == "toy", ready  # a real vLLM served the toy target
    print(f"server ready: {ready}")
    return {"wd": wd, "cfg": ServerConfig.from_dict(cfg["server"]), "key": key, "ready": ready,
            "url": ready["urls"][0], "port": _port(ready["urls"][0]), "run_output": out.stdout + out.stderr}


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _stop(wd: Path, log_dir: str) -> None:
    """Stop what the run in `wd` left up in `log_dir` (its config asked to keep it)."""
    cfg = yaml.safe_load((wd / "config.yaml").read_text())["server"]
    stop_server(ServerConfig.from_dict({**cfg, "keep_server": False}), wd / log_dir)


def _vllm_cmdline(port: int) -> str:
    """The command line of the vLLM API server listening on `port`, as `ps` shows it to everyone."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and str(port).encode() in argv:
            return b" ".join(argv).decode().strip()
    pytest.fail(f"no vLLM process listening on port {port} found in /proc")


def _get_status(url: str, key: str | None, path: str = "/v1/models", body: dict | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}{path}", data=data, headers={**headers, "Content-Type": "application/json"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _files_under(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()]


def _check_refuses_strangers_and_serves_its_jobs(s):
    assert _get_status(s["url"], None) == 401
    assert _get_status(s["url"], "not-the-key") == 401
    assert _get_status(s["url"], s["key"]) == 200
    # vLLM's own check covers /v1 etc. only: without the guard these two answered with no key at all.
    chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _get_status(s["url"], None, "/invocations", chat) == 401
    assert _get_status(s["url"], None, "/tokenize", {"model": "toy", "prompt": "hi"}) == 401
    assert _get_status(s["url"], s["key"], "/invocations", chat) == 200
    with pytest.raises(ServerError, match="HTTP 401.*no API key was sent.*server.api_key_env"):
        probe(s["url"])
    # The workflow's own job (generate_traces) was served: every question of the shard answered.
    rows = [json.loads(l) for l in (s["wd"] / "traces/shard_0.jsonl").read_text().splitlines()]
    assert rows and all(r["completion_token_ids"] for r in rows)
    with contextlib.chdir(s["wd"]):
        assert s["cfg"].api_key() == s["key"]  # every job of the run reads the one run key


def _check_key_is_private(s, also: list[str]):
    key_file = s["wd"] / RUN_KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    texts = {"vLLM's command line": _vllm_cmdline(s["port"]), "server.ready": (s["wd"] / "server.ready").read_text(),
             "snakemake's output": s["run_output"], **{f"extra {i}": t for i, t in enumerate(also)}}
    for f in _files_under(s["wd"] / "logs") + _files_under(s["wd"] / ".snakemake" / "log"):
        texts[str(f)] = f.read_text(errors="replace")
    assert len(texts) > 5
    leaks = [where for where, text in texts.items() if s["key"] in text]
    assert not leaks, f"the API key appears in {leaks}"


# ---------------------------------------------------------------------------------------------- SLURM


@pytest.fixture(scope="module")
def slurm_server(tmp_path_factory, slurm_cluster):
    wd = tmp_path_factory.mktemp("slurm_key")
    try:
        s = _start(wd, {"mode": "slurm", "slurm": {"cpus": 1, "mem": "4G", "gpus": 0, "time": "20:00"}})
        s["job_id"] = read_record(SlurmPaths(wd / "logs/server"))["job_id"]
        yield s
    finally:  # the server job never outlives the module, passed or failed
        _stop(wd, "logs/server")


@pytest.mark.slurm
def test_slurm_server_refuses_a_request_without_the_key_and_serves_the_workflow(slurm_server):
    assert slurm_server["ready"]["mode"] == "slurm"
    _check_refuses_strangers_and_serves_its_jobs(slurm_server)


@pytest.mark.slurm
def test_slurm_server_key_is_in_no_command_line_job_script_sentinel_or_log(slurm_server):
    job_id = slurm_server["job_id"]
    shown = scontrol_job(job_id)
    assert f"JobId={job_id}" in shown and "JobState=RUNNING" in shown
    script = slurm_command(["scontrol", "write", "batch_script", job_id, "-"]).stdout
    assert "vllm.entrypoints.openai.api_server" in script
    detailed = slurm_command(["scontrol", "--details", "show", "job", job_id]).stdout
    _check_key_is_private(slurm_server, [shown, detailed, script])


# ------------------------------------------------------------------------- local, beyond loopback


@pytest.fixture(scope="module")
def local_server(tmp_path_factory):
    wd = tmp_path_factory.mktemp("local_key")
    try:
        yield _start(wd, {"mode": "local", "host": "0.0.0.0"}, targets=("traces/shard_0.jsonl", "traces/shard_1.jsonl"))
    finally:
        _stop(wd, "logs/server")


def test_local_server_on_every_interface_refuses_a_request_without_the_key(local_server):
    assert "--host 0.0.0.0" in _vllm_cmdline(local_server["port"])
    _check_refuses_strangers_and_serves_its_jobs(local_server)


def test_local_server_key_is_in_no_command_line_sentinel_or_log(local_server):
    record = read_pidfile(LocalPaths(local_server["wd"] / "logs/server"))
    port = local_server["port"]  # the launcher's free pick, added to the recorded command
    assert record and _vllm_cmdline(port) == " ".join(record["command"] + ["--port", str(port)])
    _check_key_is_private(local_server, [json.dumps(record)])


# ------------------------------------------------ the extraction server (hidden.backend: vllm), local


@pytest.fixture(scope="module")
def extraction_server(local_server):
    """The same run goes on to extract one shard: the generation server is stopped first (one vLLM at
    a time here); the extraction server the workflow starts then stays up (keep_server)."""
    wd = local_server["wd"]
    _stop(wd, "logs/server")
    try:
        out = run_snakemake(wd, "hidden/shard_0.safetensors", "--notemp", timeout=800)
        ready = json.loads((wd / "hidden_server.ready").read_text())
        record = read_pidfile(LocalPaths(wd / "logs/hidden_server"))
        yield {**local_server, "ready": ready, "url": ready["urls"][0], "record": record,
               "run_output": local_server["run_output"] + out.stdout + out.stderr}
    finally:
        _stop(wd, "logs/hidden_server")


def test_extraction_server_refuses_strangers_and_keeps_the_key_private(extraction_server):
    s = extraction_server
    assert (s["wd"] / "hidden/shard_0.safetensors").exists()  # the workflow's client was served
    port = _port(s["url"])
    assert port != s["port"] and "--host 0.0.0.0" in _vllm_cmdline(port)
    assert _get_status(s["url"], None) == 401 and _get_status(s["url"], s["key"]) == 200
    assert _get_status(s["url"], None, "/invocations", {"model": "toy", "prompt": [1, 2], "max_tokens": 1}) == 401
    texts = {"vLLM's command line": _vllm_cmdline(port), "hidden_server.ready": (s["wd"] / "hidden_server.ready").read_text(),
             "snakemake's output": s["run_output"]}
    for f in _files_under(s["wd"] / "logs") + _files_under(s["wd"] / ".snakemake" / "log"):
        texts[str(f)] = f.read_text(errors="replace")
    leaks = [where for where, text in texts.items() if s["key"] in text]
    assert not leaks, f"the API key appears in {leaks}"


def test_extraction_states_are_private_and_a_client_cannot_choose_where_they_go(extraction_server, tmp_path):
    s = extraction_server
    states = Path(s["ready"]["states_dir"])
    assert states.is_dir() and stat.S_IMODE(states.stat().st_mode) == 0o700
    elsewhere = tmp_path / "chosen_by_the_client.safetensors"
    body = {"model": "toy", "prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"hidden_states_path": str(elsewhere)}}
    req = urllib.request.Request(f"{s['url']}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {s['key']}", "Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=120) as r:
        answer = json.loads(r.read())
    written = Path(answer["kv_transfer_params"]["hidden_states_path"])
    try:
        assert not elsewhere.exists() and written.parent == states.resolve()
    finally:
        for p in (written, Path(f"{written}.lock")):
            p.unlink(missing_ok=True)
