"""One request at a time in real vLLM: the target alone, EAGLE-3 and n-gram speculation, three runs each.

Needs a finished workflow in the working directory (the exported draft and the held-out prompts;
for the embedded default, after `make run`). Each method gets one vLLM start (the validation's
settings: config.yaml's server, validate.num_speculative_tokens and validate.ngram); on it the
held-out prompts are sent one request at a time, `--runs` times (each run resent until it lasts
validate.min_seconds), then once at validate.concurrency. Prints every run's output tokens/s, the
medians, the speed-ups (median over median), the tokens per target step (vllm_facts.per_step: every
decode step counted) beside vLLM's acceptance length (per drafted step), n-gram simulated offline on the
target alone's greedy answers (predict.ngram_acceptance: the same figures without a server), and the
1-minute load average around each method, then a SUMMARY line of JSON.

    .venv/bin/python benchmarks/bench_speedup.py --runs 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eaglenest.config import load_config  # noqa: E402
from eaglenest.draft.vllm_format import how_to_serve  # noqa: E402
from eaglenest.serving.settings import ServerConfig  # noqa: E402
from eaglenest.settings import ValidateSettings  # noqa: E402
from eaglenest.vllm_facts import speculative_config  # noqa: E402
from eaglenest.validation.evalsets import read_prompts  # noqa: E402
from eaglenest.validation.predict import ngram_acceptance  # noqa: E402
from eaglenest.validation.requests import request_settings  # noqa: E402
from eaglenest.validation.runs import measure_run, validation_server  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="config.yaml")
    ap.add_argument("--draft", default="draft/checkpoint", help="the exported draft (vLLM's format)")
    ap.add_argument("--heldout", default="data/prompts/heldout.jsonl")
    ap.add_argument("--runs", type=int, default=3, help="timed one-request runs per method")
    ap.add_argument("--log-dir", default="logs/bench_speedup")
    args = ap.parse_args(argv)

    config = load_config(args.config)
    s = ValidateSettings.from_config(config)
    k = s.num_speculative_tokens
    srv = validation_server(s, ServerConfig.from_config(config))
    prompts = read_prompts(args.heldout)
    settings = request_settings(s)
    plan = {
        "baseline": (srv.model, speculative_config("baseline", k)),
        "eagle3": how_to_serve("vllm", args.draft, k, srv.model)[:2],
        "ngram": (srv.model, speculative_config("ngram", k, ngram=s.ngram)),
    }
    results = {}
    for name, (model, spec) in plan.items():
        run_srv = dataclasses.replace(srv, model=model, served_model_name=srv.model_id)
        r = measure_run(name, run_srv, spec, prompts, settings, log_dir=args.log_dir, concurrency=s.concurrency,
                        warmup_requests=s.warmup_requests, min_seconds=s.min_seconds,
                        k=None if name in ("baseline", "ngram") else k, one_request_runs=args.runs)
        one = r["one_request"]
        runs = one.get("runs_output_tokens_per_s") or [one["output_tokens_per_s"]]
        results[name] = {"one_request_tokens_per_s": runs, "median": statistics.median(runs),
                         "ms_per_token": one["ms_per_token"], "concurrent_tokens_per_s": r["output_tokens_per_s"],
                         "tokens_per_step": r.get("tokens_per_step"), "drafted_share": r.get("drafted_share"),
                         "acceptance_length": r.get("acceptance_length"), "load_average": r["load_average"]}
        if name == "baseline":  # greedy answers: what n-gram's lookup would see, simulated offline
            greedy = [(a["prompt_token_ids"] or [], a["completion_token_ids"]) for a in r["answers"]]
            offline = ngram_acceptance(greedy, k, s.ngram["prompt_lookup_min"], s.ngram["prompt_lookup_max"])

    base = results["baseline"]["median"]
    print(f"\n{len(prompts)} held-out prompts, k={k}, one request at a time, {args.runs} runs per method "
          f"({os.cpu_count()} CPU cores)")
    for name, r in results.items():
        al, steps, share = r["acceptance_length"], r["tokens_per_step"], r["drafted_share"]
        print(f"{name:9s} tok/s {', '.join(f'{v:.1f}' for v in r['one_request_tokens_per_s'])}  median {r['median']:.1f}"
              f"  speed-up ×{r['median'] / base:.2f}  {r['ms_per_token']:.2f} ms/token"
              f"  ({s.concurrency} in flight {r['concurrent_tokens_per_s']:.1f} tok/s)"
              + f"  {steps:.3f} tokens per target step"
              + (f" (acceptance length per drafted step {al:.3f}, drafted on {share:.0%} of steps)" if al else "")
              + f"  load {r['load_average'][0]:.2f}->{r['load_average'][1]:.2f}")
        r["speedup"] = r["median"] / base
    print(f"n-gram simulated on the target alone's answers: {offline['tokens_per_step']:.3f} tokens per target step "
          f"(acceptance length per drafted step {offline['acceptance_length']:.3f}, drafted on "
          f"{offline['drafted_share']:.0%} of steps)")
    results["ngram_offline"] = {key: offline[key] for key in ("tokens_per_step", "drafted_share", "acceptance_length",
                                                              "drafts", "accepted", "decode_steps")}
    print("SUMMARY " + json.dumps({"prompts": len(prompts), "k": k, "runs": args.runs, **results}))


if __name__ == "__main__":
    main()
