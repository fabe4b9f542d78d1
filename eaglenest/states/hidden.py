"""Hidden states of the target over the exact trace tokens, for EAGLE-3 training.

A transformers forward of the target runs over exactly the token ids of each training sequence of the
trace records (``data.sequences``: a single answer's ``prompt_token_ids + completion_token_ids``, a
conversation's chains of turns; no re-templating), cut at ``max_length``. Each shard is one safetensors file,
sequences packed end to end along the token axis (T = all kept tokens of the shard):

    aux_hidden   bf16  [T, 3*H]  the auxiliary states at the vLLM ids in ``aux_layers`` (ascending,
                                 concatenated in that order: exactly the input of the draft's ``fc``)
    last_hidden  bf16  [T, H]    the target's last hidden state AFTER its final norm, so the target's
                                 distribution at a position is ``softmax(lm_head(last_hidden))``;
                                 storing it post-norm makes that exact for any final-norm flavour
    input_ids    int64 [T]
    target_next  int32 [T]       the target's greedy next token (a target-vocabulary id) predicted from
                                 each position: the argmax of ``lm_head(last_hidden)`` there, computed
                                 where the target runs so that training never multiplies by the full
                                 target vocabulary (``targets.target_distribution``); at a sequence's
                                 last position it is the token the target would generate next
    seq_offsets  int64 [S + 1]   sequence k is rows ``seq_offsets[k]:seq_offsets[k+1]``
    loss_mask    bool  [T]       True on the assistant's tokens (each turn's completion, reasoning
                                 included), False on system, user and tool tokens

The ``__metadata__`` holds ``format``, ``aux_layers`` (JSON), ``hidden_size``, ``target`` and counts.
Shards written before ``target_next`` existed lack it and are still read (training then takes
the argmax over the full vocabulary itself, as it did, see ``train``). A shard costs ``8*H + 13``
bytes per token (plus 8 per sequence); it is written in place (header first, then each batch's rows
at their offsets) so it is never held whole in memory, under a ``.partial`` name that is renamed
once complete. Readers use ``safe_open`` (memory-mapped).

What training needs of the target's head is saved once, beside the shards, by
``target.save_target_head`` (the target itself, its loading and its aux-state capture live in
``target``). Training reads the shards and the head only while it runs: the shards may be deleted (Snakemake ``temp()``) once it finishes.
"""

import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..data.sequences import read_training_sequences
from ..errors import DiskSpaceError, TraceRecordError
from ..settings import HiddenSettings
from ..util import progress_bar, say
from .preflight import estimate_bytes
from .target import AuxCapture, decoder_of, greedy_next, load_target, target_info

FORMAT = "eaglenest.hidden/1"
STORE_DTYPE = torch.bfloat16
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64", torch.int32: "I32",
             torch.bool: "BOOL"}
WRITERS = 4  # threads writing the rows of a shard in parallel
INFLIGHT = 3  # batches between the GPU and the disk at once (each in page-locked host memory on CUDA)
SYNC_BYTES = 1 << 28  # written bytes between two fdatasync calls of the shard during extraction


# ----------------------------------------------------------------------------- trace records


def shard_sequences(trace_paths, max_length, use_truncated=True):
    """The sequences of one shard, in trace order: ``(seqs, counts)`` with ``seqs`` a list of
    ``(sequence id, ids int64 [n], loss_mask bool [n])``, the training sequences of the trace records
    (``data.sequences``: a conversation's assistant turns all scored) cut at ``max_length``; ``counts``
    as in ``read_training_sequences`` plus ``cut_at_max_length``. Every backend packs exactly these."""
    counts = {"cut_at_max_length": 0}
    seqs = []
    for sid, ids, spans in read_training_sequences(trace_paths, use_truncated, counts):
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.bool_)
        for start, end in spans:
            mask[start:end] = True
        if len(ids) > max_length:
            counts["cut_at_max_length"] += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if not mask.any():  # the cut left no scored token
            counts["skipped_empty"] += 1
            continue
        seqs.append((sid, ids, mask))
    if not seqs:
        raise TraceRecordError(f"no usable trace records in {[str(p) for p in trace_paths]} ({counts}): no "
                               "answer token to train on within hidden.max_length (and, with hidden.use_truncated "
                               "false, untruncated)")
    return seqs, counts


def shard_layout(seqs, *, aux_layers, hidden_size, target, max_length, **extra_metadata):
    """``(specs, metadata, offsets)`` of the shard holding ``seqs`` (see the module doc)."""
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([len(ids) for _, ids, _ in seqs], out=offsets[1:])
    n_tokens = int(offsets[-1])
    specs = {
        "aux_hidden": (STORE_DTYPE, (n_tokens, len(aux_layers) * hidden_size)),
        "last_hidden": (STORE_DTYPE, (n_tokens, hidden_size)),
        "input_ids": (torch.int64, (n_tokens,)),
        "target_next": (torch.int32, (n_tokens,)),
        "seq_offsets": (torch.int64, (len(seqs) + 1,)),
        "loss_mask": (torch.bool, (n_tokens,)),
    }
    metadata = {
        "format": FORMAT,
        "target": str(target),
        "aux_layers": json.dumps(list(aux_layers)),
        "hidden_size": hidden_size,
        "last_hidden": "post_norm",
        "num_seqs": len(seqs),
        "num_tokens": n_tokens,
        "max_length": max_length,
        **extra_metadata,
    }
    return specs, metadata, offsets


# ----------------------------------------------------------------------------- shard writing


def check_free_disk(needs: dict, what, hint="free space or lower max_length") -> None:
    """Raise DiskSpaceError unless each filesystem has room for what goes there: ``needs`` maps a
    directory to the bytes that will be written under it, summed where directories share one."""
    wants = {}
    for where, want in needs.items():
        where = Path(where)
        where.mkdir(parents=True, exist_ok=True)
        first, total = wants.get(os.stat(where).st_dev, (where, 0))
        wants[os.stat(where).st_dev] = (first, total + max(0, want))
    for where, want in wants.values():
        free = shutil.disk_usage(where).free
        if free < want:
            raise DiskSpaceError(
                f"not enough free disk for {what}: needs {want:,} bytes ({want / 2**30:.2f} GiB) in {where}, "
                f"{free:,} bytes ({free / 2**30:.2f} GiB) free; {hint}")


class ShardWriter:
    """A safetensors file whose header is written first and whose tensor rows are written in place."""

    def __init__(self, path, specs, metadata, resume=False):
        # specs: name -> (torch dtype, shape); the file is laid out in the order given.
        # resume: reopen a `.partial` left by a killed run when its header is this one (same layout
        # and metadata), keeping the rows already written; ``self.resumed`` says whether it did.
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        header, self.offsets, self.row_bytes, pos = {}, {}, {}, 0
        for name, (dtype, shape) in specs.items():
            nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            self.offsets[name] = pos
            self.row_bytes[name] = nbytes // shape[0] if shape[0] else 0
            pos += nbytes
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
        self.data_start = 8 + len(text)
        self.size = self.data_start + pos
        n_rows = max(1, specs[next(iter(specs))][1][0])
        self.bytes_per_token = pos / n_rows
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        head = len(text).to_bytes(8, "little") + text
        self.resumed = False
        if resume and self.partial.is_file() and self.partial.stat().st_size == self.size:
            with open(self.partial, "rb") as f:
                self.resumed = f.read(len(head)) == head
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | (0 if self.resumed else os.O_TRUNC), 0o644)
        if not self.resumed:
            os.pwrite(self.fd, head, 0)
            os.ftruncate(self.fd, self.size)

    def write_rows(self, name, row, tensor):
        """Write ``tensor`` (CPU, contiguous) as rows ``row:row+len(tensor)`` of tensor ``name``."""
        t = tensor.contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)  # numpy has no bfloat16; the bytes are what matter
        buf = memoryview(t.numpy()).cast("B")
        off = self.data_start + self.offsets[name] + row * self.row_bytes[name]
        while buf:
            n = os.pwrite(self.fd, buf, off)
            buf, off = buf[n:], off + n

    def finish(self):
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.partial, self.path)

    def abort(self):
        os.close(self.fd)
        self.partial.unlink(missing_ok=True)


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


# ----------------------------------------------------------------------------- shard reading


class HiddenShards:
    """Memory-mapped read access to one or more shards: ``len()`` sequences, ``[k]`` -> dict of rows
    (a ``source.StateSource``).

    The rows hold ``target_next`` only when every shard has it (``without_target_next`` lists the
    shards written before it existed)."""

    def __init__(self, paths):
        from safetensors import safe_open

        self.paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
        self.files, self.index, self.aux_layers, self.hidden_size = [], [], None, None
        self.without_target_next = []
        for path in self.paths:
            f = safe_open(str(path), framework="pt")
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: not an eaglenest hidden shard (format {meta.get('format')!r}, expected {FORMAT!r})")
            aux = json.loads(meta["aux_layers"])
            if self.aux_layers is None:
                self.aux_layers, self.hidden_size = aux, int(meta["hidden_size"])
            elif aux != self.aux_layers or int(meta["hidden_size"]) != self.hidden_size:
                raise ValueError(f"{path}: aux_layers {aux} / hidden {meta['hidden_size']} differ from {self.paths[0]}'s")
            if "target_next" not in f.keys():
                self.without_target_next.append(path)
            offsets = f.get_tensor("seq_offsets").tolist()
            s = len(self.files)
            self.files.append(f)
            self.index += [(s, a, b) for a, b in zip(offsets[:-1], offsets[1:])]

    def __len__(self):
        return len(self.index)

    def length(self, k):
        _, a, b = self.index[k]
        return b - a

    def __getitem__(self, k):
        s, a, b = self.index[k]
        f = self.files[s]
        return {name: f.get_slice(name)[a:b] for name in self.names}

    @property
    def names(self):
        """The tensors each row holds."""
        return ("input_ids", "loss_mask", "aux_hidden", "last_hidden") + (
            () if self.without_target_next else ("target_next",))

    def fingerprint_facts(self):
        # Size and modification time, as make and Snakemake judge files: rewritten shards (even of the
        # same size) are other data. Hashing their content would read hundreds of GB at real scale.
        return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in self.paths]

    def follow(self, order):
        """Nothing to fetch ahead: the shards are memory-mapped (``order`` is not consumed)."""

    def close(self):
        """Nothing to stop: the memory maps close with the object."""
