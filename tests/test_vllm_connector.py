"""The vLLM internals eaglenest/serving/connector.py relies on, checked against the installed vLLM.

Each assertion names one thing the connector uses; when a vLLM upgrade renames or reshapes it, this
fails here, loudly, before an extraction server dies at its first request. The CPU write path is
then run against upstream's own ``get_finished`` (no engine: the attributes vLLM's constructor
would set are set by hand, which is exactly the contract being checked)."""
import dataclasses
import fcntl
import importlib
import inspect
import os

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.serving import connector as vllm_connector


@pytest.fixture(scope="module")
def upstream():
    return importlib.import_module(vllm_connector.UPSTREAM_MODULE)


ATTRIBUTES = ("_is_tp_rank_zero", "_kv_cache", "_block_size", "_lock_fds", "use_lock", "_req_copy_events",
              "_req_futures", "_accumulated_finished_req_ids")


def test_upstream_names_the_connector_relies_on(upstream):
    cls = getattr(upstream, vllm_connector.UPSTREAM)
    assert callable(upstream.extract_from_kv_cache)
    assert {"req_id", "filename", "token_ids", "block_ids"} <= {f.name for f in dataclasses.fields(upstream.PendingSave)}
    init = inspect.getsource(cls.__init__)
    for name in ATTRIBUTES:
        assert f"self.{name}" in init, f"{vllm_connector.UPSTREAM}.__init__ no longer sets self.{name}"
    assert list(inspect.signature(cls._submit_async_write).parameters) == ["self", "pending"]
    finished = inspect.getsource(cls.get_finished)
    assert "_submit_async_write(pending)" in finished and "_req_copy_events" in finished and ".query()" in finished
    assert "allow_custom_save_path" in init  # off unless asked for; eaglenest never asks
    factory = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.factory")
    assert "kv_connector_module_path" in inspect.getsource(factory)


def test_connector_class_is_upstreams_subclass(upstream):
    cls = vllm_connector.EaglenestHiddenStatesConnector
    assert issubclass(cls, getattr(upstream, vllm_connector.UPSTREAM))
    assert cls.__name__ == vllm_connector.CONNECTOR and vllm_connector.MODULE == "eaglenest.serving.connector"


def test_cpu_write_path_with_upstreams_get_finished(upstream, tmp_path):
    cls = vllm_connector.EaglenestHiddenStatesConnector
    c = object.__new__(cls)  # the attributes vLLM's constructor and register_kv_caches set:
    block, layers, hidden = 4, 3, 8
    c._kv_cache = torch.randn(10, layers, block, hidden)  # [blocks, layers (as heads), block, hidden]
    c._block_size, c._is_tp_rank_zero, c.use_lock = block, True, True
    c._lock_fds, c._req_copy_events, c._req_futures, c._accumulated_finished_req_ids = {}, {}, {}, set()
    c._connector_metadata = None
    path = str(tmp_path / "r1.safetensors")
    lock_fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # as upstream's wait_for_save leaves it
    c._lock_fds["r1"] = lock_fd
    tokens = torch.arange(6)
    c._submit_async_write(upstream.PendingSave(req_id="r1", filename=path, token_ids=tokens, block_ids=[7, 2]))
    data = vllm_connector.read_states(path)  # returns: the lock was released
    expected = torch.cat([c._kv_cache[7].transpose(0, 1), c._kv_cache[2].transpose(0, 1)])[:6]
    assert torch.equal(data["hidden_states"], expected) and torch.equal(data["token_ids"], tokens)
    assert not os.path.exists(path + ".tmp")
    done, _ = c.get_finished({"r1"})  # upstream's method: the request is reported done
    assert done == {"r1"}
    assert torch.equal(load_file(path)["hidden_states"], expected)
