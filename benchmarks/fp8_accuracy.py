"""Does the draft learn the same with FP8 products (train.fp8) as in bf16? Issue 41's check.

Self-contained, from files in the repo: the toy target (toy/target) answers the bundled prompts
(toy/prompts.jsonl) greedily with transformers' generate, which makes the traces; its hidden states
are extracted with `eaglenest.states.hidden.extract_hidden` (the transformers backend) into one shard,
with the head and the vocabulary as the workflow writes them. Then `train_draft` runs twice on that
shard, default config (on CUDA: the compiled flex path) with the toy's schedule, same steps and
seed, once with `fp8: false` and once with `fp8: true`. Printed: both loss curves side by side and,
per TTT position, the top-1 agreement with the target (train_draft's `acc_j`, the metric acceptance
follows) averaged over the last fifth of the steps, with the absolute difference. Only sequences
of at most 128 tokens (nearly all; about 75 is typical) are kept: one batch shape, one compiled
graph per run.

    PYTHONPATH=. python3 benchmarks/fp8_accuracy.py --steps 300 [--out DIR]

On a CPU, `--cpu-fp8` forces the FP8 run on (torch._scaled_mm runs there too; slow, a check of the plumbing,
not of the GPU's arithmetic).
"""

import argparse
import csv
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "toy"


def toy_build():
    spec = importlib.util.spec_from_file_location("toy_build", TOY / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_data(root, seqs, dev, max_len=128):
    """Traces of the toy target's greedy answers, one shard of its states, its head and the vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglenest.settings import DraftSettings, HiddenSettings
    from eaglenest.draft.vocab import build_vocab
    from eaglenest.states.hidden import extract_hidden
    from eaglenest.states.target import save_target_head

    build = toy_build()
    rows = build.read_prompts(TOY / "prompts.jsonl")[:seqs]
    tok = AutoTokenizer.from_pretrained(TOY / "target")
    target = AutoModelForCausalLM.from_pretrained(TOY / "target", dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    target = target.to(dev).eval()
    questions = [r["conversations"][0]["value"] for r in rows]
    t0 = time.perf_counter()
    comps = build.greedy_completions(target.to(dev), _OnDevice(tok, dev), questions, batch_size=256 if dev == "cuda" else 32)
    gen_s = time.perf_counter() - t0
    traces, kept = root / "traces.jsonl", 0
    with open(traces, "w") as f:
        for i, (q, c) in enumerate(zip(questions, comps)):
            prompt = tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
            if len(prompt) + len(c) <= max_len:
                f.write(json.dumps({"id": f"{i:08x}", "prompt_token_ids": prompt, "completion_token_ids": c, "truncated": False}) + "\n")
                kept += 1
    V = target.config.vocab_size
    ext = extract_hidden([traces], root / "shard_0.safetensors",
                         HiddenSettings.defaults().replace(target=str(TOY / "target"), max_length=max_len, batch_tokens=16384, device=dev),
                         model=target, progress=False)
    save_target_head(root / "target_head.safetensors", HiddenSettings.defaults().replace(target=str(TOY / "target")), model=target)
    build_vocab([traces], root / "vocab.safetensors", V, DraftSettings.defaults().replace(vocab_size=V))
    del target
    return {"sequences": kept, "of": len(rows), "tokens": ext.get("tokens"), "generate_s": round(gen_s, 1)}


class _OnDevice:
    """The tokenizer, its encodings moved to ``dev`` (greedy_completions calls it and generates)."""

    def __init__(self, tok, dev):
        self.tok, self.dev = tok, dev

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __setattr__(self, name, value):
        if name in ("tok", "dev"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.tok, name, value)

    def __call__(self, *args, **kwargs):
        return self.tok(*args, **kwargs).to(self.dev)


def train(root, name, config, dev):
    from eaglenest.draft.train import train_draft
    from eaglenest.settings import TrainSettings

    t0 = time.perf_counter()
    stats = train_draft([root / "shard_0.safetensors"], root / "vocab.safetensors", root / f"{name}.safetensors",
                        root / f"{name}.csv", head_path=root / "target_head.safetensors",
                        settings=TrainSettings.defaults().replace(**config, device=dev), state_dir=root / f"state_{name}", progress=False)
    rows = list(csv.DictReader(open(root / f"{name}.csv")))
    return rows, stats, round(time.perf_counter() - t0, 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seqs", type=int, default=2000, help="toy prompts answered (those of at most 128 tokens are kept)")
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per step (the toy's schedule: 4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for a JSON copy of the results")
    p.add_argument("--cpu-fp8", action="store_true", help="CPU: the FP8 run forced on (a plumbing check)")
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.cpu_fp8:  # the CPU plumbing check: FP8 forced on
        from eaglenest.draft import device as device_mod

        device_mod.resolve_fp8 = lambda setting, device, capability=None: bool(setting)
    # the toy's schedule (config.yaml), at --ttt TTT steps
    config = {"max_steps": a.steps, "batch_tokens": a.batch_tokens, "lr": 0.001, "warmup_steps": min(20, a.steps // 10),
              "ttt_length": a.ttt, "seed": a.seed, "log_every": 10}
    root = Path(tempfile.mkdtemp(prefix="fp8-accuracy-"))
    try:
        data = make_data(root, a.seqs, dev)
        print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}; torch {torch.__version__}; data {json.dumps(data)}",
              flush=True)
        runs = {}
        for name, fp8_on in (("bf16", False), ("fp8", True)):
            torch.manual_seed(a.seed)
            runs[name] = train(root, name, {**config, "fp8": fp8_on}, dev)
            print(f"{name}: {runs[name][2]} s, loss {runs[name][1]['loss']:.4f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (b_rows, _, b_s), (f_rows, _, f_s) = runs["bf16"], runs["fp8"]
    every = max(1, a.steps // 30)
    print("\nloss by step (bf16 | fp8 | fp8 - bf16)")
    print("| step | bf16 | fp8 | diff |\n|---|---|---|---|")
    curve = []
    for b, f in zip(b_rows, f_rows):
        step, lb, lf = int(b["step"]), float(b["loss"]), float(f["loss"])
        curve.append((step, lb, lf))
        if step % every == 0 or step == 1 or step == a.steps:
            print(f"| {step} | {lb:.4f} | {lf:.4f} | {lf - lb:+.4f} |")
    window = max(1, a.steps // 5)
    tail_b, tail_f = b_rows[-window:], f_rows[-window:]

    def mean(rows, key):
        return sum(float(r[key]) for r in rows) / len(rows)

    print(f"\ntop-1 agreement with the target per TTT position, mean over the last {window} steps")
    print("| position | bf16 | fp8 | abs diff (points) |\n|---|---|---|---|")
    acc = []
    for j in range(a.ttt):
        ab, af = mean(tail_b, f"acc_{j}"), mean(tail_f, f"acc_{j}")
        acc.append({"position": j, "bf16": round(ab, 4), "fp8": round(af, 4), "abs_diff_points": round(100 * abs(af - ab), 2)})
        print(f"| {j} | {ab:.4f} | {af:.4f} | {100 * abs(af - ab):.2f} |")
    loss_b, loss_f = mean(tail_b, "loss"), mean(tail_f, "loss")
    worst = max(r["abs_diff_points"] for r in acc)
    ok = worst <= 1.0
    print(f"\nloss, mean over the last {window} steps: bf16 {loss_b:.4f}, fp8 {loss_f:.4f} ({100 * (loss_f / loss_b - 1):+.2f}%)")
    print(f"largest per-position difference {worst:.2f} points (goal <= 1): {'OK' if ok else 'NOT MET'}; "
          f"run time bf16 {b_s} s, fp8 {f_s} s (compilation included)")
    result = {"device": dev, "steps": a.steps, "ttt": a.ttt, "window": window, "data": data, "acc": acc,
              "tail_loss": {"bf16": round(loss_b, 4), "fp8": round(loss_f, 4)}, "worst_abs_diff_points": worst, "ok": ok,
              "curve": curve, "run_s": {"bf16": b_s, "fp8": f_s}}
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "fp8_accuracy.json").write_text(json.dumps(result, indent=1))
    print("SUMMARY " + json.dumps({k: v for k, v in result.items() if k != "curve"}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
