"""The embedded toy target: a tiny reasoning Llama that the default workflow serves and drafts for.

It is built from a seed by code in this module: a character-level tokenizer with chat markers and
`<think>`/`</think>`, a chat template that opens a thinking section like DeepSeek-R1, and a deep,
narrow Llama (28 layers x 128) trained on procedurally generated arithmetic (per-digit steps inside
the thinking section, then the answer). The same generator writes the bundled prompts.

Depth is what makes the toy a fair speculative-decoding demo: a real target costs tens to hundreds
of times its one-layer draft, and on a CPU a layer's cost at this width is mostly fixed per-layer
overhead, so depth (not width) buys cost cheaply while the weights stay small. Training a deep model
from scratch is slow and fragile, so the build trains a 4-layer model first, grows it to full depth
with the new layers' output projections at zero (the deep model computes exactly the shallow one's
function), then trains the deep model briefly so that every layer takes part.

    python toy/build.py --out toy/target --prompts toy/prompts.jsonl --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import random
import string
import time
from collections.abc import Sequence
from pathlib import Path

# --- tokenizer --------------------------------------------------------------------------------

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
ROLE_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Not special: vLLM detokenizes with skip_special_tokens=True and its deepseek_r1 reasoning parser
# splits on the "</think>" text, so these must survive decoding (DeepSeek-R1 and Qwen3 do the same).
THINK_START, THINK_END = "<think>", "</think>"
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"

# Jinja, saved with the tokenizer so that vLLM's /v1/chat/completions renders the same prompt.
# Earlier assistant turns keep only their content (as DeepSeek-R1 does) and their tool calls' names; a
# tool's result is a user turn in brackets (so conversations with tool calls render: issue 54); the
# generation prompt opens the thinking section, so the model writes reasoning, "</think>", the answer, then eos.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = none %}{%- endif %}"
    "{{- bos_token }}"
    "{%- if system %}{{- '<|system|>' + system }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{- '<|user|>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}{{- '<|assistant|>' + (m['content'] or '') }}"
    "{%- for call in m['tool_calls'] or [] %}{{- '[' + call['function']['name'] + ']' }}{%- endfor %}"
    "{{- eos_token }}"
    "{%- elif m['role'] == 'tool' %}{{- '<|user|>[' + m['content'] + ']' }}"
    "{%- else %}{{- raise_exception('toy chat template: unsupported role ' + m['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|><think>\\n' }}{%- endif %}"
)


def build_tokenizer(out_dir=None):
    """Return the character-level PreTrainedTokenizerFast; save it to out_dir when given."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = [BOS, EOS, PAD, UNK, *ROLE_MARKERS]
    vocab = {t: i for i, t in enumerate([*specials, THINK_START, THINK_END, *CHARS])}
    # BPE without merges splits text into single characters; Fuse joins them back on decode
    # (the default decoder would put spaces between tokens).
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    core.add_tokens([AddedToken(t, special=False, normalized=False)
                     for t in (THINK_START, THINK_END)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=ROLE_MARKERS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        tok.save_pretrained(out_dir)
    return tok


def render_prompt(question: str, system: str | None = None) -> str:
    """The chat template's generation prompt for one user question, rendered without transformers
    (fast enough to call for every training sample)."""
    global _TEMPLATE
    if _TEMPLATE is None:
        import jinja2

        _TEMPLATE = jinja2.Environment().from_string(CHAT_TEMPLATE)
    messages = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": question})
    return _TEMPLATE.render(messages=messages, bos_token=BOS, eos_token=EOS,
                            add_generation_prompt=True)


_TEMPLATE = None


def completion_text(sample: dict) -> str:
    """What the model writes after the generation prompt, eos excluded."""
    return f"{sample['reasoning']}\n{THINK_END}\n\n{sample['answer']}"


# --- task ---------------------------------------------------------------------------------------

# Phrasings per operation; {x} and {y} are the operands in the order the reasoning uses them.
PHRASINGS = {
    "+": ["What is {x} + {y}?", "What is {x} plus {y}?", "Compute {x} + {y}.", "Add {x} and {y}.",
          "Find the sum of {x} and {y}.", "How much is {x} plus {y}?", "Calculate {x}+{y}.",
          "{x} + {y} = ?", "What do you get if you add {y} to {x}?"],
    "-": ["What is {x} - {y}?", "What is {x} minus {y}?", "Compute {x} - {y}.",
          "Subtract {y} from {x}.", "Find the difference {x} - {y}.", "How much is {x} minus {y}?",
          "Calculate {x}-{y}.", "{x} - {y} = ?", "Take {y} away from {x}."],
    "*": ["What is {x} * {y}?", "What is {x} times {y}?", "Compute {x} * {y}.",
          "Multiply {x} by {y}.", "Find the product of {x} and {y}.", "How much is {x} times {y}?",
          "Calculate {x}*{y}.", "{x} * {y} = ?", "What is {y} times {x}?"],
}
SYSTEM_PROMPTS = ["You are a careful calculator.", "Think step by step.",
                  "You are a helpful assistant.", "Answer with the exact number."]


def _steps(op: str, x: int, y: int) -> list[str]:
    """Per-digit steps, least significant first; carries and borrows are written as numbers, not
    words, so that steps differ from each other (a repeated word in every step lowers the
    distinct-4-gram ratio and makes a draft's job artificially easy)."""
    xs = [int(c) for c in reversed(str(x))]
    lines, carry = [], 0
    if op == "*":
        for d in xs:
            v = d * y + carry
            lines.append(f"{d}*{y}" + (f"+{carry}" if carry else "") + f"={v}")
            carry = v // 10
        return lines
    ys = [int(c) for c in reversed(str(y))] + [0] * (len(xs) - len(str(y)))
    for a, b in zip(xs, ys):
        if op == "+":
            v = a + b + carry
            lines.append(f"{a}+{b}" + (f"+{carry}" if carry else "") + f"={v}")
            carry = v // 10
        else:
            a -= carry  # the borrow taken by the previous digit
            carry = int(a < b)
            lines.append(f"{a + 10 * carry}-{b}={a + 10 * carry - b}")
    return lines


def make_sample(rng: random.Random) -> dict:
    """One arithmetic question with its reasoning (the operands restated, then per-digit steps)
    and its final answer."""
    # Three-digit operands: with a fixed width each digit sits at a fixed offset, which the model learns
    # within the step budget where mixed widths are not (benchmarks/RESULTS.md, "Figures moved out of
    # code comments").
    op = rng.choice("+-*")
    x, y = rng.randint(100, 999), (rng.randint(2, 9) if op == "*" else rng.randint(100, 999))
    if op == "-" and x < y:
        x, y = y, x
    result = {"+": x + y, "-": x - y, "*": x * y}[op]
    # The reasoning restates the operands before the steps that read them: it is learned faster
    # (benchmarks/RESULTS.md, "Figures moved out of code comments").
    return {
        "question": rng.choice(PHRASINGS[op]).format(x=x, y=y),
        "reasoning": "\n".join([f"{x}{op}{y}", *_steps(op, x, y)]),
        "answer": f"{x} {op} {y} = {result}",
    }


def write_prompts(path, n: int, seed: int) -> None:
    """Write n distinct questions in the open-perfectblend schema (one JSON object per line)."""
    rng = random.Random(f"eaglenest-toy-prompts-{seed}")  # distinct from the training stream
    seen, rows = set(), []
    while len(rows) < n:
        s = make_sample(rng)
        if s["question"] in seen:
            continue
        seen.add(s["question"])
        rows.append({
            "conversations": [{"from": "human", "value": s["question"]},
                              {"from": "gpt", "value": s["answer"]}],
            "source": "eaglenest-toy/arithmetic",
        })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# Question forms the toy never trained on (none is in PHRASINGS): the second evaluation set of the
# embedded default, in GSM8K's row shape ({"question", "answer"}), a shape the training file does not use.
EVAL_PHRASINGS = {
    "+": ["Work out {x} plus {y}.", "Please add {x} and {y}.", "Give the sum {x} + {y}."],
    "-": ["Work out {x} minus {y}.", "Please subtract {y} from {x}.", "Give the difference {x} - {y}."],
    "*": ["Work out {x} times {y}.", "Please multiply {x} by {y}.", "Give the product {x} * {y}."],
}


def write_eval_prompts(path, n: int, seed: int) -> None:
    """Write n distinct questions in the new forms (EVAL_PHRASINGS), one {"question", "answer"} a line."""
    rng = random.Random(f"eaglenest-toy-eval-{seed}")
    seen, rows = set(), []
    while len(rows) < n:
        s = make_sample(rng)
        op = next(c for c in "+-*" if f" {c} " in s["answer"])
        x, y = (int(v) for v in s["answer"].split(" = ")[0].split(f" {op} "))
        question = rng.choice(EVAL_PHRASINGS[op]).format(x=x, y=y)
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": s["answer"]})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# --- quality metric -----------------------------------------------------------------------------

def answer_quality(texts: Sequence[Sequence[int]]) -> dict:
    """Diversity of a set of completions (token ids, reasoning included).

    unique_fraction: distinct completions / completions. distinct_4gram_ratio: mean over
    completions of distinct 4-grams / all 4-grams (completions shorter than 4 tokens are left out).
    A looping or question-independent target scores low on one of them, and makes drafting trivial.
    """
    ratios = []
    for t in texts:
        grams = [tuple(t[i:i + 4]) for i in range(len(t) - 3)]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    return {
        "unique_fraction": len({tuple(t) for t in texts}) / max(len(texts), 1),
        "distinct_4gram_ratio": sum(ratios) / max(len(ratios), 1),
    }


# --- model --------------------------------------------------------------------------------------

# The shipped depth: a target whose tokens cost vLLM real work beside the one-layer draft, with weights
# small enough to ship in the repository (benchmarks/RESULTS.md, "Figures moved out of code comments").
# The shallow model trained first has 4.
LAYERS, BASE_LAYERS = 28, 4


def model_config(tok, layers: int = LAYERS):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4,  # head_dim 32: vLLM's CPU attention has it
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        # float32 compute: greedy decoding stays stable, and vLLM with --dtype float32 reproduces
        # transformers' greedy tokens exactly (its default downcasts to bfloat16). The weights are
        # stored in bfloat16 (see save_target), which both upcast on load.
        dtype="float32",
    )


def _batches(tok, rng: random.Random, batch_size: int, pool: int = 8):
    """Endless training batches: right-padded input ids [B, T] and labels [B, T] (-100 on prompt
    and padding). Samples are drawn pool batches at a time and grouped by length, which cuts the
    padding (and so the CPU time per step) by about a third."""
    import torch

    while True:
        rows = []
        for _ in range(batch_size * pool):
            s = make_sample(rng)
            system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.1 else None
            rows.append((render_prompt(s["question"], system), completion_text(s) + EOS))
        p_ids = tok([p for p, _ in rows], add_special_tokens=False)["input_ids"]
        c_ids = tok([c for _, c in rows], add_special_tokens=False)["input_ids"]
        pairs = sorted(zip(p_ids, c_ids), key=lambda pc: len(pc[0]) + len(pc[1]))
        chunks = [pairs[i:i + batch_size] for i in range(0, len(pairs), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            width = max(len(p) + len(c) for p, c in chunk)
            ids = torch.full((len(chunk), width), tok.pad_token_id)
            labels = torch.full((len(chunk), width), -100)
            for i, (p, c) in enumerate(chunk):
                ids[i, :len(p) + len(c)] = torch.tensor(p + c)
                labels[i, len(p):len(p) + len(c)] = torch.tensor(c)  # loss where the model answers
            yield ids, labels


def _train(model, batches, steps: int, lr: float, log_every: int, log, name: str) -> float:
    """AdamW with linear warmup and cosine decay to a tenth; returns the final smoothed loss."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(steps // 20, 1)

    def lr_at(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    t0, loss_avg = time.time(), None
    model.train()
    for step in range(1, steps + 1):
        ids, labels = next(batches)
        # No attention mask: padding is on the right, so causal attention never lets a real token
        # see it, and its positions carry no loss.
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_avg = loss.item() if loss_avg is None else 0.9 * loss_avg + 0.1 * loss.item()
        if step % log_every == 0 or step == steps:
            log(f"{name} step {step}/{steps}  loss {loss_avg:.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                f"{time.time() - t0:.0f}s")
    model.eval()
    return loss_avg


def grow(shallow, tok, layers: int):
    """A `layers`-deep model that computes exactly what `shallow` computes: the shallow layers keep
    their weights at evenly spread depths; every other layer is freshly initialised except its
    attention and MLP output projections, which are zero, so it adds nothing to the residual stream
    until training moves them."""
    import torch
    from transformers import LlamaForCausalLM

    deep = LlamaForCausalLM(model_config(tok, layers))
    n = shallow.config.num_hidden_layers
    slots = {round(i * (layers - 1) / (n - 1)): i for i in range(n)}  # deep index -> shallow index
    state = deep.state_dict()
    for name, tensor in shallow.state_dict().items():
        if not name.startswith("model.layers."):
            state[name] = tensor.clone()
    for j in range(layers):
        prefix = f"model.layers.{j}."
        if j in slots:
            src = f"model.layers.{slots[j]}."
            for name in [k for k in state if k.startswith(prefix)]:
                state[name] = shallow.state_dict()[src + name[len(prefix):]].clone()
        else:
            for proj in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                state[prefix + proj] = torch.zeros_like(state[prefix + proj])
    deep.load_state_dict(state)
    return deep


def save_target(model, tok, out_dir) -> None:
    """Save model (bfloat16 weights, a float32 compute dtype in config.json), tokenizer and chat
    template. bfloat16 halves the shipped size; transformers and vLLM (--dtype float32) both upcast
    the same rounded weights, so they still agree."""
    import torch
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model.to(torch.float32)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "float32"  # save_pretrained writes the weights' dtype
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(out_dir)


def build_target(out_dir, seed: int = 0, steps: int = 750, deep_steps: int = 150,
                 layers: int = LAYERS, batch_size: int = 64, lr: float = 1.25e-3,
                 deep_lr: float = 3e-4, log_every: int = 50, log=print) -> dict:
    """Train the toy target from seed (a BASE_LAYERS model for `steps`, then grown to `layers` and
    trained for `deep_steps`) and save it to out_dir. Returns a summary (params, steps, seconds,
    final loss)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(seed)
    tok = build_tokenizer()
    rng = random.Random(f"eaglenest-toy-train-{seed}")
    batches = _batches(tok, rng, batch_size)
    t0 = time.time()
    model = LlamaForCausalLM(model_config(tok, BASE_LAYERS))
    loss = _train(model, batches, steps, lr, log_every, log, f"{BASE_LAYERS} layers")
    if layers != BASE_LAYERS:
        model = grow(model, tok, layers)
        loss = _train(model, batches, deep_steps, deep_lr, log_every, log, f"{layers} layers")
    seconds = time.time() - t0
    save_target(model, tok, out_dir)
    return {"params": sum(p.numel() for p in model.parameters()), "layers": layers,
            "steps": steps + (deep_steps if layers != BASE_LAYERS else 0), "seconds": seconds,
            "loss": loss}


# --- evaluation ---------------------------------------------------------------------------------

def greedy_completions(model, tok, questions: Sequence[str], max_new_tokens: int = 160,
                       batch_size: int = 64) -> list[list[int]]:
    """Greedy completion token ids per question (up to and including eos), via the chat template."""
    import torch

    out, side = [], tok.padding_side
    tok.padding_side = "left"  # generation continues from the right edge
    for i in range(0, len(questions), batch_size):
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True)
                   for q in questions[i:i + batch_size]]
        enc = tok(prompts, add_special_tokens=False, return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for row in gen[:, enc["input_ids"].shape[1]:].tolist():
            # generate pads finished rows; keep tokens up to the first eos
            out.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    tok.padding_side = side
    return out


def final_answer(tok, completion: Sequence[int]) -> str:
    """The text after </think>, as vLLM's deepseek_r1 parser would return it (stripped)."""
    text = tok.decode(completion, skip_special_tokens=True)
    return text.partition(THINK_END)[2].strip()


def evaluate(model_dir, rows: Sequence[dict]) -> dict:
    """Greedy-decode the human turn of each prompt row; exact match against the gpt turn, plus
    answer_quality and the mean completion length in tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    questions = [r["question"] if "question" in r else r["conversations"][0]["value"] for r in rows]
    answers = [r["answer"] if "answer" in r else r["conversations"][1]["value"] for r in rows]
    comps = greedy_completions(model, tok, questions)
    exact = sum(final_answer(tok, c) == a for c, a in zip(comps, answers))
    return {"exact_match": exact / len(rows), **answer_quality(comps),
            "mean_tokens": sum(map(len, comps)) / len(comps),
            "ended_with_eos": sum(c[-1:] == [tok.eos_token_id] for c in comps) / len(comps)}


def read_prompts(path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python toy/build.py", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="toy/target", help="model directory to write")
    ap.add_argument("--prompts", default="toy/prompts.jsonl", help="prompts file to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=750, help="training steps of the 4-layer model")
    ap.add_argument("--layers", type=int, default=LAYERS, help="depth of the shipped model")
    ap.add_argument("--deep-steps", type=int, default=150, help="training steps after growing")
    ap.add_argument("--eval-prompts", default="toy/eval_prompts.jsonl", help="second evaluation set to write")
    ap.add_argument("--n-prompts", type=int, default=2000)
    ap.add_argument("--n-eval-prompts", type=int, default=24)
    ap.add_argument("--n-eval", type=int, default=200, help="shipped prompts to evaluate on")
    args = ap.parse_args(argv)

    write_prompts(args.prompts, args.n_prompts, args.seed)
    write_eval_prompts(args.eval_prompts, args.n_eval_prompts, args.seed)
    summary = build_target(args.out, seed=args.seed, steps=args.steps, deep_steps=args.deep_steps,
                           layers=args.layers)
    q = evaluate(args.out, read_prompts(args.prompts)[:args.n_eval])
    print(f"toy target: {summary['layers']} layers, {summary['params'] / 1e6:.2f}M params, "
          f"{summary['steps']} steps, "
          f"{summary['seconds']:.0f}s; on {args.n_eval} prompts: exact {q['exact_match']:.1%}, "
          f"unique {q['unique_fraction']:.1%}, distinct 4-grams {q['distinct_4gram_ratio']:.3f}, "
          f"{q['mean_tokens']:.0f} tokens/completion, eos {q['ended_with_eos']:.0%}", flush=True)


if __name__ == "__main__":
    main()
