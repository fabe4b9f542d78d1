"""Statistics of a trace shard: what its records hold (resumed ones included) and what this run
did (answers, latencies, retries), written as ``traces/shard_{i}.stats.json`` and gathered into one
table by ``write_stats_table``."""

import json
from collections import Counter
from pathlib import Path

from ..util import write_atomic


def stem(path):
    """The name of ``path`` without ``.jsonl`` (or its last suffix)."""
    name = path.name
    return name[: -len(".jsonl")] if name.endswith(".jsonl") else path.stem


def percentile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class TraceStats:
    def __init__(self):
        self.totals = dict(prompt_tokens=0, completion_tokens=0, reasoning_tokens=0, truncated=0,
                           no_reasoning=0, empty_content=0)  # over every record of the shard
        self.reasoning_reported = False
        self.latencies = []  # this run's answers
        self.completed = self.resumed = self.retries = 0
        self.new_completion_tokens = 0
        self.conversations = self.turns = self.turns_dropped = 0
        self.ended = Counter()  # conversations by how they ended

    def count(self, record):
        """One record of the shard, resumed or new (a conversation's tokens: every turn's)."""
        t = self.totals
        if "turns" in record:
            self.conversations += 1
            self.turns += len(record["turns"])
            self.turns_dropped += record["turns_dropped"]
            self.ended[record["ended"]] += 1
        for turn in record.get("turns") or (record,):
            t["prompt_tokens"] += len(turn.get("prompt_token_ids") or ())
            t["completion_tokens"] += len(turn.get("completion_token_ids") or ())
            details = (turn.get("usage") or {}).get("completion_tokens_details") or {}
            if details.get("reasoning_tokens") is not None:
                self.reasoning_reported = True
                t["reasoning_tokens"] += details["reasoning_tokens"]
        t["truncated"] += bool(record.get("truncated"))
        t["no_reasoning"] += not record.get("reasoning")
        t["empty_content"] += not record.get("content")

    def answered(self, latency, completion_tokens):
        """One answer of this run (``count`` it too)."""
        self.completed += 1
        self.latencies.append(latency)
        self.new_completion_tokens += completion_tokens

    def as_dict(self, *, shard, requests, records, errors, wall, complete, servers, model, fingerprint):
        lat = sorted(self.latencies)
        t = self.totals
        conversations = {"conversations": {"records": self.conversations, "turns": self.turns,
                                           "turns_dropped": self.turns_dropped, "ended": dict(self.ended)}} \
            if self.conversations else {}
        return {
            "shard": shard,
            "complete": complete,
            "requests": requests,
            "completed": self.completed,
            "resumed": self.resumed,
            "errors": errors,
            "retries": self.retries,
            # over every record of the shard (resumed ones included)
            "records": records,
            "prompt_tokens": t["prompt_tokens"],
            "completion_tokens": t["completion_tokens"],
            "reasoning_tokens": t["reasoning_tokens"] if self.reasoning_reported else None,
            "truncated": t["truncated"],
            "no_reasoning": t["no_reasoning"],
            "empty_content": t["empty_content"],
            # this run only
            "latency_mean_s": round(sum(lat) / len(lat), 4) if lat else None,
            "latency_p50_s": round(percentile(lat, 0.50), 4) if lat else None,
            "latency_p95_s": round(percentile(lat, 0.95), 4) if lat else None,
            "wall_s": round(wall, 3),
            "requests_per_s": round(self.completed / wall, 3) if wall > 0 else None,
            "completion_tokens_per_s": round(self.new_completion_tokens / wall, 1) if wall > 0 else None,
            "generated_tokens": self.new_completion_tokens,
            "urls": [s.url for s in servers],
            "answered_per_url": {s.url: s.answered for s in servers},
            "model": model,
            "fingerprint": fingerprint,
            **conversations,  # a shard of conversations: their turns and how they ended (conversations.ENDINGS)
        }


def summary(shard, s):
    """The one-line summary of a shard's statistics ``s`` (``TraceStats.as_dict``)."""
    resumed = f", {s['resumed']} resumed" if s["resumed"] else ""
    c = s.get("conversations")
    turns = (f"; {c['records']} conversations, {c['turns']} turns, ended: "
             + ", ".join(f"{n} {why}" for why, n in sorted(c["ended"].items()))) if c else ""
    return (f"{shard}: {s['completed']} answers ({s['truncated']} truncated, {s['errors']} errors, "
            f"{s['retries']} retries{resumed}), {s['generated_tokens']} tokens in {s['wall_s']:.1f} s "
            f"({s['requests_per_s'] or 0:.1f} req/s, {s['completion_tokens_per_s'] or 0:.0f} tok/s){turns}")


def write_stats_table(stats_paths, out_csv) -> "pandas.DataFrame":  # noqa: F821 (imported when called)
    """The per-shard trace statistics (``traces/shard_{i}.stats.json``) as one table, a row per shard
    and a column per figure (nested ones flattened as ``a.b``), written as CSV for notebooks."""
    import pandas as pd

    rows = [{"shard": stem(Path(p)).removesuffix(".stats"), **json.loads(Path(p).read_text())} for p in stats_paths]
    table = pd.json_normalize(rows)
    write_atomic(out_csv, table.to_csv(index=False))
    return table
