"""The hidden-state shard, as either extraction backend writes it (transformers: ``hidden``; vLLM:
``extract``) and training reads it (``HiddenShards``).

Its sequences are the training sequences of the trace records (``shard_sequences``; ``data.sequences``: a
single answer's ``prompt_token_ids + completion_token_ids``, a conversation's chains of turns; no
re-templating), cut at ``max_length``. Each shard is one safetensors file, sequences packed end to end along
the token axis (T = all kept tokens of the shard):

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
Training reads the shards only while it runs: they may be deleted (Snakemake ``temp()``) once it finishes.
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from ..data.sequences import read_training_sequences
from ..errors import DiskSpaceError, TraceRecordError


FORMAT = "eaglenest.hidden/1"
STORE_DTYPE = torch.bfloat16
ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64", torch.int32: "I32",
             torch.bool: "BOOL"}


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
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
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
