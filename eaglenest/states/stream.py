"""Hidden states streamed from the extraction server while the draft trains (``hidden.mode: stream``).

``StreamedStates`` stands where ``shards.HiddenShards`` stands in ``train.py``: ``len()`` sequences,
``length(k)``, ``[k]`` -> the rows of sequence k. Its sequences are the traces' (``shards.shard_sequences``
of each trace shard, in shard order: exactly the sequences, and the indices, of the shards files mode
would write), so their lengths, hence the batch plan, are known without any hidden state. Training
hands it the order in which it will read the sequences (``follow``); a background thread then asks
the server for the states of the upcoming sequences, up to ``ahead_tokens`` tokens ahead of the
reader and ``concurrency`` requests in flight, and turns each per-request file (and the answer's
greedy tokens, ``target_next``) into rows with the same ``StatesClient`` the shard writer uses (same
checks, same final norm, same bf16 numbers), so stream mode trains on the numbers files mode would
have read from the shards.

Disk: the per-request files (deleted once read) and the optional cache of extracted sequences
(``cache_dir``, reused when a later epoch reads a sequence again instead of asking the server)
together never exceed ``max_disk_bytes``: a request is sent only when its file's largest possible
size fits beside the files in flight and the cache, and the cache keeps room for ``concurrency`` of
the longest sequence's files (or half the budget where that is less; at least one file). The cache lives for one run (a rerun starts it empty).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from ..serving.client import RetryPolicy
from .extract import ExtractError, StatesClient
from .shards import shard_sequences

PREFIX = "eaglenest-stream-"  # request ids of stream mode's requests (and their per-request files)
DRAIN_SECONDS = 60  # close() waits this long at most for the requests in flight


class StreamedStates:
    """Sequences of ``trace_paths``, their states from the extraction server (see the module doc)."""

    def __init__(self, trace_paths, *, client: StatesClient, max_length, use_truncated, concurrency, ahead_tokens,
                 max_disk_bytes, cache_dir=None, prefix=PREFIX):
        self.paths = [Path(p) for p in trace_paths]  # what the data is: named in errors and the fingerprint
        self.client, self.concurrency, self.ahead_tokens = client, int(concurrency), int(ahead_tokens)
        self.max_length, self.use_truncated = max_length, use_truncated
        self.aux_layers, self.hidden_size = client.aux_layers, client.hidden_size
        self.without_target_next = []  # the client always brings the target's greedy tokens
        self.seqs = []  # (sequence id, ids int64 [n], loss_mask bool [n]), in the order of files mode's shards
        for path in self.paths:
            self.seqs += shard_sequences([path], max_length, use_truncated)[0]
        self.budget = int(max_disk_bytes)
        longest = max(len(ids) for _, ids, _ in self.seqs)
        self.longest_file = client.file_bytes(longest)
        if self.longest_file > self.budget:
            raise ExtractError(
                f"hidden.stream.max_disk_gb ({self.budget / 1e9:g} GB) is below the per-request file of the longest "
                f"sequence ({longest} tokens: up to {self.longest_file / 1e9:.4g} GB); raise hidden.stream.max_disk_gb "
                f"or lower hidden.max_length")
        # the cache may take what the requests in flight do not need: room for hidden.vllm.concurrency of
        # the longest files, or half the budget where that is less (and at least one such file)
        self.cache_limit = self.budget - max(self.longest_file, min(self.concurrency * self.longest_file, self.budget // 2))
        self.cache_dir = Path(cache_dir) if cache_dir else None
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)  # a killed run's cache: this run starts empty
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix  # of this process's request ids: its per-request files are its own
        client.remove_orphans(prefix)  # files of requests a killed earlier run left in flight
        self.cached = {}  # k -> bytes on disk
        self.cached_bytes = 0
        self.in_flight_bytes = 0
        self.peak_bytes = 0
        self.counts = {"extracted": 0, "extracted_tokens": 0, "re_extracted": 0, "re_extracted_tokens": 0,
                       "from_cache": 0, "from_cache_tokens": 0}
        self.seen = set()
        self.ready = {}  # position in the followed order -> (k, rows or None: read it from the cache)
        self.consumed = 0  # positions handed to the reader
        self.outstanding_tokens = 0  # tokens requested or ready but not yet read
        self.cond = threading.Condition()
        self.error = None
        self.stopping = threading.Event()
        self.thread = None
        self.t_wait = 0.0  # seconds the reader waited for states

    # -- what HiddenShards offers (source.StateSource)

    def __len__(self):
        return len(self.seqs)

    def length(self, k):
        return len(self.seqs[k][1])

    def __getitem__(self, k):
        """The rows of sequence k; the reader must ask in the order given to ``follow``."""
        t0 = time.monotonic()
        with self.cond:
            pos = self.consumed
            while pos not in self.ready and self.error is None:
                if self.thread is None or not self.thread.is_alive():
                    raise RuntimeError("stream: the fetch thread ended before the states of a followed sequence came")
                self.cond.wait(timeout=1.0)
            if pos not in self.ready:
                raise self.error
            got, rows = self.ready.pop(pos)
            self.consumed += 1
        self.t_wait += time.monotonic() - t0
        if got != k:
            raise RuntimeError(f"stream: sequence {k} read where the followed order has {got} (a bug: the reader and "
                               "the plan disagree)")
        if rows is None:
            from safetensors.torch import load_file

            rows = load_file(str(self._cache_path(k)))
        _, ids, mask = self.seqs[k]
        with self.cond:
            self.outstanding_tokens -= len(ids)
            self.cond.notify_all()
        return {"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask), **rows}

    def fingerprint_facts(self):
        """What the data is, for train.py's resume fingerprint: the traces (name, size, modification
        time, as for shards), the cut, and the layers the server records."""
        return {"traces": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in self.paths],
                "max_length": self.max_length, "use_truncated": self.use_truncated,
                "layer_ids": self.client.ids_wanted, "model": self.client.model}

    # -- fetching ahead

    def follow(self, order):
        """Start fetching the states of the sequences ``order`` (an iterable of indices, repeats allowed)."""
        self.thread = threading.Thread(target=self._run, args=(iter(order),), name="stream-fetch", daemon=True)
        self.thread.start()

    def close(self):
        """Stop fetching: the requests in flight are finished and their files read and deleted (a request
        dropped instead would still have its file written by the server, after the clean-up below), then
        the files of this process's requests and the cache are removed."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=DRAIN_SECONDS + 30)
        self.client.remove_orphans(self.prefix)
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)

    def summary(self):
        c = self.counts
        return (f"stream: {c['extracted']} sequences extracted ({c['extracted_tokens']} tokens), of which "
                f"{c['re_extracted']} re-extracted ({c['re_extracted_tokens']} tokens); {c['from_cache']} read from "
                f"the cache ({c['from_cache_tokens']} tokens); peak disk {self.peak_bytes / 1e6:.3f} MB of "
                f"hidden.stream.max_disk_gb {self.budget / 1e6:.3f} MB; the reader waited {self.t_wait:.1f} s for states")

    def _cache_path(self, k):
        return self.cache_dir / f"{k}.safetensors"

    def _account(self, delta_flight=0):
        with self.cond:
            self.in_flight_bytes += delta_flight
            self.peak_bytes = max(self.peak_bytes, self.in_flight_bytes + self.cached_bytes)

    def _run(self, order):
        try:
            asyncio.run(self._main(order))
        except BaseException as e:  # handed to the reader, which raises it
            with self.cond:
                self.error = e if isinstance(e, ExtractError) else RuntimeError(f"stream: fetching states failed: {e!r}")
                self.cond.notify_all()

    async def _wait_until(self, ok, tasks):
        """Wait until ``ok()``; a failed request among ``tasks`` raises here (finished ones are dropped)."""
        while True:
            for t in [t for t in tasks if t.done()]:
                tasks.discard(t)
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()
            if ok():
                return
            if self.stopping.is_set():
                raise asyncio.CancelledError
            await asyncio.sleep(0.005)

    async def _main(self, order):
        loop = asyncio.get_running_loop()
        tasks = set()
        async with self.client.session(self.concurrency) as session:
            try:
                for pos, k in enumerate(order):
                    n = self.length(k)
                    # room ahead of the reader (at least one sequence, however long)
                    await self._wait_until(lambda: self.outstanding_tokens == 0
                                           or self.outstanding_tokens + n <= self.ahead_tokens, tasks)
                    with self.cond:
                        self.outstanding_tokens += n
                    if k in self.cached:
                        self.counts["from_cache"] += 1
                        self.counts["from_cache_tokens"] += n
                        self._put(pos, k, None)
                        continue
                    need = self.client.file_bytes(n)
                    await self._wait_until(lambda: len(tasks) < self.concurrency and
                                           self.in_flight_bytes + self.cached_bytes + need <= self.budget, tasks)
                    self._account(need)
                    tasks.add(asyncio.ensure_future(self._fetch(session, loop, pos, k, need)))
                await self._wait_until(lambda: not tasks, tasks)
            finally:
                if tasks and self.stopping.is_set():  # close(): finish them, so no file lands after it
                    await asyncio.wait(tasks, timeout=DRAIN_SECONDS)
                for t in list(tasks):
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _fetch(self, session, loop, pos, k, need):
        rid, ids, _ = self.seqs[k]
        kept = ("the training state saved every train.save_every steps is kept: rerun the workflow (it restarts "
                "the extraction server) and training resumes from its last saved step")
        try:
            path, nxt = await self.client.request(session, rid, ids, f"{self.prefix}{k}",
                                                  where="train_draft (hidden.mode: stream)",
                                                  sent=self.counts["extracted"], kept=kept)
            aux, last = await loop.run_in_executor(None, lambda: self.client.states(
                path, rid, ids, where="train_draft (hidden.mode: stream)", kept=kept))
        finally:
            self._account(-need)  # the per-request file is gone (read and deleted, or never written)
        n = len(ids)
        self.counts["extracted"] += 1
        self.counts["extracted_tokens"] += n
        if k in self.seen:
            self.counts["re_extracted"] += 1
            self.counts["re_extracted_tokens"] += n
        self.seen.add(k)
        rows = {"aux_hidden": aux, "last_hidden": last, "target_next": nxt}
        if self.cache_dir is not None:
            size = (aux.numel() + last.numel()) * 2 + nxt.numel() * 4 + 4096
            with self.cond:
                room = self.cached_bytes + size <= self.cache_limit
                if room:
                    self.cached[k] = size  # counted before it is written: the peak stays an upper bound
                    self.cached_bytes += size
            if room:
                from safetensors.torch import save_file

                await loop.run_in_executor(None, lambda: save_file(rows, str(self._cache_path(k))))
                self._account()
        self._put(pos, k, rows)

    def _put(self, pos, k, rows):
        with self.cond:
            self.ready[pos] = (k, rows)
            self.cond.notify_all()


STREAM_KEYS = ("max_length", "use_truncated", "concurrency", "request_timeout", "max_retries", "backoff_base",
               "backoff_max", "max_disk_gb", "cache")


def stream_spec(hidden, *, traces, ready: dict, head, server: dict, batch_tokens: int, cache_dir) -> dict:
    """``open_stream``'s plain settings (JSON, so torchrun's processes get them too) from the
    ``HiddenSettings``, the extraction server's sentinel (``ready``: url, model, states_dir) and the
    training batch size (the stream runs ``hidden.stream.stream_ahead`` batches ahead)."""
    return {"traces": list(traces), "url": ready["urls"][0], "model": ready["model"], "head": str(head),
            "storage": ready["states_dir"], "server": server, **{k: getattr(hidden, k) for k in STREAM_KEYS},
            "ahead_tokens": hidden.stream_ahead * batch_tokens, "cache_dir": str(cache_dir)}


def open_stream(spec: dict) -> StreamedStates:
    """A ``StreamedStates`` from plain settings (JSON: what the rule passes, also through torchrun):
    ``traces``, ``url``, ``model``, ``head``, ``storage``, ``server`` (the config section: the API key), the HiddenSettings
    ``max_length``, ``use_truncated``, ``concurrency``, ``request_timeout``, ``max_retries``, ``backoff_base``, ``backoff_max``,
    ``max_disk_gb``, ``cache`` (``hidden:``, ``hidden.vllm``, ``hidden.stream``), plus ``ahead_tokens`` and ``cache_dir``."""
    from ..serving.settings import ServerConfig

    api_key = ServerConfig.from_dict(spec["server"]).api_key()
    # under torchrun each process fetches its own batches: the budget is split, each has its own
    # cache and request ids
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    client = StatesClient(url=spec["url"], model=spec["model"], storage=spec["storage"], head_path=spec["head"],
                          request_timeout=spec["request_timeout"], api_key=api_key,
                          retry=RetryPolicy(spec["max_retries"], spec["backoff_base"], spec["backoff_max"]))
    return StreamedStates(spec["traces"], client=client, max_length=spec["max_length"],
                          use_truncated=spec["use_truncated"], concurrency=spec["concurrency"],
                          ahead_tokens=spec["ahead_tokens"], max_disk_bytes=float(spec["max_disk_gb"]) * 1e9 / world,
                          cache_dir=f"{spec['cache_dir']}/rank{rank}" if spec.get("cache") else None,
                          prefix=f"{PREFIX}r{rank}-")
