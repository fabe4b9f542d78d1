"""Hidden states of the target over the exact trace tokens, for EAGLE-3 training.

A transformers forward of the target runs over exactly ``prompt_token_ids + completion_token_ids``
of each trace record (no re-templating), cut at ``max_length``. Each shard is one safetensors file,
sequences packed end to end along the token axis (T = all kept tokens of the shard):

    aux_hidden   bf16  [T, 3*H]  the auxiliary states at the vLLM ids in ``aux_layers`` (ascending,
                                 concatenated in that order: exactly the input of the draft's ``fc``)
    last_hidden  bf16  [T, H]    the target's last hidden state AFTER its final norm, so the target's
                                 distribution at a position is ``softmax(lm_head(last_hidden))``;
                                 storing it post-norm makes that exact for any final-norm flavour
    input_ids    int64 [T]
    seq_offsets  int64 [S + 1]   sequence k is rows ``seq_offsets[k]:seq_offsets[k+1]``
    loss_mask    bool  [T]       True on completion tokens (reasoning included), False on the prompt

The ``__metadata__`` holds ``format``, ``aux_layers`` (JSON), ``hidden_size``, ``target`` and counts.
A shard costs ``8*H + 9`` bytes per token (plus 8 per sequence); it is written in place (header first,
then each batch's rows at their offsets) so it is never held whole in memory, under a ``.partial``
name that is renamed once complete. Readers use ``safe_open`` (memory-mapped).

What training needs of the target's head is saved once, beside the shards, by ``save_target_head``:
``target_head.safetensors`` (``embed_tokens.weight``, ``lm_head.weight``, ``norm.weight``) and
``target_head.json`` (sizes, rms eps, rope, layer count, aux layer ids). Training reads the shards
and the head only while it runs: the shards may be deleted (Snakemake ``temp()``) once it finishes.
"""

import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .layers import check_aux_layers, default_aux_layers

FORMAT = "eaglenest.hidden/1"
HEAD_FORMAT = "eaglenest.target_head/1"
STORE_DTYPE = torch.bfloat16
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64", torch.bool: "BOOL"}
WRITERS = 4  # threads writing the rows of a shard in parallel
INFLIGHT = 3  # batches between the GPU and the disk at once (each in page-locked host memory on CUDA)
SYNC_BYTES = 1 << 28  # written bytes between two fdatasync calls of the shard during extraction


def say(message):
    """One line for the rule's log (stderr, where the progress bars go too)."""
    print(message, file=sys.stderr, flush=True)


class DiskSpaceError(OSError):
    """Not enough free disk for a shard: the message says needed vs free bytes and where."""


def save_safetensors(tensors, path, metadata=None):
    """Write a safetensors file atomically (a ``.partial`` renamed into place), readable by all
    (safetensors itself creates files 0600)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- trace records


def iter_trace_tokens(trace_paths, use_truncated=True, counts=None):
    """Yield ``(prompt_token_ids, completion_token_ids)`` of each usable trace record.

    ``counts`` (a dict, optional) is updated with ``records``, ``skipped_truncated`` and
    ``skipped_empty`` so callers can report what was left out.
    """
    counts = counts if counts is not None else {}
    for key in ("records", "skipped_truncated", "skipped_empty"):
        counts.setdefault(key, 0)
    for path in trace_paths:
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    prompt, completion = rec["prompt_token_ids"], rec["completion_token_ids"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(
                        f"{path}:{lineno}: not a trace record with prompt_token_ids and "
                        f"completion_token_ids ({type(e).__name__}: {e})"
                    ) from None
                counts["records"] += 1
                if rec.get("truncated") and not use_truncated:
                    counts["skipped_truncated"] += 1
                    continue
                if not completion:
                    counts["skipped_empty"] += 1
                    continue
                yield prompt, completion


# ----------------------------------------------------------------------------- target loading


def resolve_device(device="auto"):
    """'auto' -> 'cuda' when a GPU is present, else 'cpu'."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _torch_dtype(dtype, config=None):
    if dtype == "auto":
        return getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, dtype)


def load_target(target, *, device="auto", dtype="bfloat16"):
    """The target as a transformers CausalLM in eval mode; over several GPUs with device_map="auto"
    (which needs the ``accelerate`` package), else whole on one device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target)
    device = resolve_device(device)
    torch_dtype = _torch_dtype(dtype, config)
    if device == "cuda" and torch.cuda.device_count() > 1:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype, device_map="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype).to(device)
    return model.eval()


def _decoder(model):
    decoder = model.get_decoder()
    if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise ValueError(
            f"{type(model).__name__}: its decoder ({type(decoder).__name__}) has no .layers/.norm; "
            "eaglenest knows Llama-style decoders only"
        )
    return decoder


def target_info(config, aux_layers=None) -> dict:
    """The facts about the target that training and export need (from its transformers config)."""
    text = config.get_text_config()
    num_layers = text.num_hidden_layers
    aux = check_aux_layers(aux_layers, num_layers) if aux_layers is not None else default_aux_layers(num_layers)
    heads = text.num_attention_heads
    return {
        "architectures": list(getattr(config, "architectures", None) or []),
        "model_type": text.model_type,
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "vocab_size": text.vocab_size,
        "rms_norm_eps": text.rms_norm_eps,
        "rope_parameters": dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        "max_position_embeddings": text.max_position_embeddings,
        "aux_layers": list(aux),
        "last_hidden": "post_norm",
    }


# ----------------------------------------------------------------------------- target head


def _head_weights_from_checkpoint(target, config):
    """The three head tensors read straight from a local safetensors checkpoint, or None.

    A meta-device copy of the model gives the parameter names; nothing else of the target is read,
    so this costs seconds even for a very large target.
    """
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    root = Path(target)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (root / "model.safetensors").is_file():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        return None
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    wanted = {
        "embed_tokens.weight": meta.get_input_embeddings().weight,
        "lm_head.weight": meta.get_output_embeddings().weight,
        "norm.weight": _decoder(meta).norm.weight,
    }
    weights = {}
    for key, param in wanted.items():
        # a tied lm_head has two names for one tensor: take the one the checkpoint stores
        names = [n for n, p in meta.named_parameters(remove_duplicate=False) if p is param and n in weight_map]
        if not names:
            return None
        with safe_open(str(root / weight_map[names[0]]), framework="pt") as f:
            weights[key] = f.get_tensor(names[0])
    return weights


def save_target_head(target, head_path, *, aux_layers=None, model=None) -> dict:
    """Save embed_tokens / lm_head / final-norm weights and the target's facts, once per target.

    Writes ``head_path`` (safetensors) and ``head_path`` with suffix ``.json``; returns the info.
    The weights come from ``model`` when given, else straight from the target's safetensors files,
    else (a hub name, unusual names) from loading the whole target on CPU.
    """
    from transformers import AutoConfig

    config = model.config if model is not None else AutoConfig.from_pretrained(target)
    info = {**target_info(config, aux_layers), "target": str(target)}
    weights = None if model is not None else _head_weights_from_checkpoint(target, config)
    if weights is None:
        model = model if model is not None else load_target(target, device="cpu", dtype="auto")
        weights = {
            "embed_tokens.weight": model.get_input_embeddings().weight,
            "lm_head.weight": model.get_output_embeddings().weight,
            "norm.weight": _decoder(model).norm.weight,
        }
    weights = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    save_safetensors(weights, head_path, {"format": HEAD_FORMAT})
    Path(head_path).with_suffix(".json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def load_target_head(head_path, device="cpu"):
    """``(tensors, info)`` saved by ``save_target_head``."""
    from safetensors.torch import load_file

    head_path = Path(head_path)
    info = json.loads(head_path.with_suffix(".json").read_text())
    return load_file(str(head_path), device=str(device)), info


# ----------------------------------------------------------------------------- shard writing


def estimate_bytes(num_tokens, num_seqs, hidden_size, num_aux=3) -> int:
    """Bytes on disk of one shard (bf16 states, int64 ids, bool mask, int64 offsets, ~header)."""
    per_token = (num_aux + 1) * hidden_size * 2 + 8 + 1
    return num_tokens * per_token + (num_seqs + 1) * 8 + 4096


def check_free_disk(path, needed) -> int:
    """Raise DiskSpaceError unless the filesystem holding ``path`` has ``needed`` bytes free."""
    where = Path(path).resolve().parent
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < needed:
        raise DiskSpaceError(
            f"not enough free disk for {path}: needs {needed:,} bytes ({needed / 2**30:.2f} GiB), "
            f"{free:,} bytes ({free / 2**30:.2f} GiB) free in {where}; free space or lower max_length"
        )
    return free


class _ShardWriter:
    """A safetensors file whose header is written first and whose tensor rows are written in place."""

    def __init__(self, path, specs, metadata):
        # specs: name -> (torch dtype, shape); the file is laid out in the order given
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
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, len(text).to_bytes(8, "little") + text, 0)
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


class _AuxCapture:
    """Forward hooks that record the residual stream at the given vLLM ids (see layers.py)."""

    def __init__(self, decoder, aux_layers):
        self.states, self.handles = {}, []
        layers = decoder.layers
        for i in aux_layers:
            if i == 0:  # the state entering layer 0: the embeddings
                self.handles.append(layers[0].register_forward_pre_hook(self._pre_hook(0), with_kwargs=True))
            else:  # id i = the output of layer i-1
                self.handles.append(layers[i - 1].register_forward_hook(self._hook(i)))

    def _pre_hook(self, i):
        def hook(module, args, kwargs):
            self.states[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _hook(self, i):
        def hook(module, args, output):
            self.states[i] = output[0] if isinstance(output, tuple) else output

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def extract_hidden(
    trace_paths,
    out_path,
    target,
    *,
    aux_layers=None,
    max_length=2048,
    use_truncated=True,
    batch_tokens=16384,
    device="auto",
    dtype="bfloat16",
    head_path=None,
    progress=True,
    model=None,
) -> dict:
    """Run the target over the trace tokens and write one hidden-state shard (format: module doc).

    ``target`` is a transformers model directory or hub name (``model``, an already loaded target,
    skips loading). ``dtype`` is the dtype the target runs in: bf16 matches what vLLM serves with
    ``--dtype auto`` (it downcasts fp32 checkpoints). ``head_path``, when given, also saves the target
    head there (``save_target_head``). Refuses with ``DiskSpaceError`` before any work when the disk
    is short. Returns counts, bytes and speed.
    """
    from transformers import AutoConfig

    if isinstance(trace_paths, (str, Path)):
        trace_paths = [trace_paths]
    t_start = time.time()
    config = model.config if model is not None else AutoConfig.from_pretrained(target)
    info = target_info(config, aux_layers)
    aux_layers, hidden_size = info["aux_layers"], info["hidden_size"]

    # Pass 1: token ids only (4 bytes a token, far below the shard's 8*H), so the layout is known.
    counts = {}
    seqs, n_cut = [], 0
    for prompt, completion in iter_trace_tokens(trace_paths, use_truncated, counts):
        ids = np.asarray(list(prompt) + list(completion), dtype=np.int64)
        if len(ids) > max_length:
            n_cut += 1
            ids = ids[:max_length]
        if len(ids) <= len(prompt):  # the cut left no completion token
            counts["skipped_empty"] += 1
            continue
        seqs.append((ids, len(prompt)))
    if not seqs:
        raise ValueError(f"no usable trace records in {[str(p) for p in trace_paths]} ({counts})")
    lengths = [len(ids) for ids, _ in seqs]
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n_tokens = int(offsets[-1])
    needed = estimate_bytes(n_tokens, len(seqs), hidden_size, len(aux_layers))
    say(f"extract_hidden: {len(seqs)} sequences, {n_tokens} tokens -> {out_path}, about {needed / 2**30:.3f} GiB on disk")
    check_free_disk(out_path, needed)

    if model is None:
        model = load_target(target, device=device, dtype=dtype)
    if head_path is not None:
        save_target_head(target, head_path, aux_layers=aux_layers, model=model)
    decoder = _decoder(model)
    first_device = model.get_input_embeddings().weight.device

    specs = {
        "aux_hidden": (STORE_DTYPE, (n_tokens, len(aux_layers) * hidden_size)),
        "last_hidden": (STORE_DTYPE, (n_tokens, hidden_size)),
        "input_ids": (torch.int64, (n_tokens,)),
        "seq_offsets": (torch.int64, (len(seqs) + 1,)),
        "loss_mask": (torch.bool, (n_tokens,)),
    }
    metadata = {
        "format": FORMAT,
        "target": str(target),
        "aux_layers": json.dumps(aux_layers),
        "hidden_size": hidden_size,
        "last_hidden": "post_norm",
        "num_seqs": len(seqs),
        "num_tokens": n_tokens,
        "max_length": max_length,
    }
    writer = _ShardWriter(out_path, specs, metadata)
    capture = _AuxCapture(decoder, aux_layers)
    n_loss = sum(len(ids) - n_prompt for ids, n_prompt in seqs)
    bar = tqdm(total=n_tokens, unit="tok", desc=f"extract {Path(out_path).name}", disable=not progress)

    on_gpu = first_device.type == "cuda"
    # Device -> host: on CUDA each batch's states go into page-locked host buffers by non-blocking
    # copies on a side stream (they overlap the next batch's forward), an event marks them done;
    # writer threads wait on that event, then write the rows in place (pwrite drops the GIL): each
    # batch is split over WRITERS threads by sequence; at most INFLIGHT batches are in host memory.
    copy_streams = {}  # per device of the outputs (the last GPU of a target split over several)
    in_flight, unsynced = [], [0]
    sync_lock = threading.Lock()

    def write_rows(batch, positions, aux, last, done):
        """Write the sequences at ``positions`` of ``batch`` (one writer's share of a batch)."""
        if done is not None:
            done.synchronize()  # the batch's device -> host copies have landed
        n_tok = 0
        for b in positions:
            k = batch[b]
            ids_k, n_prompt = seqs[k]
            row, n = int(offsets[k]), lengths[k]
            writer.write_rows("aux_hidden", row, aux[b, :n])
            writer.write_rows("last_hidden", row, last[b, :n])
            writer.write_rows("input_ids", row, torch.from_numpy(ids_k))
            writer.write_rows("loss_mask", row, torch.arange(n) >= n_prompt)
            n_tok += n
        bar.update(n_tok)
        # flush written pages to disk while the target runs, so the final fsync has little left
        with sync_lock:
            unsynced[0] += n_tok * writer.bytes_per_token
            flush = unsynced[0] >= SYNC_BYTES
            if flush:
                unsynced[0] = 0
        if flush:
            os.fdatasync(writer.fd)

    def to_host(t):
        if not on_gpu:
            return t.to(STORE_DTYPE).cpu()
        host = torch.empty(t.shape, dtype=STORE_DTYPE, pin_memory=True)
        if t.device not in copy_streams:
            copy_streams[t.device] = torch.cuda.Stream(t.device)
        copy_stream = copy_streams[t.device]
        copy_stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(copy_stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(copy_stream)  # not reused by the next forward before the copy is done
        return host

    pool = ThreadPoolExecutor(WRITERS)
    try:
        writer.write_rows("seq_offsets", 0, torch.from_numpy(offsets))
        for batch in _length_batches(lengths, batch_tokens):
            longest = lengths[batch[0]]
            ids = torch.zeros(len(batch), longest, dtype=torch.int64)  # right padding: causal attention
            for b, k in enumerate(batch):  # keeps real positions blind to the pads, so no mask needed
                ids[b, : lengths[k]] = torch.from_numpy(seqs[k][0])
            with torch.inference_mode():
                capture.states.clear()
                # pinned, so that the copy does not make the host wait for the previous batch's forward
                ids = ids.pin_memory().to(first_device, non_blocking=True) if on_gpu else ids.to(first_device)
                last = decoder(input_ids=ids, use_cache=False).last_hidden_state
                aux = torch.cat([capture.states[i].to(last.device) for i in aux_layers], dim=-1).to(STORE_DTYPE)
                device = last.device
                aux, last = to_host(aux), to_host(last.to(STORE_DTYPE))
                done = None
                if on_gpu:
                    done = torch.cuda.Event()
                    done.record(copy_streams[device])  # aux and last both come from that device
            while len(in_flight) >= INFLIGHT:
                [f.result() for f in in_flight.pop(0)]
            shares = [list(range(len(batch)))[w::WRITERS] for w in range(min(WRITERS, len(batch)))]
            in_flight.append([pool.submit(write_rows, batch, share, aux, last, done) for share in shares])
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
    seconds = time.time() - t_start
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
    """Memory-mapped read access to one or more shards: ``len()`` sequences, ``[k]`` -> dict of rows."""

    def __init__(self, paths):
        from safetensors import safe_open

        self.paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
        self.files, self.index, self.aux_layers, self.hidden_size = [], [], None, None
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
        return {name: f.get_slice(name)[a:b] for name in ("input_ids", "loss_mask", "aux_hidden", "last_hidden")}
