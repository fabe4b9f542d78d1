"""The vLLM-backend client against a stub extraction server, for faults real vLLM cannot be made to
produce on demand: a per-request file whose token ids differ from those sent, a path outside the
directory the workflow gave the server, an answer without prompt logprobs. The stub is no model: it
answers like vLLM 0.32's ``/v1/completions`` (``vllm_answer``: ``kv_transfer_params.hidden_states_path``,
``prompt_logprobs`` and the generated ``token_ids``) and writes a crafted file there (random states;
its "greedy tokens" are a fixed function of the token ids, ``stub_greedy``). The agreement with real
states and real greedy tokens is tested against real vLLM in test_extract_vllm.py."""
import json
import shutil
import time
from collections import namedtuple

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.errors import DiskSpaceError
from eaglenest.serving.connector import storage_dir
from eaglenest.serving.vllm import extraction_server_args, extraction_speculative_config
from eaglenest.states.extract import ExtractError, extract_hidden_vllm, layer_ids
from eaglenest.states.target import save_target_head
from eaglenest.settings import HiddenSettings
from tests.support.config import TOY_TARGET
from tests.support.extraction_stub import StubExtractionServer, stub_greedy


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    path = tmp_path_factory.mktemp("head") / "target_head.safetensors"
    return path, save_target_head(path, HiddenSettings.defaults().replace(target=str(TOY_TARGET), aux_layers=[1, 2, 3]))


def _traces(path, n=6):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"t{i}", "prompt_token_ids": [5, 6, 7 + i], "completion_token_ids": [8, 9, 10]}) + "\n")
    return path


def _run(tmp_path, head, stub, **kw):
    return extract_hidden_vllm([_traces(tmp_path / "traces.jsonl")], tmp_path / "shard_0.safetensors",
                               HiddenSettings.defaults().replace(max_length=64, concurrency=2, max_retries=0),
                               url=stub.url, model="toy", head_path=head[0], storage=stub.storage, progress=False, **kw)


def _refused_then_rerun(tmp_path, head, match, **fault):
    """A stub with ``fault`` makes the shard fail with an error matching ``match``, and no shard is
    written. The refused file is gone at once, but a request the client cancelled may still be
    answered, and its file written, after the run failed (a real server finishes it too): any file
    left is this shard's, and the rerun against a healthy stub removes it as it completes the shard."""
    storage = storage_dir(tmp_path / "states")
    with StubExtractionServer(storage, 4, 128, **fault) as stub:
        with pytest.raises(ExtractError, match=match):
            _run(tmp_path, head, stub)
    assert not (tmp_path / "shard_0.safetensors").exists()
    left = [p.name for p in storage.iterdir()]
    assert all("eaglenest-shard_0-" in name for name in left), left
    with StubExtractionServer(storage, 4, 128) as stub:
        _run(tmp_path, head, stub)
    assert (tmp_path / "shard_0.safetensors").exists() and list(storage.iterdir()) == []


def test_token_ids_that_differ_from_those_sent_are_refused_with_the_trace_id(tmp_path, head):
    def corrupt(ids):
        return ids[:-1] + [ids[-1] + 1] if ids[2] == 10 else ids  # the trace t3 only

    _refused_then_rerun(tmp_path, head, r"trace 't3'.*other tokens than those sent.*position 5", corrupt=corrupt)


def test_matching_files_pack_into_a_complete_shard(tmp_path, head):
    storage = storage_dir(tmp_path / "states")
    with StubExtractionServer(storage, 4, 128) as stub:
        stats = _run(tmp_path, head, stub)
    assert stats["sequences"] == stats["sent"] == stub.requests == 6 and stats["tokens"] == 36
    assert (tmp_path / "shard_0.safetensors").exists() and list(storage.iterdir()) == []
    assert storage.stat().st_mode & 0o777 == 0o700
    shard = load_file(str(tmp_path / "shard_0.safetensors"))
    # the rank-1 token of each prompt position, not the prompt token listed first, and the generated one last
    assert shard["target_next"].dtype == torch.int32
    assert shard["target_next"].tolist() == stub_greedy(shard["input_ids"].tolist())


def test_a_busy_server_is_retried_after_what_its_retry_after_says(tmp_path, head):
    """Retry-After: 0 on each 503; with a 30 s back-off, ignoring it would wait 15-30 s per retry."""
    storage = storage_dir(tmp_path / "states")
    settings = HiddenSettings.defaults().replace(max_length=64, concurrency=2, max_retries=3, backoff_base=30.0)
    with StubExtractionServer(storage, 4, 128, busy=4) as stub:
        t0 = time.monotonic()
        stats = extract_hidden_vllm([_traces(tmp_path / "traces.jsonl")], tmp_path / "shard_0.safetensors", settings,
                                    url=stub.url, model="toy", head_path=head[0], storage=stub.storage, progress=False)
        elapsed = time.monotonic() - t0
    assert stats["sequences"] == 6 and stub.requests == 10 and elapsed < 10, (stats, stub.requests, elapsed)


def test_an_answer_without_prompt_logprobs_is_refused_naming_the_trace(tmp_path, head):
    _refused_then_rerun(tmp_path, head, r"trace 't\d'.*prompt_logprobs is None, expected 6 entries", no_logprobs=True)


def test_a_file_outside_the_given_directory_is_not_read(tmp_path, head):
    storage, elsewhere = storage_dir(tmp_path / "states"), storage_dir(tmp_path / "elsewhere")
    with StubExtractionServer(storage, 4, 128, outside=elsewhere) as stub:
        with pytest.raises(ExtractError, match="outside"):
            _run(tmp_path, head, stub)


def test_refuses_before_sending_when_the_disk_is_short(tmp_path, head, monkeypatch):
    storage = storage_dir(tmp_path / "states")
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    with StubExtractionServer(storage, 4, 128) as stub:
        with pytest.raises(DiskSpaceError, match="hidden.vllm.concurrency"):
            _run(tmp_path, head, stub)
        assert stub.requests == 0


def test_server_args_ask_for_aux_plus_final_layer_and_drop_contradicting_flags(head):
    info = head[1]
    ids = [1, 2, 3, info.num_hidden_layers]  # the aux layers, then the final layer (the toy's 28th)
    assert layer_ids(info) == ids
    args = extraction_server_args(layer_ids(info), "/x", ["--enable-prefix-caching", "--trust-remote-code",
                                               "--speculative-config", "{}", "--enable-chunked-prefill"])
    assert args[0] == "--trust-remote-code" and args.count("--speculative-config") == 1
    assert json.loads(args[args.index("--speculative-config") + 1]) == extraction_speculative_config(ids)
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": "/x"}  # never allow_custom_save_path
    assert args[-2:] == ["--no-enable-chunked-prefill", "--no-enable-prefix-caching"]
