"""Hidden states of the target over the exact trace tokens, for EAGLE-3 training: the transformers backend.

A transformers forward of the target runs over exactly the token ids of each training sequence of a shard
(``shards.shard_sequences``), batched by length, and writes the shard's rows in place as they come
(the shard's tensors and layout: ``shards``).

What training needs of the target's head is saved once, beside the shards, by
``target.save_target_head`` (the target itself, its loading and its aux-state capture live in
``target``).
"""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..settings import HiddenSettings
from ..util import progress_bar, say
from .preflight import estimate_bytes
from .shards import STORE_DTYPE, ShardWriter, check_free_disk, shard_layout, shard_sequences
from .target import AuxCapture, decoder_of, greedy_next, load_target, target_info

WRITERS = 4  # threads writing the rows of a shard in parallel
INFLIGHT = 3  # batches between the GPU and the disk at once (each in page-locked host memory on CUDA)
SYNC_BYTES = 1 << 28  # written bytes between two fdatasync calls of the shard during extraction


def _length_batches(lengths, batch_tokens):
    """Indices grouped by similar length so that len(batch) * longest <= batch_tokens (at least one)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


class _HostCopies:
    """A batch's states copied from the device to host memory. On CUDA into page-locked buffers by
    non-blocking copies on a side stream per device of the outputs (the last GPU of a target split
    over several), so they overlap the next batch's forward; an event marks them done."""

    def __init__(self, on_gpu):
        self.on_gpu = on_gpu
        self.streams = {}  # device -> its copy stream

    def copy(self, t, dtype=STORE_DTYPE):
        """``t`` in host memory as ``dtype`` (on CUDA: the copy under way, see ``done``)."""
        if not self.on_gpu:
            return t.to(dtype).cpu()
        host = torch.empty(t.shape, dtype=dtype, pin_memory=True)
        if t.device not in self.streams:
            self.streams[t.device] = torch.cuda.Stream(t.device)
        copy_stream = self.streams[t.device]
        copy_stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(copy_stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(copy_stream)  # not reused by the next forward before the copy is done
        return host

    def done(self, device):
        """An event the copies from ``device`` so far complete at (None off CUDA: they are done)."""
        if not self.on_gpu:
            return None
        event = torch.cuda.Event()
        event.record(self.streams[device])
        return event


class _ShardRows:
    """Writes the rows of a batch's sequences in place in the shard, from several threads at once
    (pwrite drops the GIL), and flushes written pages to disk every SYNC_BYTES while the target runs,
    so the final fsync has little left."""

    def __init__(self, writer: ShardWriter, seqs, offsets, bar):
        self.writer, self.seqs, self.offsets, self.bar = writer, seqs, offsets, bar
        self.unsynced, self.lock = 0, threading.Lock()

    def write(self, batch, positions, aux, last, nxt, done):
        """Write the sequences at ``positions`` of ``batch`` (one writer's share of a batch)."""
        if done is not None:
            done.synchronize()  # the batch's device -> host copies have landed
        n_tok = 0
        for b in positions:
            k = batch[b]
            _, ids_k, mask_k = self.seqs[k]
            row, n = int(self.offsets[k]), len(ids_k)
            self.writer.write_rows("aux_hidden", row, aux[b, :n])
            self.writer.write_rows("last_hidden", row, last[b, :n])
            self.writer.write_rows("input_ids", row, torch.from_numpy(ids_k))
            self.writer.write_rows("target_next", row, nxt[b, :n])
            self.writer.write_rows("loss_mask", row, torch.from_numpy(mask_k))
            n_tok += n
        self.bar.update(n_tok)
        with self.lock:
            self.unsynced += n_tok * self.writer.bytes_per_token
            flush = self.unsynced >= SYNC_BYTES
            if flush:
                self.unsynced = 0
        if flush:
            os.fdatasync(self.writer.fd)


def _batch_states(model, capture, aux_layers, seqs, batch, host: _HostCopies):
    """The target over the sequences ``batch`` (indices into ``seqs``, longest first) -> (aux [B, T, 3H],
    last [B, T, H], next tokens [B, T] int32, the event their host copies are done at)."""
    decoder, head = decoder_of(model), model.get_output_embeddings().weight
    first_device = model.get_input_embeddings().weight.device
    longest = len(seqs[batch[0]][1])
    ids = torch.zeros(len(batch), longest, dtype=torch.int64)  # right padding: causal attention
    for b, k in enumerate(batch):  # keeps real positions blind to the pads, so no mask needed
        ids[b, : len(seqs[k][1])] = torch.from_numpy(seqs[k][1])
    with torch.inference_mode():
        capture.states.clear()
        # pinned, so that the copy does not make the host wait for the previous batch's forward
        ids = ids.pin_memory().to(first_device, non_blocking=True) if host.on_gpu else ids.to(first_device)
        last = decoder(input_ids=ids, use_cache=False).last_hidden_state
        aux = torch.cat([capture.states[i].to(last.device) for i in aux_layers], dim=-1).to(STORE_DTYPE)
        device = last.device
        # the greedy next token from each position (pads included: batches are length-sorted)
        nxt = greedy_next(last.reshape(-1, last.shape[-1]), head).view(last.shape[:2]).to(device, torch.int32)
        aux, last, nxt = host.copy(aux), host.copy(last.to(STORE_DTYPE)), host.copy(nxt, torch.int32)
        return aux, last, nxt, host.done(device)  # aux, last and nxt all come from that device


def _write_shard(model, writer: ShardWriter, seqs, offsets, aux_layers, batch_tokens, bar):
    """Run the target over ``seqs`` in batches of about ``batch_tokens`` and write their rows into ``writer``,
    completed (``ShardWriter.finish``) or, on any error, removed.

    Device -> host: ``_HostCopies``; writer threads wait on each batch's event, then write its rows in
    place (``_ShardRows``): each batch is split over WRITERS threads by sequence; at most INFLIGHT
    batches are in host memory."""
    capture = AuxCapture(decoder_of(model), aux_layers)
    host = _HostCopies(model.get_input_embeddings().weight.device.type == "cuda")
    rows = _ShardRows(writer, seqs, offsets, bar)
    in_flight = []
    pool = ThreadPoolExecutor(WRITERS)
    try:
        writer.write_rows("seq_offsets", 0, torch.from_numpy(offsets))
        for batch in _length_batches([len(ids) for _, ids, _ in seqs], batch_tokens):
            aux, last, nxt, done = _batch_states(model, capture, aux_layers, seqs, batch, host)
            while len(in_flight) >= INFLIGHT:
                [f.result() for f in in_flight.pop(0)]
            shares = [list(range(len(batch)))[w::WRITERS] for w in range(min(WRITERS, len(batch)))]
            in_flight.append([pool.submit(rows.write, batch, share, aux, last, nxt, done) for share in shares])
        while in_flight:
            [f.result() for f in in_flight.pop(0)]
        bar.close()
        writer.finish()
    except BaseException:
        pool.shutdown()  # writes in flight end before the file descriptor is closed
        writer.abort()
        raise
    finally:
        pool.shutdown()
        capture.remove()


def extract_hidden(trace_paths, out_path, settings: HiddenSettings | None = None, *, progress=True,
                   model=None) -> dict:
    """Run the target over the trace tokens and write one hidden-state shard (format: module doc).

    ``settings.target`` is a transformers model directory or hub name (``model``, an already loaded
    target, skips loading); None: the schema's defaults. ``settings.dtype`` is the dtype the target runs
    in: bf16 matches what vLLM serves with ``--dtype auto`` (it downcasts fp32 checkpoints). Refuses with
    ``DiskSpaceError`` before any work when the disk is short. Returns counts, bytes and speed.
    """
    from transformers import AutoConfig

    s = settings or HiddenSettings.defaults()
    target, aux_layers, max_length, use_truncated = s.target, s.aux_layers, s.max_length, s.use_truncated
    batch_tokens, device, dtype = s.batch_tokens, s.device, s.dtype

    if isinstance(trace_paths, (str, Path)):
        trace_paths = [trace_paths]
    t_start = time.time()
    config = model.config if model is not None else AutoConfig.from_pretrained(target)
    info = target_info(config, aux_layers)
    aux_layers, hidden_size = info["aux_layers"], info["hidden_size"]

    # Pass 1: token ids only (4 bytes a token, far below the shard's 8*H), so the layout is known.
    seqs, counts = shard_sequences(trace_paths, max_length, use_truncated)
    n_cut = counts.pop("cut_at_max_length")
    specs, metadata, offsets = shard_layout(seqs, aux_layers=aux_layers, hidden_size=hidden_size, target=target,
                                            max_length=max_length)
    n_tokens = int(offsets[-1])
    needed = estimate_bytes(n_tokens, len(seqs), hidden_size, len(aux_layers))
    say(f"extract_hidden: {len(seqs)} sequences, {n_tokens} tokens -> {out_path}, about {needed / 2**30:.3f} GiB on disk")
    check_free_disk({Path(out_path).resolve().parent: needed}, out_path)

    if model is None:
        model = load_target(target, device=device, dtype=dtype)
    bar = progress_bar(total=n_tokens, unit="tok", desc=f"extract {Path(out_path).name}", disable=not progress)
    _write_shard(model, ShardWriter(out_path, specs, metadata), seqs, offsets, aux_layers, batch_tokens, bar)

    seconds = time.time() - t_start
    n_loss = sum(int(mask.sum()) for _, _, mask in seqs)
    stats = {
        **counts,
        "sequences": len(seqs),
        "cut_at_max_length": n_cut,
        "tokens": n_tokens,
        "loss_tokens": n_loss,
        "bytes": os.path.getsize(out_path),
        "bytes_per_token": os.path.getsize(out_path) / n_tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(n_tokens / seconds, 1),
        "aux_layers": aux_layers,
    }
    say(
        f"extract_hidden: {len(seqs)} sequences, {n_tokens} tokens ({n_loss} loss) in {seconds:.1f} s "
        f"({n_tokens / seconds:.0f} tok/s), {stats['bytes'] / 2**30:.3f} GiB -> {out_path}"
    )
    return stats
