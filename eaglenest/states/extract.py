"""Hidden states through vLLM (``hidden.backend: vllm``): the extraction server and its client.

The extraction server is the target served by vLLM a second time, with the ``extract_hidden_states``
speculative method recording the draft's aux layers plus the final layer (vLLM id
``num_hidden_layers``: the residual stream after the last layer, BEFORE the final norm), and a
connector (``vllm_connector.py``) that writes each request's states to a file in a mode-0700
directory. It is started and stopped by the same lifecycle code as the generation server
(``server.py`` / ``slurm.py``), with the same model, parallelism, dtype, environment and NCCL
variables (``hidden_server_config``).

``extract_hidden_vllm`` sends each training sequence's exact token ids (a single answer's ``prompt +
completion``, a conversation's chains of turns, ``data.sequences``; cut at ``hidden.max_length``: the same
sequences and loss masks as the transformers backend, ``shards.shard_sequences``)
to ``/v1/completions`` with ``max_tokens: 1``, ``hidden.vllm.concurrency`` requests in flight; reads the
per-request file, refuses it unless its token ids are those sent (naming the trace id), applies the
target's final RMSNorm to the final-layer state (the shard's ``last_hidden`` is post-norm, see
``hidden.py``), writes the rows at their place in the shard and deletes the file. Memory is bounded
by the requests in flight.

The shard's ``target_next`` (the target's greedy next token from each position) comes from the same
request: ``prompt_logprobs: 1`` makes vLLM return, for each prompt token i >= 1, the top-1 token of
the target's distribution at position i-1 (its logits, computed by vLLM's own head), and the one
token it generates (``temperature: 0``, ``return_token_ids``) is the greedy choice from the last
position. vLLM makes those prompt logits per request at once, beyond what its start-up memory profile
counts (one row of logits per sequence): about
``prompt tokens x vocabulary x 6`` bytes (model-dtype logits and float32 log-probs; 2 GB for 2048
tokens of a 163,840-token vocabulary), which ``hidden.vllm.gpu_memory_utilization`` must leave room for.

Crash safety: the shard is written in place under ``<shard>.partial`` (its layout is fixed by pass 1),
and each sequence whose rows are written is appended to ``<shard>.partial.done``. A rerun after
``kill -9`` or a dead server reopens the partial when its header is the same (same traces, layers,
settings), skips the finished sequences and sends only the rest; the shard is renamed into place once
every sequence is in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import EaglenestError
from ..serving.client import (CONNECTION_ERRORS, CONNECTION_LOST, RETRY_STATUSES, RetryPolicy, auth_hint,
                              describe_client_error, open_session, run_workers)
from ..serving.connector import read_states, remove_states
from ..serving.settings import ServerConfig
from ..serving.vllm import extraction_layer_ids, extraction_server_args
from ..settings import HiddenSettings
from ..util import open_locked, progress_bar, say
from ..vllm_facts import vllm_version
from .shards import ShardWriter, check_free_disk, shard_layout, shard_sequences
from .preflight import estimate_bytes, states_file_bytes
from .target import TargetFacts, load_target_head

BACKEND = "vllm"


class ExtractError(EaglenestError, RuntimeError):
    """A failure the user can fix (server down, wrong server, a file that does not match)."""


def layer_ids(facts: TargetFacts) -> list[int]:
    """The vLLM ids the extraction server records: the aux layers, then the final layer (pre-norm)."""
    return extraction_layer_ids(facts.aux_layers, facts.num_hidden_layers)


def hidden_server_config(server: ServerConfig, hidden: HiddenSettings, facts: TargetFacts, storage) -> ServerConfig:
    """The extraction server: the generation server's settings plus extraction mode.

    ``facts``: the target's (``target_head.json``); ``storage``: the directory the server writes into. It listens on ``hidden.vllm.port`` (its replica i on that port + i), or
    where that is null on a free port of the node it runs on (serving.port),
    with ``hidden.vllm.server_env`` on top of ``server.env`` and ``hidden.vllm.gpu_memory_utilization`` when set
    (where it shares GPUs with the trainer: ``hidden.mode: stream``).
    A sequence of ``hidden.max_length`` tokens plus the one token vLLM must generate has to fit
    ``max_model_len``; only the prompt is run through the model (the generated token never is), so
    going one past the model's own limit is safe here (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``). The
    extraction flags follow the vLLM release installed for ``server.python`` (``vllm_version``)."""
    cfg = server
    env = {**cfg.env, **{k: str(v) for k, v in hidden.server_env.items()}}
    max_len = cfg.max_model_len
    if max_len is not None and max_len <= hidden.max_length:
        max_len = hidden.max_length + 1
        env.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    return dataclasses.replace(
        cfg, port=hidden.port, max_model_len=max_len, reasoning_parser=None, env=env,
        gpu_memory_utilization=hidden.gpu_memory_utilization or cfg.gpu_memory_utilization,
        # hidden.vllm.gpu_memory_utilization is the extraction server's own share: a KV size would override it.
        kv_cache_gb=None if hidden.gpu_memory_utilization else cfg.kv_cache_gb,
        extra_args=extraction_server_args(layer_ids(facts), storage, cfg.extra_args, vllm_version(cfg.python)),
        # stream mode reads from one server, which may share the trainer's GPUs: no replicas there
        replicas=1 if hidden.mode == "stream" else cfg.replicas)


def extract_hidden_vllm(trace_paths, out_path, settings: HiddenSettings | None = None, *, url, model, head_path,
                        storage, api_key=None, progress=True) -> dict:
    """Write one hidden-state shard from the extraction server at ``url`` (format: ``hidden.py``).

    ``settings``: the sequences (max_length, use_truncated) and the client's concurrency, timeout and
    retries (None: the schema's defaults).
    ``head_path``: ``target_head.safetensors`` (final-norm weight, aux layers, sizes); ``storage``:
    the directory the server writes per-request files into (must be the one it was started with).
    Refuses (``DiskSpaceError``) before sending anything when the disk is short. Raises
    ``ExtractError`` when the server stops answering or returns states that do not match; the
    finished rows are kept for the rerun. Returns counts, bytes and speed."""
    s = settings or HiddenSettings.defaults()
    max_length, use_truncated, concurrency = s.max_length, s.use_truncated, s.concurrency
    if isinstance(trace_paths, (str, Path)):
        trace_paths = [trace_paths]
    t_start = time.time()
    out_path, storage = Path(out_path), Path(storage).resolve()
    client = StatesClient(url=url, model=model, storage=storage, head_path=head_path, request_timeout=s.request_timeout,
                          retry=RetryPolicy.from_settings(s), api_key=api_key)
    info, hidden_size, aux_layers = client.info, client.hidden_size, client.aux_layers

    seqs, counts = shard_sequences(trace_paths, max_length, use_truncated)
    specs, metadata, offsets = shard_layout(seqs, aux_layers=aux_layers, hidden_size=hidden_size,
                                            target=info.target or model, max_length=max_length,
                                            backend=BACKEND)
    n_tokens = int(offsets[-1])
    needed = estimate_bytes(n_tokens, len(seqs), hidden_size, len(aux_layers))
    longest = max(len(ids) for _, ids, _ in seqs)
    # per-request files in flight: [T, layers, H] at up to 4 bytes each
    staging = min(concurrency, len(seqs)) * client.file_bytes(longest)
    partial = out_path.with_name(out_path.name + ".partial")
    have = partial.stat().st_size if partial.is_file() else 0
    say(f"extract_hidden (vLLM at {client.url}): {len(seqs)} sequences, {n_tokens} tokens -> {out_path}, "
        f"about {needed / 2**30:.3f} GiB on disk (+{staging / 2**30:.3f} GiB of per-request files in {storage})")
    check_free_disk({Path(out_path).resolve().parent: needed - have, Path(storage): staging}, f"{out_path}",
                    "the shard and the per-request files of hidden.vllm.concurrency requests; free space, or lower "
                    "hidden.max_length or hidden.vllm.concurrency")

    writer = ShardWriter(out_path, specs, metadata, resume=True)
    run = _Run(seqs=seqs, offsets=offsets, writer=writer, client=client, concurrency=concurrency, progress=progress,
               shard=out_path.name.split(".")[0])
    try:
        run.open_journal()
    except BaseException:
        os.close(writer.fd)
        raise
    try:
        writer.write_rows("seq_offsets", 0, torch.from_numpy(offsets))
        asyncio.run(run.main())
    except BaseException:
        os.close(writer.fd)  # the partial and its journal stay: the rerun resumes from them
        run.close_journal()
        run.remove_orphans()
        raise
    writer.finish()
    run.close_journal(remove=True)
    run.remove_orphans()  # files of requests a killed earlier run left in flight
    seconds = time.time() - t_start
    size = os.path.getsize(out_path)
    stats = {**counts, "sequences": len(seqs), "tokens": n_tokens, "resumed": run.resumed,
             "sent": run.sent, "tokens_sent": run.tokens_sent,
             "loss_tokens": sum(int(mask.sum()) for _, _, mask in seqs), "bytes": size, "bytes_per_token": size / n_tokens,
             "seconds": round(seconds, 2), "tokens_per_s": round(run.tokens_sent / seconds, 1),
             "aux_layers": aux_layers, "backend": BACKEND}
    resumed = f", {run.resumed} resumed" if run.resumed else ""
    say(f"extract_hidden: {len(seqs)} sequences ({run.sent} sent{resumed}), {n_tokens} tokens in {seconds:.1f} s "
        f"({stats['tokens_per_s']:.0f} tok/s sent), {size / 2**30:.3f} GiB written -> {out_path}")
    return stats


def final_norm(x, weight, eps):
    """The target's final RMSNorm (Llama-style: ``weight * x / rms(x)``, computed in float32)."""
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class _Run:
    def __init__(self, *, seqs, offsets, writer, client, concurrency, progress, shard):
        self.seqs, self.offsets, self.writer = seqs, offsets, writer  # pass 1's sequences and layout
        self.client, self.concurrency, self.progress, self.shard = client, concurrency, progress, shard
        self.journal_path = writer.partial.with_name(writer.partial.name + ".done")
        self.done, self.resumed, self.sent, self.tokens_sent = set(), 0, 0, 0
        self.lock = threading.Lock()
        self.prefix = f"eaglenest-{shard}-"

    # -- the journal of finished sequences (one index per line, appended once its rows are written)

    def open_journal(self):
        fd = open_locked(self.journal_path, ExtractError(
            f"{self.shard}: another process is extracting into {self.writer.partial}; "
            "wait for it to finish (or stop it) before rerunning this shard"))
        self.journal = os.fdopen(fd, "r+b")
        keep = 0
        if self.writer.resumed:  # a fresh partial makes any old journal meaningless
            for line in self.journal:
                if not line.endswith(b"\n"):
                    break  # torn by kill -9: that sequence is sent again
                k = int(line)
                if 0 <= k < len(self.seqs):
                    self.done.add(k)
                keep += len(line)
        self.journal.truncate(keep)
        self.journal.seek(keep)
        self.resumed = len(self.done)

    def close_journal(self, remove=False):
        j = getattr(self, "journal", None)
        if j is not None and not j.closed:
            j.close()
        if remove:
            self.journal_path.unlink(missing_ok=True)

    def remove_orphans(self):
        """Per-request files of this shard whose client is gone (this run's failure, an earlier kill)."""
        self.client.remove_orphans(self.prefix)

    # -- sending ----------------------------------------------------------------------------

    async def main(self):
        self.remove_orphans()
        todo = [k for k in range(len(self.seqs)) if k not in self.done]
        self.pbar = progress_bar(total=int(self.offsets[-1]), initial=sum(len(self.seqs[k][1]) for k in self.done),
                                 unit="tok", desc=f"extract {self.shard}", disable=not self.progress)
        self.pool = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)))
        try:
            async with self.client.session(self.concurrency) as session:
                loop = asyncio.get_running_loop()

                async def fetch(k):
                    path, nxt = await self._request(session, k)
                    await loop.run_in_executor(self.pool, self._store, k, path, nxt)

                await run_workers(todo, fetch, self.concurrency)
        finally:
            self.pool.shutdown(wait=True)  # a row write in flight ends before the file is closed
            self.pbar.close()

    async def _request(self, session, k):
        rid, ids, _ = self.seqs[k]
        kept = (f"{len(self.done)} of {len(self.seqs)} finished sequences are kept in {self.writer.partial}; "
                "restart the server and rerun")
        return await self.client.request(session, rid, ids, f"{self.prefix}{k}", where=self.shard,
                                         sent=self.sent, kept=kept)  # (path, target_next)

    def _store(self, k, path, nxt):
        rid, ids, mask = self.seqs[k]
        kept = f"{len(self.done)} finished sequences are kept in {self.writer.partial}; restart the server and rerun"
        aux, last = self.client.states(path, rid, ids, where=self.shard, kept=kept)
        n = len(ids)
        row, w = int(self.offsets[k]), self.writer
        w.write_rows("aux_hidden", row, aux)
        w.write_rows("last_hidden", row, last)
        w.write_rows("input_ids", row, torch.from_numpy(ids))
        w.write_rows("target_next", row, nxt)
        w.write_rows("loss_mask", row, torch.from_numpy(mask))
        with self.lock:  # after the rows: a kill between the two only sends this sequence again
            self.journal.write(b"%d\n" % k)
            self.journal.flush()
            self.done.add(k)
            self.sent += 1
            self.tokens_sent += n
            self.pbar.update(n)


class StatesClient:
    """Requests one sequence's states from the extraction server and reads them back, as the shard
    holds them: the aux layers concatenated and the final layer through the target's final norm (bf16).

    Shared by the shard writer (``extract_hidden_vllm``) and stream-mode training (``stream.py``), so
    both train on the same numbers. Errors name the server's URL, ``where`` (a shard, or training) and
    ``kept`` (what is kept and what to do)."""

    def __init__(self, *, url, model, storage, head_path, request_timeout, retry: RetryPolicy, api_key):
        head, info = load_target_head(head_path)
        # ``url``: one server's base URL, or the replicas' (server.replicas), which share the requests
        self.urls = [u.rstrip("/") for u in ([url] if isinstance(url, str) else url)]
        self.url, self.model, self.storage = ", ".join(self.urls), model, Path(storage).resolve()
        self.in_flight, self.down = dict.fromkeys(self.urls, 0), set()
        self.ids_wanted, self.hidden_size = layer_ids(info), int(info.hidden_size)
        self.aux_layers = self.ids_wanted[:-1]
        self.norm = (head["norm.weight"].float(), float(info.rms_norm_eps))
        self.info = info
        self.request_timeout, self.retry, self.api_key = request_timeout, retry, api_key

    def session(self, concurrency):
        """The session for ``concurrency`` requests in flight (enter it in the running loop)."""
        return open_session(self.api_key, concurrency, self.request_timeout)

    def file_bytes(self, n_tokens):
        """The most one per-request file of ``n_tokens`` takes on disk (``states_file_bytes``)."""
        return states_file_bytes(n_tokens, len(self.ids_wanted), self.hidden_size)

    async def request(self, session, rid, ids, prefix, *, where, sent, kept):
        """Send the token ids ``ids`` (trace ``rid``); return ``(path of the per-request file,
        target_next int32 [n])`` (``greedy_tokens``)."""
        body = {"model": self.model, "prompt": ids.tolist(), "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 1, "return_token_ids": True}
        attempt = 0
        while attempt <= self.retry.max_retries:
            attempt += 1
            req_id = f"{prefix}-{uuid.uuid4().hex[:8]}"
            retry_after = None
            url = self.pick()
            self.in_flight[url] += 1
            try:
                async with session.post(url + "/v1/completions", json=body,
                                        headers={"X-Request-Id": req_id}) as r:
                    raw = await r.read()
                    if r.status == 200:
                        answer = await r.json(content_type=None)
                        break
                    what = f"HTTP {r.status}: {raw[:500].decode('utf-8', 'replace')}"
                    retry_after = r.headers.get("Retry-After")
                    if r.status in (401, 403):
                        raise ExtractError(f"{where}: the extraction server at {self.url} refused the "
                                           f"request ({what}){auth_hint(r.status, self.api_key)}")
                    if r.status not in RETRY_STATUSES:
                        raise ExtractError(f"{where}: the extraction server at {self.url} refused trace "
                                           f"{rid!r} ({len(ids)} tokens): {what}")
            except CONNECTION_ERRORS as e:
                what = describe_client_error(e, self.request_timeout, "hidden.vllm.request_timeout")
                if isinstance(e, CONNECTION_LOST) and self.drop(url, what, where):
                    attempt -= 1  # another replica serves: this attempt does not count
                    continue
            finally:
                self.in_flight[url] -= 1
            if attempt == self.retry.max_retries + 1:
                raise ExtractError(
                    f"{where}: the extraction server at {self.url} stopped answering ({what}) after "
                    f"{sent} sequences sent by this run; {kept}")
            await asyncio.sleep(self.retry.delay(attempt, retry_after))
        path = ((answer.get("kv_transfer_params") or {}) if isinstance(answer, dict) else {}).get("hidden_states_path")
        if not path:
            raise ExtractError(f"{where}: the server at {self.url} answered trace {rid!r} without "
                               "kv_transfer_params.hidden_states_path: it is not an extraction server "
                               "(hidden.backend: vllm needs the one the workflow starts, see hidden_server.ready)")
        path = Path(path).resolve()
        if path.parent != self.storage:
            raise ExtractError(f"{where}: the server at {self.url} wrote trace {rid!r}'s states to {path}, "
                               f"outside {self.storage}, the directory this workflow gave it; refusing to read it")
        try:
            nxt = greedy_tokens(answer, len(ids))
        except ValueError as e:
            remove_states(path)
            raise ExtractError(f"{where}: the extraction server at {self.url} answered trace {rid!r} "
                               f"({len(ids)} tokens) without the target's greedy tokens: {e}; it must be a vLLM "
                               "that answers prompt_logprobs and return_token_ids (the one the workflow starts, "
                               "see hidden_server.ready)") from None
        return path, nxt

    def pick(self) -> str:
        """The replica with the fewest requests in flight among those still serving (all down: any)."""
        serving = [u for u in self.urls if u not in self.down] or self.urls
        return min(serving, key=self.in_flight.__getitem__)

    def drop(self, url, what, where) -> bool:
        """Drop a replica that lost its connection, with a warning; True while others still serve."""
        if len(self.urls) == 1:
            return False
        if url not in self.down:
            self.down.add(url)
            say(f"WARNING: {where}: the extraction replica at {url} stopped answering ({what}): dropped, "
                f"its requests go to the {len(self.urls) - len(self.down)} others")
        return len(self.down) < len(self.urls)

    def states(self, path, rid, ids, *, where, kept):
        """``(aux bf16 [n, 3H], last bf16 [n, H])`` of the file at ``path``, which is deleted."""
        try:
            try:
                data = read_states(path)
            except FileNotFoundError:
                raise ExtractError(f"{where}: the extraction server at {self.url} answered trace {rid!r} "
                                   f"but never wrote {path} (did it die?); {kept}") from None
            got = data["token_ids"]
            if got.shape != (len(ids),) or not torch.equal(got.long(), torch.from_numpy(ids)):
                raise ExtractError(
                    f"{where}: trace {rid!r}: the extraction server returned states for other tokens "
                    f"than those sent ({len(ids)} sent, {got.numel()} returned, first difference at "
                    f"{_first_difference(got, ids)}) in {path}; is prefix caching or chunked prefill on? "
                    f"Restart the extraction server and rerun")
            states = data["hidden_states"]  # [T, layers, H]
            if tuple(states.shape) != (len(ids), len(self.ids_wanted), self.hidden_size):
                raise ExtractError(
                    f"{where}: trace {rid!r}: {path} holds hidden_states {list(states.shape)}, expected "
                    f"{[len(ids), len(self.ids_wanted), self.hidden_size]} (layers {self.ids_wanted}): the "
                    f"server was started for other layers; stop it and rerun")
        finally:
            remove_states(path)
        n = len(ids)
        aux = states[:, :-1].reshape(n, -1).to(torch.bfloat16)
        last = final_norm(states[:, -1], *self.norm).to(torch.bfloat16)
        return aux, last

    def remove_orphans(self, prefix):
        """Per-request files whose request id starts with ``prefix`` (their client is gone), and the
        ``.tmp`` of a write a killed server left half done."""
        for p in glob.glob(str(self.storage / (glob.escape(prefix) + "*"))) + \
                glob.glob(str(self.storage / ("cmpl-" + glob.escape(prefix) + "*"))):
            if p.endswith(".safetensors"):
                remove_states(p)
            elif p.endswith(".safetensors.tmp"):
                remove_states(p[: -len(".tmp")])


def greedy_tokens(answer, n) -> torch.Tensor:
    """The target's greedy next token from each of the ``n`` prompt positions (int32 [n]), from
    vLLM's ``/v1/completions`` answer to ``prompt_logprobs: 1, return_token_ids: true, max_tokens: 1,
    temperature: 0``: ``prompt_logprobs[i]`` (i >= 1; entry 0 is null) maps token ids (JSON keys) to
    ``{"logprob", "rank", ...}`` and holds the prompt token i and the top-1 at position i-1 (rank 1;
    on a tie of several rank-1 tokens the smallest id, as ``argmax`` takes); the generated token
    (``token_ids``) is the greedy choice from the last position. ``ValueError`` says what is missing."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    entries, generated = choice.get("prompt_logprobs"), choice.get("token_ids")
    if not isinstance(entries, list) or len(entries) != n:
        got = f"{len(entries)} entries" if isinstance(entries, list) else repr(entries)[:80]
        raise ValueError(f"choices[0].prompt_logprobs is {got}, expected {n} entries")
    if not isinstance(generated, list) or len(generated) != 1:
        raise ValueError(f"choices[0].token_ids is {repr(generated)[:80]}, expected the one generated token")
    out = torch.empty(n, dtype=torch.int32)
    for i in range(1, n):
        entry = entries[i]
        top = [int(t) for t, lp in entry.items() if lp.get("rank") == 1] if isinstance(entry, dict) else []
        if not top:
            raise ValueError(f"choices[0].prompt_logprobs[{i}] has no rank-1 token: {repr(entry)[:200]}")
        out[i - 1] = min(top)
    out[n - 1] = int(generated[0])
    return out


def _first_difference(got, ids):
    got = got.tolist()
    for i, (a, b) in enumerate(zip(got, ids.tolist())):
        if a != b:
            return f"position {i}: {a} returned, {b} sent"
    return f"position {min(len(got), len(ids))} (lengths differ)"
