"""Server lifecycle pieces that need no model: command line, GPU check, pidfile, stale sentinel."""
import dataclasses
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglenest.errors import EaglenestError
from eaglenest.errors import ServerError
from eaglenest.serving.lifecycle import start_server, stop_server, wait_ready
from eaglenest.serving.local import (LocalPaths, busy_gpus, guarded_server_command, launch_env, server_command,
                                     start_local, stop_local)
from eaglenest.serving.probe import check_sentinel
from eaglenest.serving.settings import (RUN_KEY_FILE, ServerConfig, check_model_path, forget_run_key,
                                        looks_like_local_path, run_key)
from tests.support.servers import free_port

TOY = Path(__file__).resolve().parent.parent / "toy" / "target"


def test_command_carries_settings_but_no_secret(monkeypatch):
    monkeypatch.setenv("MY_KEY", "s3cret")
    cfg = ServerConfig(model="m", served_model_name="toy", port=8123, tensor_parallel_size=8, max_model_len=4096,
                       reasoning_parser="kimi_k2", extra_args=["--enable-prefix-caching"], api_key_env="MY_KEY")
    cmd = guarded_server_command(cfg)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for a, b in [("--model", "m"), ("--tensor-parallel-size", "8"), ("--max-model-len", "4096"),
                 ("--reasoning-parser", "kimi_k2"), ("--served-model-name", "toy"), ("--host", "127.0.0.1")]:
        assert cmd[cmd.index(a) + 1] == b
    assert "--enable-prefix-caching" in cmd and "--port" not in cmd  # the launcher adds the port it took
    assert "s3cret" not in " ".join(cmd)
    launched = server_command(cfg, "logs/port.json")
    assert launched[launched.index("--want") + 1] == "8123" and launched[launched.index("--") + 1:] == cmd
    assert server_command(dataclasses.replace(cfg, port=None), "p.json")[launched.index("--want") + 1] == "auto"


@pytest.mark.parametrize("tp, extra, single", [(1, [], True), (2, [], False),
                                               (1, ["--distributed-executor-backend", "mp"], False),
                                               (1, ["--pipeline-parallel-size=2"], False), (1, ["-dp", "2"], False),
                                               (1, ["--tensor_parallel_size", "2"], False)])
def test_one_device_runs_its_worker_in_the_engine_process(tp, extra, single):
    """vLLM's CPU platform makes the worker a process of its own unless both the executor flag and the
    environment say otherwise (serving.vllm.single_process_worker); a user's own choice stays."""
    cfg = ServerConfig(model="m", tensor_parallel_size=tp, extra_args=extra)
    cmd, env = guarded_server_command(cfg), launch_env(cfg, None)
    assert (cmd.count("--distributed-executor-backend") == 1 and cmd[cmd.index("--distributed-executor-backend") + 1]
            == "uni") is single
    assert (env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0") is single
    # server.env has the last word
    overridden = launch_env(ServerConfig(model="m", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}), None)
    assert overridden["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_missing_api_key_variable_is_named(monkeypatch):
    monkeypatch.delenv("NOPE_KEY", raising=False)
    with pytest.raises(ServerError, match="NOPE_KEY"):
        ServerConfig(api_key_env="NOPE_KEY").api_key()


@pytest.mark.parametrize("mode, host, needs", [("local", "127.0.0.1", False), ("local", "localhost", False),
                                               ("local", "::1", False), ("local", "0.0.0.0", True),
                                               ("local", "10.1.2.3", True), ("slurm", "127.0.0.1", True),
                                               ("external", "0.0.0.0", False)])
def test_a_server_beyond_loopback_needs_a_key(mode, host, needs):
    assert ServerConfig(mode=mode, host=host).needs_key is needs


def test_a_server_with_a_key_loads_the_key_guard_from_this_checkout(monkeypatch):
    from eaglenest.serving.local import CHECKOUT, KEY_GUARD

    assert "--middleware" not in guarded_server_command(ServerConfig(model="m"))  # loopback, no key
    for cfg in (ServerConfig(model="m", host="0.0.0.0"), ServerConfig(model="m", mode="slurm"),
                ServerConfig(model="m", api_key_env="K")):
        cmd = guarded_server_command(cfg)
        assert cmd[cmd.index("--middleware") + 1] == KEY_GUARD
    env = launch_env(ServerConfig(model="m", host="0.0.0.0", env={"PYTHONPATH": "/elsewhere"}), "k")
    assert env["PYTHONPATH"] == f"{CHECKOUT}{os.pathsep}/elsewhere"


def test_the_run_key_is_private_shared_by_starters_and_forgotten(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = ServerConfig(mode="local", host="0.0.0.0")
    with pytest.raises(ServerError, match="api_key does not exist.*Delete server.ready and rerun"):
        cfg.api_key()  # a client never makes one: only what starts a server does
    key = cfg.api_key(create=True)
    assert len(key) >= 40 and cfg.api_key() == key == run_key(create=True)  # one key for every job of the run
    assert stat.S_IMODE(RUN_KEY_FILE.stat().st_mode) == 0o600
    assert stat.S_IMODE(RUN_KEY_FILE.parent.stat().st_mode) == 0o700
    assert sorted(p.name for p in RUN_KEY_FILE.parent.iterdir()) == ["api_key"]  # no temporary file left
    assert "api_key" not in launch_env(cfg, key) and launch_env(cfg, key)["VLLM_API_KEY"] == key
    assert ServerConfig(mode="local").api_key() is None  # loopback: no key
    RUN_KEY_FILE.chmod(0o644)
    with pytest.raises(ServerError, match="readable by other users.*delete it"):
        cfg.api_key()
    forget_run_key()
    assert cfg.api_key(create=True) != key


def test_external_mode_needs_urls():
    with pytest.raises(ServerError, match="server.urls"):
        ServerConfig(mode="external").base_urls()


FAKE_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=index,uuid,memory.used,memory.total) printf '0, GPU-a, 3, 81559\\n1, GPU-b, 70123, 81559\\n';;
  --query-compute-apps=gpu_uuid,pid,process_name,used_memory) printf 'GPU-b, 4242, python3, 70100\\n';;
  *) printf '0, 3\\n1, 70123\\n';;
esac
"""


def test_busy_gpus_lists_memory_and_processes(tmp_path, monkeypatch):
    # nvidia-smi's CSV output as the driver prints it; there is no GPU on the test machine.
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert busy_gpus([0]) == []
    busy = busy_gpus([0, 1])
    assert len(busy) == 1 and "GPU 1" in busy[0] and "pid 4242 python3" in busy[0]
    cfg = ServerConfig(model="m", tensor_parallel_size=2, port=1)
    with pytest.raises(ServerError, match="GPU 1: 70123/81559 MiB in use by pid 4242"):
        start_local(cfg, LocalPaths(tmp_path / "logs"), log=lambda *_: None)


def test_stale_sentinel_says_what_to_run(tmp_path):
    sentinel = tmp_path / "server.ready"
    sentinel.write_text(json.dumps({"urls": ["http://127.0.0.1:9"], "model": "toy"}))
    with pytest.raises(ServerError, match=r"stale.*rm .*server.ready"):
        check_sentinel(sentinel)


def test_port_held_by_a_stranger_is_refused(tmp_path):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        with pytest.raises(ServerError, match=f"port {port}.*in use"):
            start_local(ServerConfig(model="m", port=port), LocalPaths(tmp_path), log=lambda *_: None)
    finally:
        s.close()


@pytest.mark.vllm
def test_process_that_dies_while_loading_fails_within_one_poll(tmp_path):
    # A real vLLM launch with a model directory that holds no model: vLLM exits during start-up.
    (tmp_path / "no-such-model").mkdir()
    cfg = ServerConfig(model=str(tmp_path / "no-such-model"), port=free_port(), poll_interval=1, ready_timeout=300)
    paths = LocalPaths(tmp_path / "logs")
    start_local(cfg, paths, log=lambda *_: None)
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        wait_ready(cfg, paths, log=lambda *_: None)
    assert "exited before it was ready" in str(e.value)
    assert "no-such-model" in str(e.value)  # the log tail names the problem
    assert time.monotonic() - t0 < 120
    assert not paths.pidfile.exists()


@pytest.mark.vllm
def test_watchdog_stops_server_when_workflow_dies(tmp_path):
    # The "workflow" is a short-lived process; the "server" is a real vLLM launch that is still loading.
    workflow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    cfg = ServerConfig(model=str(TOY), port=free_port(), max_model_len=512)
    paths = LocalPaths(tmp_path / "logs")
    record = start_local(cfg, paths, workflow_pid=workflow.pid, log=lambda *_: None)
    workflow.wait()
    assert _alive(record["pid"]), "vLLM should still be loading when the workflow dies"
    deadline = time.monotonic() + 30
    # The watchdog kills the server, then removes the pidfile: wait for both (a loaded machine is slow).
    while time.monotonic() < deadline and (_alive(record["pid"]) or paths.pidfile.exists()):
        time.sleep(0.5)
    assert not _alive(record["pid"])
    assert not paths.pidfile.exists()
    stop_local(paths)


def _alive(pid):
    from eaglenest.serving.backend import alive
    return alive(pid)


def test_server_starts_without_the_jobs_thread_variables(tmp_path, monkeypatch):
    """Snakemake exports OMP_NUM_THREADS=<threads> to a job; vLLM's CPU worker crawls with it.
    The "interpreter" here prints the environment it was given into the server log."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nenv\n")
    fake.chmod(0o755)
    cfg = ServerConfig(model="m", port=free_port(), python=str(fake), env={"MKL_NUM_THREADS": "8"})
    paths = LocalPaths(tmp_path / "logs")
    record = start_local(cfg, paths, log=lambda *_: None)
    deadline = time.monotonic() + 10
    while _alive(record["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    logged = paths.log.read_text().splitlines()
    assert "MKL_NUM_THREADS=8" in logged  # server.env still wins
    assert not any(line.startswith("OMP_NUM_THREADS=") for line in logged)
    stop_local(paths)


@pytest.mark.parametrize("model", ["/no/such/model", "./no-such-model", "../no-such-model", "~/no-such-model-here",
                                   "toy/no-such-model", "models/llama/8b"])
def test_a_local_model_path_that_does_not_exist_fails_at_once(tmp_path, model):
    """vLLM would first ask the hub for it and fail half a minute later; no process is started."""
    cfg = ServerConfig(model=model, port=free_port())
    paths = LocalPaths(tmp_path / "logs")
    t0 = time.monotonic()
    with pytest.raises(EaglenestError) as e:
        start_server(cfg, paths.log_dir, log=lambda *_: None)
    assert time.monotonic() - t0 < 5
    assert "server.model" in str(e.value) and model in str(e.value) and "does not exist" in str(e.value)
    assert not paths.pidfile.exists() and not paths.log.exists()


def test_hub_names_and_existing_paths_are_not_taken_for_missing_paths():
    assert not looks_like_local_path("meta-llama/Llama-3.1-8B-Instruct")  # no directory named meta-llama here
    assert not looks_like_local_path("gpt2")
    assert looks_like_local_path("toy/target") and looks_like_local_path("/abs/x") and looks_like_local_path("~/m")
    check_model_path(str(TOY))  # exists: no error
    check_model_path("Qwen/Qwen3-8B")  # a hub name: vLLM's to resolve


def test_stop_server_dispatches_on_mode_and_keep_server(tmp_path):
    assert stop_server(ServerConfig(mode="external", urls=["http://h:1"]), tmp_path) == "left alone (external mode)"
    assert stop_server(ServerConfig(keep_server=True), tmp_path) == "kept (server.keep_server)"
    assert stop_server(ServerConfig(), tmp_path, log=lambda *_: None) == "not running"


def test_every_mode_launches_vllm_with_one_environment(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    cfg = ServerConfig(env={"NCCL_DEBUG": "INFO"})
    local, job = launch_env(cfg, "k"), launch_env(cfg, "k", drop_prefixes=("SLURM_",))
    for env in (local, job):
        assert "OMP_NUM_THREADS" not in env and env["NCCL_DEBUG"] == "INFO" and env["VLLM_API_KEY"] == "k"
    assert local["SLURM_JOB_ID"] == "7" and "SLURM_JOB_ID" not in job
