"""The training batches: sequences packed by length into batches of about ``batch_tokens`` tokens
(``epoch_batches``), their order a function of the seed, the epoch and the step, read from the
state source and staged on the device ahead of the step by a background thread (``BatchLoader``)."""

import math
import queue
import threading

import torch

from ..errors import EaglenestError
from ..settings import TrainSettings
from ..states.source import StateSource
from .layers import FLEX_BLOCK
from .runtime import Runtime
from .ttt import token_embeds_ids, ttt_loss_plan


def _round_up(n, m):
    return -(-n // m) * m


def batch_padding(settings: TrainSettings):
    """``(pad_to, fixed_rows)``: the flex path pads T to a multiple of FLEX_BLOCK; compiled, a batch
    also gets ``batch_tokens // T`` rows (empty ones carry no loss), so that there is one shape, and
    one compiled graph, per padded length."""
    if settings.attention != "flex":
        return 1, False
    return FLEX_BLOCK, settings.compile is True


def padded_shape(longest, n_seqs, settings: TrainSettings):
    """[B, T] of a micro-batch of ``n_seqs`` sequences, the longest ``longest`` tokens long."""
    pad_to, fixed = batch_padding(settings)
    T = _round_up(longest, pad_to)
    if not fixed:
        return n_seqs, T
    rows = max(1, settings.batch_tokens // T)
    if settings.batch_size:
        rows = min(rows, settings.batch_size)
    return max(rows, n_seqs), T


def epoch_batches(lengths, epoch, seed, batch_tokens, batch_size=None, window=1024, pad_to=1):
    """Micro-batches (lists of sequence indices) of one epoch, a function of (seed, epoch) only.

    Shuffle, sort each window of ``window`` sequences by length (little padding), pack greedily so
    that sequences x longest (rounded up to ``pad_to``) <= batch_tokens, then shuffle the batches.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches = []
    for w in range(0, len(order), window):
        cur = []
        for k in sorted(order[w : w + window], key=lambda k: lengths[k]):
            longest = _round_up(max(lengths[cur[-1]], lengths[k]) if cur else lengths[k], pad_to)
            if cur and ((len(cur) + 1) * longest > batch_tokens or (batch_size and len(cur) >= batch_size)):
                batches.append(cur)
                cur = []
            cur.append(k)
        if cur:
            batches.append(cur)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def micro_batch_stream(lengths, settings: TrainSettings, start=0):
    """Endless ``(epoch, batch)`` over the epochs, from global micro-batch ``start`` on."""
    m, epoch = 0, 0
    while True:
        batches = epoch_batches(lengths, epoch, settings.seed, settings.batch_tokens, settings.batch_size,
                                pad_to=batch_padding(settings)[0])
        if m + len(batches) <= start:
            m += len(batches)
        else:
            for b in batches[max(0, start - m) :]:
                yield epoch, b
            m += len(batches)
        epoch += 1


def load_batch(shards, seq_ids, settings: TrainSettings | None = None, pin=False):
    """Padded CPU tensors of some sequences: input_ids/loss_mask [B, T], aux [B, T, 3H], last [B, T, H],
    and target_next [B, T] where the shards have it (B, T: ``padded_shape`` under ``settings``, else the
    sequences and the longest); ``pin``: page-locked, for asynchronous copies to the GPU."""
    items = [shards[k] for k in seq_ids]
    longest = max(len(it["input_ids"]) for it in items)
    B, T = padded_shape(longest, len(items), settings) if settings else (len(items), longest)
    def new(*shape, dtype):
        return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

    out = {
        "input_ids": new(B, T, dtype=torch.int64),
        "loss_mask": new(B, T, dtype=torch.bool),
        "aux_hidden": new(B, T, items[0]["aux_hidden"].shape[1], dtype=items[0]["aux_hidden"].dtype),
        "last_hidden": new(B, T, items[0]["last_hidden"].shape[1], dtype=items[0]["last_hidden"].dtype),
    }
    if "target_next" in items[0]:
        out["target_next"] = new(B, T, dtype=torch.int32)
    for b, it in enumerate(items):
        for name, t in it.items():
            out[name][b, : len(t)] = t
    return out


def loss_rows(loss_mask):
    """Flat indices b*T + q of the positions q whose next token is a completion token."""
    pred = torch.zeros_like(loss_mask)
    pred[:, :-1] = loss_mask[:, 1:]  # position q predicts token q+1
    return pred.flatten().nonzero().squeeze(1)


@torch.no_grad()
def count_steps(lengths, settings: TrainSettings, world):
    if settings.max_steps:
        return int(settings.max_steps)
    epochs = float(settings.epochs)  # may be fractional: the last epoch is then partly used
    pad_to = batch_padding(settings)[0]
    counts = [len(epoch_batches(lengths, e, settings.seed, settings.batch_tokens, settings.batch_size, pad_to=pad_to))
              for e in range(math.ceil(epochs))]
    micro = sum(counts[: int(epochs)]) + (round((epochs - int(epochs)) * counts[-1]) if epochs % 1 else 0)
    return max(1, micro // (settings.grad_accum * world))


class BatchLoader:
    """This rank's micro-batches: read by a background thread ``prefetch`` ahead, in host memory.

    The thread walks ``micro_batch_stream`` (every rank walks the same stream and keeps its own
    batches), reads the sequences from the memory-mapped shards into page-locked host memory, looks
    up the target's embeddings of the tokens the TTT reads, and finds the loss rows (and the fused
    loss's plan) on the host. On CUDA, ``next()`` hands out a batch whose copy to the device was
    started one call earlier, on a copy stream, with non-blocking copies and an event the compute
    stream waits on: neither the read, nor the copy, nor an index computation stalls the step, and
    only two batches are on the device at once.
    """

    def __init__(self, shards: StateSource, lengths, settings: TrainSettings, *, start, count, rank, world, device, ttt_length, embed_table,
                 runtime: Runtime):
        # runtime: how the model runs the TTT (its resolved settings), which decides the loss plan each batch carries
        self.shards, self.lengths, self.settings, self.embed_table, self.runtime = shards, lengths, settings, embed_table, runtime
        self.rank, self.world, self.count, self.ttt_length = rank, world, count, ttt_length
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_gpu else None
        self.staged = None  # the next batch, its copy to the device under way
        self.stream = micro_batch_stream(lengths, settings, start=start)
        # streamed states are fetched in the order this rank reads them (the generator runs only then)
        shards.follow(self._order(lengths, settings, start, count, rank, world))
        self.queue = queue.Queue(maxsize=max(1, int(settings.prefetch)))
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="train_draft-loader", daemon=True)
        self.thread.start()

    @staticmethod
    def _order(lengths, settings, start, count, rank, world):
        """The sequence indices this rank's ``count`` micro-batches read, in reading order."""
        stream = micro_batch_stream(lengths, settings, start=start)
        for _ in range(count):
            for r in range(world):
                _, seq_ids = next(stream)
                if r == rank:
                    yield from seq_ids

    def _put(self, item):
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _host_batch(self, seq_ids):
        batch = load_batch(self.shards, seq_ids, self.settings, pin=self.on_gpu)
        B, T = batch["input_ids"].shape
        ids = token_embeds_ids(batch["input_ids"], self.ttt_length)  # [B, T+J-1]
        H = self.embed_table.shape[1]
        batch["embeds"] = torch.empty(*ids.shape, H, dtype=self.embed_table.dtype, pin_memory=self.on_gpu)
        torch.index_select(self.embed_table, 0, ids.flatten(), out=batch["embeds"].view(-1, H))
        batch["rows"] = loss_rows(batch["loss_mask"])
        chains = self.runtime.runs_chains
        if self.runtime.fused_loss or chains:
            batch["plan"] = ttt_loss_plan(batch["rows"], T, self.ttt_length, B * T, chains=chains)
        if self.on_gpu:
            batch["rows"] = batch["rows"].pin_memory()
            if "plan" in batch:
                batch["plan"] = {k: v.pin_memory() for k, v in batch["plan"].items()}
        return batch

    def _run(self):
        try:
            for _ in range(self.count):
                tokens = 0
                for r in range(self.world):
                    epoch, seq_ids = next(self.stream)
                    tokens += sum(self.lengths[k] for k in seq_ids)
                    if r == self.rank:
                        mine = seq_ids
                self._put((epoch, tokens, self._host_batch(mine)))
                if self.stopping.is_set():
                    return
        except BaseException as e:  # handed to the training loop, which raises it
            self._put(e)

    def _stage(self, block):
        """Take the next host batch and start its copy to the device (CUDA); False if none is ready."""
        while True:
            try:
                item = self.queue.get(timeout=5) if block else self.queue.get_nowait()
                break
            except queue.Empty:
                if not block:
                    return False
                if not self.thread.is_alive() and self.queue.empty():
                    raise RuntimeError("train_draft: the batch loader thread ended without a batch") from None
        if isinstance(item, EaglenestError):
            raise item  # says what failed and what to do (the extraction server of stream mode)
        if isinstance(item, BaseException):
            raise RuntimeError(f"train_draft: reading a batch from {[str(p) for p in self.shards.paths]} failed: {item}") from item
        epoch, tokens, batch = item
        event = None
        if self.on_gpu:
            with torch.cuda.stream(self.copy_stream):
                batch = _tree_map(lambda t: t.to(self.device, non_blocking=True), batch)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
        self.staged = (epoch, tokens, batch, event)
        return True

    def next(self):
        """``(epoch, tokens of all ranks' micro-batches, batch on the device)``."""
        if self.staged is None:
            self._stage(block=True)
        epoch, tokens, batch, event = self.staged
        self.staged = None
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            _tree_map(lambda t: t.record_stream(compute), batch)  # made on the copy stream, used here
            self._stage(block=False)  # the next batch's copy overlaps this step, when it is read already
        return epoch, tokens, batch

    def close(self):
        self.stopping.set()
        self.shards.close()
        while self.thread.is_alive():
            try:
                self.queue.get(timeout=0.1)
            except queue.Empty:
                pass
        self.thread.join()


def _tree_map(fn, batch):
    return {k: ({kk: fn(vv) for kk, vv in v.items()} if isinstance(v, dict) else fn(v)) for k, v in batch.items()}


def run_shapes(lengths, settings: TrainSettings, start, count, world):
    """The padded [B, T] shapes of the micro-batches ``start .. start + count*world``."""
    shapes, stream = set(), micro_batch_stream(lengths, settings, start=start)
    for _ in range(count * world):
        _, ids = next(stream)
        shapes.add(padded_shape(max(lengths[k] for k in ids), len(ids), settings))
    return shapes


