"""hidden.backend vllm against a real vLLM serving the toy target (CPU, float32).

The workflow tests read the session's vLLM-backend run (conftest.vllm_backend_run: the real DAG, trace
server, traces, extraction server, shard) and compare its shard with the one the session's
transformers-backend run (conftest.transformers_backend_run) made over the same traces. The fault tests
share one extraction server started through the workflow's own lifecycle code (about a minute per start)."""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors import safe_open

from eaglenest.serving.connector import storage_dir
from eaglenest.serving.lifecycle import wait_ready
from eaglenest.serving.local import LocalPaths, read_pidfile, start_local, stop_local
from eaglenest.serving.settings import ServerConfig
from eaglenest.states.extract import ExtractError, extract_hidden_vllm, hidden_server_config
from eaglenest.states.hidden import extract_hidden
from eaglenest.states.target import save_target_head
from eaglenest.settings import HiddenSettings
from tests.support.config import BASE_CONFIG, ROOT, TOY_TARGET
from tests.support.servers import free_port

pytestmark = pytest.mark.vllm
AUX = [1, 2, 3]
HIDDEN = 128
# The fault tests' traces: enough that a fault lands mid-shard after the first 100 finished sequences.
N_TRACES = 500


def _tensors(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _max_diff_per_layer(a, b):
    """Largest |vLLM - transformers| per stored layer (aux blocks by vLLM id, then last_hidden)."""
    out = {}
    for j, layer in enumerate(AUX):
        blk = slice(j * HIDDEN, (j + 1) * HIDDEN)
        out[f"aux id {layer}"] = (a["aux_hidden"][:, blk].float() - b["aux_hidden"][:, blk].float()).abs().max().item()
    out["last_hidden (post-norm)"] = (a["last_hidden"].float() - b["last_hidden"].float()).abs().max().item()
    return out


def _assert_same_shard(vllm_path, ref_path):
    a, meta = _tensors(vllm_path)
    b, _ = _tensors(ref_path)
    for name in ("input_ids", "seq_offsets", "loss_mask"):
        assert torch.equal(a[name], b[name]), name
    for name in ("aux_hidden", "last_hidden"):
        torch.testing.assert_close(a[name].float(), b[name].float(), atol=2e-2, rtol=1e-2, msg=name)
    assert meta["format"] == "eaglenest.hidden/1" and json.loads(meta["aux_layers"]) == AUX
    # vLLM's greedy tokens (prompt logprobs' top-1, then the generated token) are transformers' argmax;
    # float32 forwards by other kernels may flip a near-tie, hence not all of them
    assert a["target_next"].dtype == torch.int32 and a["target_next"].shape == b["target_next"].shape
    agree = (a["target_next"] == b["target_next"]).float().mean().item()
    assert agree >= 0.995, f"target_next: vLLM and transformers agree on {agree:.4f} of the positions"
    return {**_max_diff_per_layer(a, b), "target_next disagreeing": 1 - agree}


# ---------------------------------------------------------------------------------------------- the workflow


def test_both_backends_give_the_same_tokens_and_states(vllm_backend_run, transformers_backend_run):
    (wd, _), (wd_t, _) = vllm_backend_run, transformers_backend_run
    diffs = _assert_same_shard(wd / "hidden/shard_0.safetensors", wd_t / "hidden/shard_0.safetensors")
    for name, run in (("vLLM", wd), ("transformers", wd_t)):
        log = (run / "logs/extract_hidden/shard_0.log").read_text().strip().splitlines()
        print(f"\n{name}: {log[-1] if log else '(empty log)'}")
    print("largest |vLLM - transformers| per layer (bf16 shards, float32 forwards):", json.dumps(diffs))
    (ROOT / ".pytest_cache").mkdir(exist_ok=True)
    (ROOT / ".pytest_cache" / "extract_vllm_diffs.json").write_text(json.dumps(diffs, indent=1))


def test_extraction_server_stopped_and_per_request_files_gone(vllm_backend_run):
    wd, _ = vllm_backend_run
    assert read_pidfile(LocalPaths(wd / "logs/hidden_server")) is None
    assert not (wd / "hidden_server.ready").exists()
    log = (wd / "logs/hidden_server/vllm.log").read_text()
    assert "extract_hidden_states" in log and "EaglenestHiddenStatesConnector" in log
    states = wd / "hidden/.vllm_states"
    assert states.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in states.iterdir()] == []
    assert not list((wd / "hidden").glob("*.partial*"))
    # the trace server was stopped before the extraction server started
    trace_log = json.loads((wd / "server.stopped").read_text())
    assert trace_log["server"] == "stopped"


# ---------------------------------------------------------------------------------------------- faults


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One extraction server for the fault tests, started like the workflow starts it."""
    wd = tmp_path_factory.mktemp("faults")
    facts = save_target_head(wd / "head.safetensors", HiddenSettings.defaults().replace(target=str(TOY_TARGET), aux_layers=AUX))
    storage = storage_dir(wd / "states")
    server_cfg = {**BASE_CONFIG["server"], "port": free_port()}
    cfg = hidden_server_config(ServerConfig.from_dict(server_cfg), HiddenSettings.defaults().replace(max_length=512, port=free_port()),
                               facts, storage)
    paths = LocalPaths(wd / "logs")
    start_local(cfg, paths)
    try:
        wait_ready(cfg, paths)
        traces = _random_traces(wd / "traces.jsonl", N_TRACES)
        ref = wd / "ref.safetensors"
        extract_hidden([traces], ref, HiddenSettings.defaults().replace(target=str(TOY_TARGET), aux_layers=AUX, max_length=512, dtype="float32"),
                       progress=False)
        yield {"wd": wd, "cfg": cfg, "paths": paths, "storage": storage, "traces": traces, "ref": ref,
               "head": wd / "head.safetensors", "url": cfg.url_at(cfg.port)}
    finally:
        stop_local(paths)


def _random_traces(path, n, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = [rng.randrange(3, 105) for _ in range(rng.randint(5, 40))]
            # t0 is max_length (512) long: vLLM must still fit its one generated token (max_model_len 513)
            completion = [rng.randrange(3, 105) for _ in range(512 - len(prompt) if i == 0 else rng.randint(20, 300))]
            f.write(json.dumps({"id": f"t{i}", "prompt_token_ids": prompt, "completion_token_ids": completion,
                                "truncated": False}) + "\n")
    return path


def _kwargs(s, **over):
    return {"settings": HiddenSettings.defaults().replace(max_length=512, concurrency=8, **over), "url": s["url"],
            "model": "toy", "head_path": s["head"], "storage": s["storage"], "progress": False}


def _journal_lines(out, n, alive, timeout=600):
    journal = out.with_name(out.name + ".partial.done")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if journal.exists() and journal.read_bytes().count(b"\n") >= n:
            return journal
        assert alive(), "the extraction ended before the fault was injected"
        time.sleep(0.05)
    pytest.fail("no finished sequences appeared")


def _finished(journal):
    return {int(l) for l in journal.read_bytes().split(b"\n")[:-1]}


def test_kill_9_mid_extraction_then_rerun_loses_and_repeats_nothing(server, tmp_path):
    out = tmp_path / "shard_0.safetensors"
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from eaglenest.settings import HiddenSettings\n"
            "from eaglenest.states.extract import extract_hidden_vllm\n"
            f"extract_hidden_vllm([{str(server['traces'])!r}], {str(out)!r}, "
            "HiddenSettings.defaults().replace(max_length=512, concurrency=8), "
            f"url={server['url']!r}, model='toy', "
            f"head_path={str(server['head'])!r}, storage={str(server['storage'])!r}, progress=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    journal = _journal_lines(out, 100, lambda: proc.poll() is None)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = _finished(journal)
    assert 100 <= len(before) < N_TRACES and not out.exists()
    stats = extract_hidden_vllm([server["traces"]], out, **_kwargs(server))
    assert stats["resumed"] == len(before)
    assert stats["sent"] == N_TRACES - len(before), "no finished sequence is requested again"
    _assert_same_shard(out, server["ref"])  # every sequence exactly once, in place, nothing lost
    assert not list(tmp_path.glob("*.partial*"))
    assert not [p for p in server["storage"].iterdir() if "shard_0" in p.name], "per-request files removed"


def test_server_death_mid_shard_fails_clearly_keeps_finished_and_rerun_completes(server, tmp_path):
    out = tmp_path / "shard_1.safetensors"
    result = {}

    def run():
        try:
            result["stats"] = extract_hidden_vllm([server["traces"]], out, **_kwargs(server, max_retries=1))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    journal = _journal_lines(out, 100, t.is_alive)
    os.killpg(read_pidfile(server["paths"])["pgid"], signal.SIGKILL)
    t.join(timeout=300)
    assert isinstance(result.get("error"), ExtractError), result
    message = str(result["error"])
    print("\nthe error when the extraction server died:", message)
    assert ("stopped answering" in message or "never wrote" in message) and "rerun" in message, message
    before = _finished(journal)
    assert len(before) >= 100 and out.with_name(out.name + ".partial").exists() and not out.exists()
    start_local(server["cfg"], server["paths"])  # the workflow would restart it on the rerun
    wait_ready(server["cfg"], server["paths"])
    stats = extract_hidden_vllm([server["traces"]], out, **_kwargs(server))
    assert stats["resumed"] == len(before) and stats["sent"] == N_TRACES - len(before)
    _assert_same_shard(out, server["ref"])
