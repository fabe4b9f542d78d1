"""Client throughput: eaglenest's trace client vs the OpenAI Python client from a thread pool.

Starts the stub server (tests/stub_server.py --mode fixed: one small pre-encoded answer, no delay)
in its own process, then sends N chat requests through
  (a) eaglenest.data.traces.generate_shard on a temp shard (concurrency C), and
  (b) openai.OpenAI(base_url=...).chat.completions.create from ThreadPoolExecutor(256),
and prints requests/s and the client's CPU seconds per request (getrusage of this process; the
stub's CPU is reported apart). Rounds alternate a, b; the median round of each is reported.

    .venv/bin/python benchmarks/bench_client.py --requests 4000 --concurrency 200 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eaglenest.data.traces import generate_shard  # noqa: E402
from eaglenest.settings import GenerationSettings  # noqa: E402

MODEL = "stub-model"
GENERATION = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": 0}


def cpu_self():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(n):
    return [{"id": f"{i:08x}", "source": "bench",
             "messages": [{"role": "user", "content": f"What is {i} + {i}? Answer briefly."}]} for i in range(n)]


def run_eaglenest(url, shard, workdir, concurrency, progress):
    out = Path(workdir) / "traces" / "shard_bench.jsonl"
    t, c = time.perf_counter(), cpu_self()
    settings = GenerationSettings.defaults().replace(model=MODEL, **GENERATION, concurrency=concurrency,
                                                     max_error_fraction=0.0)
    stats = generate_shard(shard, out, settings, urls=[url], progress=progress)
    wall, cpu = time.perf_counter() - t, cpu_self() - c
    assert stats["completed"] == stats["requests"], stats
    out.unlink()  # the next round starts from scratch (no resume)
    return wall, cpu


def run_openai(url, items, threads):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="bench")

    def one(p):
        r = client.chat.completions.create(model=MODEL, messages=p["messages"], extra_body={"return_token_ids": True},
                                           **GENERATION)
        return r.choices[0].message.content

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, items[:threads]))  # warm-up: threads and connections exist before timing
        t, c = time.perf_counter(), cpu_self()
        answers = list(pool.map(one, items))
        wall, cpu = time.perf_counter() - t, cpu_self() - c
    assert len(answers) == len(items) and all(answers)
    client.close()
    return wall, cpu


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=200, help="eaglenest requests in flight")
    p.add_argument("--threads", type=int, default=256, help="OpenAI client thread pool")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--progress", action="store_true", help="show eaglenest's progress bar (off: its cost is small)")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args()

    stub = subprocess.Popen([sys.executable, str(REPO / "tests" / "stub_server.py"), "--port", "0", "--mode", "fixed"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = stub.stdout.readline()
        assert line.startswith("LISTENING "), line
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        items = prompts(a.requests)
        results = {"eaglenest": [], "openai": []}
        with tempfile.TemporaryDirectory() as workdir:
            shard = Path(workdir) / "shard_bench.prompts.jsonl"
            shard.write_text("".join(json.dumps(x) + "\n" for x in items))
            # warm-up: imports, first connections
            warm = Path(workdir) / "warm.jsonl"
            warm.write_text("".join(json.dumps(x) + "\n" for x in items[:50]))
            run_eaglenest(url, warm, workdir, a.concurrency, False)
            for r in range(a.rounds):
                for name in ("eaglenest", "openai"):
                    s0 = cpu_of(stub.pid)
                    if name == "eaglenest":
                        wall, cpu = run_eaglenest(url, shard, workdir, a.concurrency, a.progress)
                    else:
                        wall, cpu = run_openai(url, items, a.threads)
                    stub_cpu = cpu_of(stub.pid) - s0
                    results[name].append({"rps": a.requests / wall, "cpu_ms_per_req": 1000 * cpu / a.requests,
                                          "stub_cpu_ms_per_req": 1000 * stub_cpu / a.requests, "wall_s": wall})
                    print(f"round {r + 1} {name:9s}: {a.requests / wall:8.0f} req/s  client CPU "
                          f"{1000 * cpu / a.requests:.3f} ms/req  (stub CPU {1000 * stub_cpu / a.requests:.3f} ms/req, "
                          f"{wall:.2f} s)", file=sys.stderr, flush=True)
    finally:
        stub.kill()
        stub.wait()

    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in results.items()}
    e, o = med["eaglenest"], med["openai"]
    summary = {
        "requests": a.requests, "concurrency": a.concurrency, "threads": a.threads, "rounds": a.rounds,
        "cpus": os.cpu_count(), "eaglenest": e, "openai": o,
        "rps_ratio": e["rps"] / o["rps"], "cpu_per_req_ratio": o["cpu_ms_per_req"] / e["cpu_ms_per_req"],
    }
    print(f"\nmedian of {a.rounds} rounds, {a.requests} requests, stub answering at once, {os.cpu_count()} CPUs:")
    print(f"  eaglenest (aiohttp, concurrency {a.concurrency}): {e['rps']:7.0f} req/s, {e['cpu_ms_per_req']:.3f} ms CPU/req")
    print(f"  openai client (ThreadPoolExecutor({a.threads})):  {o['rps']:7.0f} req/s, {o['cpu_ms_per_req']:.3f} ms CPU/req")
    print(f"  ratio: {summary['rps_ratio']:.2f}x requests/s, {summary['cpu_per_req_ratio']:.2f}x less client CPU per request")
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
