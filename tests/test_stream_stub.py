"""Stream mode's client logic against a stub extraction server (fast; the real-vLLM runs are in
test_stream.py). The stub is needed where a test must control what a real server cannot be made to
do on demand: answer a fixed number of requests and then die, or count exactly which sequences were
asked for. Its states are a deterministic function of the token ids (seeded noise), so files mode
(shards written by ``extract_hidden_vllm`` from the same stub) and stream mode see the same numbers:
the checkpoints must then be bit-identical, the batches being the same in the same order."""
import asyncio
import json
import os
import random
import time

import pytest
import torch

from eaglenest.draft.checkpoint import load_checkpoint
from eaglenest.draft.train import train_draft
from eaglenest.draft.vocab import build_vocab
from eaglenest.serving.connector import storage_dir
from eaglenest.states import stream as stream_mod
from eaglenest.states.extract import ExtractError, extract_hidden_vllm
from eaglenest.states.stream import open_stream
from eaglenest.states.target import save_target_head
from eaglenest.settings import DraftSettings, HiddenSettings
from tests.support.config import TOY_TARGET
from tests.support.servers import free_port
from tests.support.extraction_stub import SeededStub
from tests.support.training import train_settings

CONFIG = {"ttt_length": 2, "batch_tokens": 256, "max_steps": 16, "save_every": 4, "lr": 3e-3, "warmup_steps": 2,
          "seed": 1}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    rng = random.Random(0)
    traces = []
    for s in range(2):
        path = root / f"shard_{s}.jsonl"
        with open(path, "w") as f:
            for i in range(20):
                prompt = [rng.randrange(3, 100) for _ in range(rng.randrange(3, 12))]
                completion = [rng.randrange(3, 100) for _ in range(rng.randrange(4, 40))]
                f.write(json.dumps({"id": f"s{s}-{i}", "prompt_token_ids": prompt, "completion_token_ids": completion}) + "\n")
        traces.append(path)
    head = root / "target_head.safetensors"
    save_target_head(head, HiddenSettings.defaults().replace(target=str(TOY_TARGET), aux_layers=[1, 2, 3]))
    vocab = root / "vocab.safetensors"
    build_vocab(traces, vocab, json.loads(head.with_suffix(".json").read_text())["vocab_size"],
                DraftSettings.defaults().replace(vocab_size=40))
    return {"root": root, "traces": traces, "head": head, "vocab": vocab}


def _spec(data, stub, **over):
    return {"traces": [str(p) for p in data["traces"]], "url": stub.url, "model": "toy", "head": str(data["head"]),
            "storage": str(stub.storage), "server": {}, "max_length": 64, "use_truncated": True, "concurrency": 3,
            "request_timeout": 30, "max_retries": 0, "backoff_base": 1.0, "backoff_max": 30.0, "max_disk_gb": 200e3 / 1e9,
            "cache": True, "ahead_tokens": 512,
            "cache_dir": str(data["root"] / "cache"), **over}


def _train(data, out, stream=None, hidden=()):
    return train_draft(list(hidden), data["vocab"], out / "checkpoint.safetensors", out / "metrics.csv",
                       head_path=data["head"], settings=train_settings(CONFIG), state_dir=out / "state", progress=False,
                       stream=stream)


@pytest.fixture(scope="module")
def files_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("files")
    storage = storage_dir(out / "states")
    with SeededStub(storage, 4, 128) as stub:
        shards = []
        for s, traces in enumerate(data["traces"]):
            shards.append(out / f"shard_{s}.safetensors")
            extract_hidden_vllm([traces], shards[-1], HiddenSettings.defaults().replace(max_length=64, concurrency=3,
                                                                                        max_retries=0),
                                url=stub.url, model="toy", head_path=data["head"], storage=storage, progress=False)
    _train(data, out, hidden=shards)
    return out, sum(p.stat().st_size for p in shards)


def _same(a, b):
    ta, tb = load_checkpoint(a / "checkpoint.safetensors")[0], load_checkpoint(b / "checkpoint.safetensors")[0]
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_stream_equals_files_bit_for_bit_within_the_budget(data, files_run, tmp_path):
    files_out, shards_bytes = files_run
    storage = storage_dir(tmp_path / "states")
    with SeededStub(storage, 4, 128) as stub:
        stats = _train(data, tmp_path, stream=_spec(data, stub, storage=str(storage)))
    assert _same(files_out, tmp_path)
    s = stats["stream"]
    assert 0 < s["peak_disk_bytes"] <= 200e3 < shards_bytes, (s, shards_bytes)
    # 16 steps of 256 tokens go over the ~1000 tokens more than once: what the cache held was read from it,
    # the rest asked for again
    assert s["from_cache"] > 0 and s["re_extracted"] > 0, s
    assert s["extracted"] == stub.requests and s["extracted"] + s["from_cache"] >= 40, s
    assert list(storage.iterdir()) == [] and not list((data["root"] / "cache").rglob("*.safetensors"))


def test_without_cache_every_later_read_is_re_extracted(data, files_run, tmp_path):
    storage = storage_dir(tmp_path / "states")
    with SeededStub(storage, 4, 128) as stub:
        stats = _train(data, tmp_path, stream=_spec(data, stub, storage=str(storage), cache=False))
    assert _same(files_run[0], tmp_path)
    assert stats["stream"]["from_cache"] == 0 and stats["stream"]["re_extracted"] > 0


def test_a_budget_below_one_request_file_is_refused_with_the_key(data, tmp_path):
    with SeededStub(storage_dir(tmp_path / "states"), 4, 128) as stub:
        with pytest.raises(ExtractError, match="hidden.stream.max_disk_gb"):
            _train(data, tmp_path, stream=_spec(data, stub, max_disk_gb=1e-6))
        assert stub.requests == 0


def test_a_dead_server_stops_training_with_its_url_and_the_rerun_resumes(data, files_run, tmp_path):
    storage = storage_dir(tmp_path / "states")
    # The server dies once the trainer has saved a state (not after a count of requests: how far the
    # prefetcher runs ahead of the optimizer depends on the machine's load)
    with SeededStub(storage, 4, 128, dead=lambda: any((tmp_path / "state").glob("step_*.pt"))) as stub:
        with pytest.raises(ExtractError, match=rf"extraction server at {stub.url} stopped answering.*rerun"):
            _train(data, tmp_path, stream=_spec(data, stub, storage=str(storage), cache=False))
    saved = sorted(p.name for p in (tmp_path / "state").glob("step_*.pt"))
    assert saved, "a state was saved before the server died"
    with SeededStub(storage, 4, 128) as stub:
        stats = _train(data, tmp_path, stream=_spec(data, stub, storage=str(storage), cache=False))
    assert stats["resumed_from"] and stats["resumed_from"] >= 4, stats
    assert _same(files_run[0], tmp_path)
    assert list(storage.iterdir()) == []


def _ddp_rank(rank, world, port, data, out, spec, config):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    train_draft([], data["vocab"], out / "checkpoint.safetensors", out / "metrics.csv", head_path=data["head"],
                settings=train_settings(config), state_dir=out / "state", progress=False, stream=spec)


def test_two_streaming_ranks_equal_one_process_accumulating_two(data, tmp_path):
    """Under torchrun each rank streams its own micro-batches (own request ids, cache, share of the budget)."""
    config = {**CONFIG, "max_steps": 4}
    storage = storage_dir(tmp_path / "states")
    port = free_port()
    with SeededStub(storage, 4, 128) as stub:
        spec = _spec(data, stub, storage=str(storage), cache_dir=str(tmp_path / "cache"))
        torch.multiprocessing.spawn(_ddp_rank, args=(2, port, data, tmp_path / "ddp", spec, config), nprocs=2)
        train_draft([], data["vocab"], tmp_path / "one/checkpoint.safetensors", tmp_path / "one/metrics.csv",
                    head_path=data["head"], settings=train_settings({**config, "grad_accum": 2}),
                    state_dir=tmp_path / "one/state", progress=False, stream=spec)
    a = load_checkpoint(tmp_path / "ddp" / "checkpoint.safetensors")[0]
    b = load_checkpoint(tmp_path / "one" / "checkpoint.safetensors")[0]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    assert list(storage.iterdir()) == []


class SlowStub(SeededStub):
    """Takes ``delay`` seconds over each request before it writes the file, as a real server that is
    still busy with a request when training stops."""

    def __init__(self, *args, delay, **kw):
        super().__init__(*args, **kw)
        self.delay = delay

    async def completions(self, request):
        await request.read()  # the request is in (aiohttp keeps the body for the handler below)
        await asyncio.sleep(self.delay)
        return await super().completions(request)


def _state_files(storage):
    return sorted(p.name for p in storage.iterdir() if not p.name.endswith(".lock"))


@pytest.mark.parametrize("drain", [True, False])
def test_closing_the_stream_mid_run_leaves_no_state_file_behind(data, tmp_path, monkeypatch, drain):
    """Training stops (max_steps, an error) with requests in flight: close() finishes them and deletes
    their files, so none lands after it. Dropping them instead (``drain`` False: no wait) leaves the files
    the server writes afterwards, which is what this test must see fail. A killed server's half-written
    ``.tmp`` of this process's requests is removed at the start."""
    monkeypatch.setattr(stream_mod, "DRAIN_SECONDS", 60 if drain else 0)
    storage = storage_dir(tmp_path / "states")
    half = storage / f"cmpl-{stream_mod.PREFIX}r0-7-0.safetensors.tmp"
    half.write_bytes(b"half a file")
    with SlowStub(storage, 4, 128, delay=0.4) as stub:
        states = open_stream(_spec(data, stub, storage=str(storage), cache_dir=str(tmp_path / "cache")))
        assert not half.exists()
        states.follow(range(len(states)))
        assert states[0]["aux_hidden"].shape[0] == states.length(0)
        time.sleep(0.1)  # the next requests are in flight
        states.close()
        left_at_close = _state_files(storage)
        time.sleep(1.0)  # what the server still writes after close() returned
        left_later = _state_files(storage)
    if drain:
        assert left_at_close == [] and left_later == [], (left_at_close, left_later)
    else:
        assert left_later, "requests dropped in flight still have their files written"
