"""The training metrics: a row per optimizer step (losses and accuracies per TTT step, learning
rate, gradient norm, tokens/s, peak memory), gathered from the device in batches of steps and
written as CSV by ``train.train_draft``."""

import csv
import io
import time

import torch

from ..util import write_atomic


class Metrics:
    """The metrics rows, one per optimizer step. Each step's figures stay on the device until
    ``flush`` reads the steps pending together (every log_every steps: one device sync, not one a
    step)."""

    def __init__(self, rows, ttt_length, ttt_decay, device, bar):
        # ttt_length: the positions each row has losses of; ttt_decay: their weights in the row's loss
        self.rows, self.ttt_length, self.ttt_decay, self.device, self.bar = rows, ttt_length, ttt_decay, device, bar
        self.pending = []
        self.tokens = 0  # tokens trained by this invocation (not the resumed steps)
        self.t_window, self.last_event = time.time(), None

    def add(self, step, epoch, lr, sums, grad_norm, tokens):
        event = None
        if self.device.startswith("cuda"):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.pending.append({"step": step, "epoch": epoch, "lr": lr, "sums": sums, "grad_norm": grad_norm.detach(),
                             "tokens": tokens, "event": event})

    def flush(self):
        if not self.pending:
            return
        pending, J = self.pending, self.ttt_length
        values = torch.stack([torch.cat([p["sums"].flatten(), p["grad_norm"].reshape(1).float()]) for p in pending]).cpu()
        seconds = time.time() - self.t_window
        window_tokens = sum(p["tokens"] for p in pending)
        peak = None
        if self.device.startswith("cuda"):
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        for p, v in zip(pending, values):
            s, grad_norm = v[:-1].view(J, 4), float(v[-1])
            ce = (s[:, 0] / s[:, 1].clamp(min=1)).tolist()
            acc = (s[:, 2] / s[:, 3].clamp(min=1)).tolist()
            row = {"step": p["step"], "epoch": p["epoch"], "lr": p["lr"], "loss": sum(self.ttt_decay ** j * c for j, c in enumerate(ce))}
            row.update({f"loss_{j}": ce[j] for j in range(J)})
            row.update({f"acc_{j}": acc[j] for j in range(J)})
            # tokens/s: on CUDA from events recorded at the end of each step on the compute stream
            # (the time between two step ends, idle gaps included); else over the window of steps
            # read together (the host does not wait on each step)
            rate = window_tokens / max(seconds, 1e-9)
            if p.get("event") is not None and self.last_event is not None:
                rate = p["tokens"] / max(self.last_event.elapsed_time(p["event"]) / 1e3, 1e-9)
            self.last_event = p.get("event")
            row.update({"grad_norm": grad_norm, "tokens": p["tokens"], "tokens_per_s": rate})
            if peak is not None:
                row["peak_gib"] = round(peak, 3)  # the most allocated since the previous read
            self.rows.append(row)
            self.tokens += p["tokens"]
        self.bar.update(len(pending))
        last = self.rows[-1]
        self.bar.set_postfix(loss=f"{last['loss']:.3f}", acc0=f"{last['acc_0']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}")
        pending.clear()
        self.t_window = time.time()


def write_metrics(path, rows):
    """``rows`` as CSV at ``path``, a column per figure of any row."""
    buf = io.StringIO()
    fields = list(dict.fromkeys(k for r in rows for k in r))  # a resumed run may add columns
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, buf.getvalue())
