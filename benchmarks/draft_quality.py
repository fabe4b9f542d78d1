#!/usr/bin/env python3
"""Draft quality on a real model: our trainer against the peer's (speculators 0.9.0) on the same states.

What a token of training data teaches each trainer, measured the way vLLM would see it: both drafts are
trained on the same hidden states, the same draft vocabulary and auxiliary layers and the same number of
tokens, exported in vLLM's format by our exporter, and measured by the same offline simulation of greedy
chain speculation (``validation.predict.offline_acceptance``) at k tokens, T=0, on a held-out set never
trained on and on MT-Bench's first turns. n-gram (prompt lookup, ``predict.ngram_acceptance``) and the
target alone are measured on the same sequences. The figure compared is tokens per target forward over
every decode step (``tokens_per_step``); for an EAGLE draft, which drafts at every step, it equals vLLM's
acceptance length.

Stages, each a subcommand over one working directory (``--dir``, default ``dq``):

  data     the target (SmolLM2-135M-Instruct, converted from its GGUF) writes its own questions (Magpie:
           its chat template's user prefix, sampled) and greedy answers with transformers, batched; the
           answers go to ``traces/chunk_NNN.jsonl`` (``--chunk`` answers each, trace-record format), the
           held-out set and MT-Bench's first turns with their greedy answers to ``eval/*.jsonl``. Needs
           a GPU for 32k answers (vLLM does not run on the lent GPU machine).
  states   ``extract_hidden`` per chunk, ``save_target_head`` once, ``build_vocab`` per training size.
  train    per size: ours (``train_draft`` with the preset's recipe; ``--kinds`` adds other draft kinds)
           and the peer's (its EAGLE-3 model, loss, optimizer, schedule and data loader, fed our shards).
  eval     offline acceptance of every trained draft, n-gram and the target alone, per evaluation set.
  report   ``quality.json``, ``quality.md`` (the table, the gain per 4x data) and ``quality.png``.

``--from-run RUN`` takes the traces, hidden shards, target and head of a workflow run instead of ``data``
and ``states`` (the CPU workflow's SmolLM2 run: 4 shards of 500 answers, so sizes 500, 1000, 2000).

The peer adapter (``PeerShards``) hands speculators' own data path (``BaseDataset`` -> ``shift_batch`` ->
its multipack sampler and ``CollateFn``) each of our sequences as speculators' file loader returns one:
  hidden_states               <- aux_hidden [T, 3H] (the aux states at vLLM's ids, concatenated in order)
  input_ids                   <- input_ids [T]
  verifier_last_hidden_states <- last_hidden [T, H]
  loss_mask                   <- loss_mask [T] (completion tokens)
Our shards store the last hidden state AFTER the target's final norm; speculators applies the verifier's
norm itself, so the adapter makes ``verifier_norm`` the identity: its targets are then exactly
softmax(lm_head(last_hidden)), ours. ``check_peer_batch`` checks one batch's loss against speculators'
own path (the pre-norm last state through its real ``verifier_norm``).

Usage (GPU, one call each, the machine kept warm between them):
  python benchmarks/draft_quality.py data --gguf G --mtbench Q --answers 32000 --heldout 200
  python benchmarks/draft_quality.py states
  python benchmarks/draft_quality.py train --sizes 2000 8000 32000
  python benchmarks/draft_quality.py eval && python benchmarks/draft_quality.py report
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eaglenest.config import load_config  # noqa: E402
from eaglenest.settings import DraftSettings, ExportSettings, HiddenSettings, TrainSettings  # noqa: E402

PRESET = ROOT / "configs" / "smollm2-135m.yaml"


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path, rows):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def preset(overrides=None) -> dict:
    """The SmolLM2 preset's validated config with ``overrides`` ({"section.key": value}) applied."""
    import yaml

    from eaglenest.config import validate_config

    raw = yaml.safe_load(PRESET.read_text())
    for key, value in (overrides or {}).items():
        node = raw
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    # The recipe is what is read here, not the packaged files the preset names (the GPU machine lacks their
    # packages): the benchmark's own target and evaluation sets stand in for them.
    raw["server"]["model"] = "SmolLM2-135M-Instruct"
    raw.get("validate", {}).pop("datasets", None)
    return validate_config(raw, source=str(PRESET))


class Layout:
    """Where each stage's files are, in one working directory (or a workflow run's for its inputs)."""

    def __init__(self, root, from_run=None):
        self.root = Path(root)
        self.run = Path(from_run) if from_run else None

    @property
    def target(self):
        if self.run:
            models = sorted((self.run / "models").glob("*"))
            return models[0] if models else Path(load_config(self.run / "config.yaml")["server"]["model"])
        return self.root / "target"

    def traces(self):
        return sorted(p for p in (self.run / "traces").glob("shard_*.jsonl") if p.stem[6:].isdigit()) if self.run else sorted(
            (self.root / "traces").glob("chunk_*.jsonl"))

    def hidden(self):
        return sorted((self.run / "hidden").glob("shard_*.safetensors")) if self.run else sorted(
            (self.root / "hidden").glob("chunk_*.safetensors"))

    @property
    def head(self):
        return (self.run / "hidden" if self.run else self.root / "hidden") / "target_head.safetensors"

    def evalset(self, name):
        return self.root / "eval" / f"{name}.jsonl"

    def size_dir(self, n):
        return self.root / "sizes" / str(n)


# ----------------------------------------------------------------------------- data (transformers, batched)


def batched_generate(model, tokenizer, prompts, *, max_new_tokens, stop_ids, batch, sample=False, seed=0,
                     temperature=1.0, top_p=1.0, desc="generate"):
    """(completion ids, finished) per prompt id list, generated in batches of ``batch`` (left-padded, longest
    first so a batch's rows have similar lengths). A completion ends with its stop token when it has one."""
    from eaglenest.util import progress_bar

    dev = model.get_input_embeddings().weight.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out = [None] * len(prompts)
    bar = progress_bar(total=len(prompts), desc=desc, unit="seq")
    for b0 in range(0, len(order), batch):
        idx = order[b0:b0 + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        kw = dict(do_sample=True, temperature=temperature, top_p=top_p) if sample else dict(do_sample=False)
        if sample:
            torch.manual_seed(seed * 1_000_003 + b0)
        with torch.no_grad():
            gen = model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                                 eos_token_id=list(stop_ids), pad_token_id=pad, **kw)
        for r, i in enumerate(idx):
            completion = gen[r, width:].tolist()
            cut = next((j for j, t in enumerate(completion) if t in stop_ids), None)
            out[i] = (completion[: cut + 1], True) if cut is not None else (completion, False)
        bar.update(len(idx))
    bar.close()
    return out


def write_data(lay: Layout, gguf, mtbench, *, answers, heldout, chunk, batch, device, eval_limit=None, questions_file=None,
               max_tokens=None):
    """The target writes questions and greedy answers; see the module doc."""
    from transformers import AutoTokenizer

    from eaglenest.data.questions import fold, user_turn
    from eaglenest.gguf import convert_gguf
    from eaglenest.states.target import chat_prompt_ids, load_target

    cfg = preset()
    t0 = time.time()
    if not (lay.target / "config.json").exists():
        convert_gguf(gguf, lay.target, dtype="float32")
    tok = AutoTokenizer.from_pretrained(lay.target)
    model = load_target(str(lay.target), device=device, dtype=cfg["hidden"]["dtype"])
    eos = model.generation_config.eos_token_id
    eos = sorted(set([eos] if isinstance(eos, int) else eos) | {tok.eos_token_id})
    gen, g = cfg["generation"], cfg["dataset"]["generate"]

    # MT-Bench's first turns: evaluation prompts, never training questions
    mt = [{"id": f"mt{q['question_id']}", "messages": [{"role": "user", "content": q["turns"][0]}]} for q in read_jsonl(mtbench)][:eval_limit]
    excluded = {fold(p["messages"][0]["content"]) for p in mt}

    # questions (Magpie), kept as write_questions keeps them: ended by the model, long enough, distinct
    prefix, stop = user_turn(tok)
    prefix_ids = tok.encode(prefix, add_special_tokens=False)
    wanted, questions, seen, asked = answers + heldout, [], set(), 0
    kept = lay.root / "questions.jsonl"  # a rerun after a cut call starts from the questions already written
    if questions_file:  # given questions instead of the target's own (a quick run on a CPU)
        questions = [q["messages"][0]["content"] if "messages" in q else q["turns"][-1] for q in read_jsonl(questions_file)]
    elif kept.exists():
        questions = [q["question"] for q in read_jsonl(kept)]
    while len(questions) < wanted and asked < 3 * wanted:
        n = min(batch * 8, 3 * wanted - asked)
        got = batched_generate(model, tok, [prefix_ids] * n, max_new_tokens=g["max_tokens"], stop_ids=stop, batch=batch,
                               sample=True, seed=asked, temperature=g["temperature"], top_p=g["top_p"], desc="questions")
        asked += n
        for ids, finished in got:
            text = tok.decode(ids[:-1] if finished else ids, skip_special_tokens=True).strip()
            key = fold(text)
            if finished and len(text) >= g["min_chars"] and key not in seen and key not in excluded:
                seen.add(key)
                questions.append(text)
        log(f"data: {len(questions)} distinct questions from {asked} samples")
    questions = questions[:wanted]
    if not questions_file:
        write_jsonl(kept, [{"question": q} for q in questions])
    log(f"data: {len(questions)} questions in {time.time() - t0:.0f} s")

    # greedy answers (the preset's max_tokens), in trace-record format, a file at a time: each written as soon
    # as it is answered, and one already there is not asked again (a call cut by its time limit loses one file)
    prompts = [{"id": f"q{i}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(questions)] + mt
    n_train = min(answers, len(questions))
    files = [(lay.root / "traces" / f"chunk_{c:03d}.jsonl", c * chunk, min((c + 1) * chunk, n_train))
             for c in range(math.ceil(n_train / chunk))]
    files += [(lay.evalset("heldout"), n_train, len(questions)), (lay.evalset("mt_bench"), len(questions), len(prompts))]
    for path, lo, hi in files:
        if path.exists():
            continue
        group = prompts[lo:hi]
        prompt_ids = [chat_prompt_ids(tok, p["messages"]) for p in group]
        done = batched_generate(model, tok, prompt_ids, max_new_tokens=max_tokens or gen["max_tokens"], stop_ids=eos,
                                batch=batch, desc=f"answers {path.name}")
        write_jsonl(path, [{"id": p["id"], "prompt_token_ids": ids, "completion_token_ids": c, "truncated": not fin,
                            "messages": p["messages"]} for p, ids, (c, fin) in zip(group, prompt_ids, done)])
    train = [r for path, _, _ in files[:-2] for r in read_jsonl(path)]
    held, mt_rec = read_jsonl(lay.evalset("heldout")), read_jsonl(lay.evalset("mt_bench"))
    tokens = sum(len(r["completion_token_ids"]) for r in train)
    log(f"data: {len(train)} answers ({tokens} completion tokens), {len(held)} held out, {len(mt_rec)} MT-Bench, "
        f"in {time.time() - t0:.0f} s")


# ----------------------------------------------------------------------------- states


def size_chunks(lay: Layout, n):
    """The first chunks holding ``n`` answers: (trace paths, hidden paths); sizes are whole chunks (a workflow's
    shards hold about answers / shards each: within 5% counts)."""
    traces, hidden = lay.traces(), lay.hidden()
    counts, total = [], 0
    for t in traces:
        total += sum(1 for line in open(t) if line.strip())
        counts.append(total)
        if total >= 0.95 * n:
            break
    if abs(total - n) > 0.05 * n:
        raise SystemExit(f"size {n}: the chunks hold {counts} answers cumulatively; pick sizes at chunk boundaries")
    k = len(counts)
    return traces[:k], hidden[:k] if len(hidden) >= k else None


def extract_states(lay: Layout, sizes, device):
    from eaglenest.draft.vocab import build_vocab
    from eaglenest.states.hidden import extract_hidden
    from eaglenest.states.target import TargetFacts, load_target, save_target_head

    cfg = preset()
    hs = HiddenSettings.from_config(cfg).replace(backend="transformers", target=str(lay.target), device=device)
    if not lay.run:
        model = load_target(str(lay.target), device=device, dtype=hs.dtype)
        (lay.root / "hidden").mkdir(parents=True, exist_ok=True)
        # from the checkpoint, not ``model``: a tied head's two tensors would share memory on CPU (safetensors refuses)
        save_target_head(lay.head, hs)
        for t in lay.traces():
            out = lay.root / "hidden" / (t.stem + ".safetensors")
            if not out.exists():
                extract_hidden([t], out, hs, model=model, progress=False)
    facts = TargetFacts.read(lay.head)
    for n in sizes:
        traces, _ = size_chunks(lay, n)
        d = lay.size_dir(n)
        d.mkdir(parents=True, exist_ok=True)
        build_vocab(traces, d / "vocab.safetensors", facts.vocab_size, DraftSettings.from_config(cfg))


# ----------------------------------------------------------------------------- ours


def train_ours(lay: Layout, n, kind, overrides, device):
    """``train_draft`` (``train_dflash`` for draft.kind dflash) with the preset's recipe (plus ``overrides``),
    exported by ``export_draft``."""
    from eaglenest.draft.dflash_train import train_dflash
    from eaglenest.draft.export import export_draft
    from eaglenest.draft.train import train_draft

    cfg = preset(overrides)
    _, hidden = size_chunks(lay, n)
    d = lay.size_dir(n) / kind
    d.mkdir(parents=True, exist_ok=True)
    trainer = train_dflash if cfg["draft"]["kind"] == "dflash" else train_draft  # as rule train_draft picks
    stats = trainer(hidden, lay.size_dir(n) / "vocab.safetensors", d / "checkpoint.safetensors", d / "metrics.csv",
                        head_path=lay.head, settings=TrainSettings.from_config(cfg).replace(**({"device": device} if device else {})),
                        state_dir=d / "state", progress=False)
    export_draft(d / "checkpoint.safetensors", d / "export", ExportSettings.from_config(cfg))
    return {"trainer": kind, "seconds": stats.get("seconds"), "tokens": stats.get("tokens"), "steps": stats.get("steps"),
            "loss": stats.get("loss"), "acc": stats.get("acc"), "tokens_per_s": stats.get("tokens_per_s")}


# ----------------------------------------------------------------------------- the peer


def peer_config(lay: Layout, vocab_size, aux_layers, *, ttt, epochs, seed):
    """speculators' own TrainConfig: every default of its, but the verifier, the draft vocabulary and aux
    layers, the TTT depth and the epochs, which must equal ours; its eager loss (its fused kernel does not
    compile under the lent GPU's torch)."""
    from speculators.train.config.schema import TrainConfig

    # On a CPU: flex attention has no backward there, so sdpa (the same attention, a dense mask), and its
    # scores materialised, so 2,048-token packs (our recipe's batch) instead of its 8,192.
    cpu = {"draft_attn_impl": "sdpa"} if not torch.cuda.is_available() else {}
    return TrainConfig(
        speculator_type="eagle3", seed=seed,
        verifier={"verifier_name_or_path": str(lay.target)},
        draft={"draft_vocab_size": vocab_size, "target_layer_ids": list(aux_layers), **cpu},
        data={"data_path": str(lay.root), "num_workers": 0, **({"total_seq_len": 2048} if cpu else {})},
        loss={"ttt_steps": ttt, "loss_implementation": "eager"},
        trainer={"epochs": epochs},
    )


class PeerShards:
    """speculators' ``BaseDataset`` over our hidden shards (the mapping: module doc)."""

    def __new__(cls, hidden_paths, dtype):
        from speculators.train.data import BaseDataset

        from eaglenest.states.shards import HiddenShards

        class _Shards(BaseDataset):
            def __init__(self):
                self.shards = HiddenShards(hidden_paths)
                super().__init__(max_len=10**9, hidden_states_dtype=dtype)

            def __len__(self):
                return len(self.shards)

            def _compute_approx_lengths(self):
                return [self.shards.length(k) for k in range(len(self.shards))]

            def _get_raw_data(self, index):
                row = self.shards[index]
                return {"hidden_states": row["aux_hidden"], "input_ids": row["input_ids"].long(),
                        "verifier_last_hidden_states": row["last_hidden"], "loss_mask": row["loss_mask"].bool()}

        return _Shards()


def build_peer(tc, vocab_path, device):
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import build_draft_model

    from eaglenest.draft.vocab import load_vocab

    d2t, t2d = load_vocab(vocab_path)
    args = argparse.Namespace(**tc.flatten())
    model = build_draft_model(args, Eagle3DraftModel, t2d, d2t, len(d2t))
    model.verifier_norm = torch.nn.Identity()  # our last_hidden is post-norm already (module doc)
    return model.to(device), args


def train_peer(lay: Layout, n, device, *, seed=0):
    """speculators' training loop as its Trainer runs it (train_epoch): bf16 autocast over fp32 weights,
    its loss, clip 1.0, its optimizers (Muon + AdamW by default) and per-optimizer schedulers."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import _resolve_scheduler_steps
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    from eaglenest.states.target import TargetFacts

    cfg = preset()
    facts = TargetFacts.read(lay.head)
    _, hidden = size_chunks(lay, n)
    tr = TrainSettings.from_config(cfg)
    tc = peer_config(lay, cfg["draft"]["vocab_size"], facts.aux_layers, ttt=tr.ttt_length, epochs=tr.epochs, seed=seed)
    torch.manual_seed(seed)
    model, args = build_peer(tc, lay.size_dir(n) / "vocab.safetensors", device)
    dtype = getattr(torch, args.hidden_states_dtype)
    data = PeerShards(hidden, dtype)
    loader = _setup_dataloader(data, args.total_seq_len, facts.hidden_size, num_workers=0,
                               num_target_layers=len(facts.aux_layers), prefetch_factor=None, preprocess=shift_batch,
                               seed=seed)
    optimizers = build_optimizers(model, args)
    per_epoch = len(loader)
    epochs = math.ceil(tr.epochs)
    total = int(per_epoch * tr.epochs)
    # its scheduler's horizon as its Trainer resolves it (epochs x loader length; 1% warm-up by default)
    sched_cfg = argparse.Namespace(num_epochs=tr.epochs, max_steps=None, scheduler_total_steps=args.scheduler_total_steps,
                                   scheduler_warmup_steps=args.scheduler_warmup_steps,
                                   scheduler_warmup_ratio=args.scheduler_warmup_ratio)
    warmup, total_sched = _resolve_scheduler_steps(sched_cfg, per_epoch)
    make = (get_linear_schedule_with_warmup if args.scheduler_type == "linear" else
            lambda o, **k: get_cosine_schedule_with_warmup(o, num_cycles=args.scheduler_num_cosine_cycles, **k))
    schedulers = [make(o, num_warmup_steps=warmup, num_training_steps=total_sched) for o in optimizers]
    call = model.get_trainer_kwargs(**vars(args))[0]
    model.train()
    t0, step, tokens, losses = time.time(), 0, 0, []
    dev_type = "cuda" if str(device).startswith("cuda") else "cpu"
    for epoch in range(epochs):
        loader.batch_sampler.set_epoch(epoch)
        for batch in loader:
            if step >= total:
                break
            batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
                     if k != "error_records"}
            with torch.autocast(dev_type, dtype=dtype):
                _, loss, _ = model(**batch, **call)
            for o in optimizers:
                o.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for o in optimizers:
                o.step()
            for s in schedulers:
                s.step()
            tokens += int(batch["loss_mask"].sum())
            losses.append(float(loss.detach()))
            step += 1
    seconds = time.time() - t0
    d = lay.size_dir(n) / "peer"
    last = sum(losses[-20:]) / max(len(losses[-20:]), 1)
    write_peer_export(model, args, facts, cfg, d / "export",
                      train={"steps": step, "tokens": tokens, "seconds": round(seconds, 1), "loss": last,
                             "sequences": len(data)})
    log(f"peer {n}: {step} steps, {tokens} loss tokens in {seconds:.0f} s, last loss {sum(losses[-20:]) / max(len(losses[-20:]), 1):.4f}")
    return {"trainer": "peer", "seconds": round(seconds, 1), "steps": step, "loss_tokens": tokens,
            "loss": sum(losses[-20:]) / max(len(losses[-20:]), 1), "optimizer": args.optimizer, "lr": args.lr,
            "scheduler": args.scheduler_type, "warmup_steps": warmup, "total_seq_len": args.total_seq_len,
            "norm_before_fc": args.norm_before_fc, "norm_output": args.norm_output, "fc_norm": args.fc_norm,
            "norm_before_residual": args.norm_before_residual}


def write_peer_export(model, args, facts, cfg, out_dir, train=None):
    """The peer's draft in vLLM's format, written by our exporter with its switches (norm_before_fc,
    norm_output, fc_norm, norm_before_residual as its trainer set them)."""
    from eaglenest.draft.config import DraftConfig
    from eaglenest.draft.export import write_draft
    from eaglenest.draft.vllm_format import SWITCHES, state_dict_from_vllm

    switches = {key: bool(getattr(args, key)) for key in SWITCHES}
    dcfg = DraftConfig.from_target(facts, int(model.d2t.shape[0]), **{**DraftSettings.from_config(cfg).shape(), **switches})
    kept = {name: t.detach().float().cpu() for name, t in model.state_dict().items()
            if not name.startswith(("embed_tokens.", "verifier_lm_head.", "verifier_norm."))}
    # ``train`` (steps, loss tokens, seconds, loss) for the model card, which otherwise calls the draft untrained
    write_draft(out_dir, dcfg, facts, state_dict_from_vllm(kept, dcfg), None, train, "bfloat16", fmt="vllm")


def check_peer_batch(lay: Layout, n, device, sequences=4):
    """One batch's loss through the adapter (post-norm last state, identity verifier_norm) against
    speculators' own path (the state entering the target's final norm, through its real verifier_norm),
    same draft weights, same sequences, both collated by speculators' CollateFn after its shift_batch."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    from eaglenest.states.target import TargetFacts, decoder_of, load_target

    cfg = preset()
    facts = TargetFacts.read(lay.head)
    _, hidden = size_chunks(lay, n)
    tr = TrainSettings.from_config(cfg)
    tc = peer_config(lay, cfg["draft"]["vocab_size"], facts.aux_layers, ttt=tr.ttt_length, epochs=1, seed=0)
    torch.manual_seed(0)
    model, args = build_peer(tc, lay.size_dir(n) / "vocab.safetensors", device)
    data = PeerShards(hidden, torch.float32)
    items = [data[i] for i in range(sequences)]
    # padded to a whole number of flex-attention blocks (128), as the trainer's total_seq_len is: its TTT steps
    # extend a block mask made for the rounded-up length, which a length off the block grid does not fit
    max_len = -(-sum(int(it["lengths"]) for it in items) // 128) * 128
    collate = CollateFn(max_len, facts.hidden_size, num_target_layers=len(facts.aux_layers), dtype=torch.float32,
                        preprocess=shift_batch)
    target = load_target(str(lay.target), device=device, dtype="float32")
    norm = decoder_of(target).norm
    pre = []
    handle = norm.register_forward_pre_hook(lambda m, a: pre.append(a[0][0].float().cpu()))
    with torch.no_grad():
        for it in items:
            target(it["input_ids"][None].to(device))
    handle.remove()
    theirs_items = [{**it, "verifier_last_hidden_states": p} for it, p in zip(items, pre)]
    call = model.get_trainer_kwargs(**vars(args))[0]

    def loss_of(batch):
        batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            return float(model(**batch, **call)[1])

    ours = loss_of(collate([dict(it) for it in items]))
    model.verifier_norm = type(norm)(facts.hidden_size, eps=norm.variance_epsilon).to(device)
    with torch.no_grad():
        model.verifier_norm.weight.copy_(norm.weight)
    theirs = loss_of(collate(theirs_items))
    rel = abs(ours - theirs) / abs(theirs)
    log(f"peer adapter check: loss {ours:.5f} through our post-norm states, {theirs:.5f} through speculators' "
        f"pre-norm path (relative difference {rel:.2e}, {sequences} sequences, {max_len} tokens)")
    return {"adapter_loss": ours, "peer_path_loss": theirs, "relative_difference": rel}


# ----------------------------------------------------------------------------- evaluation


def eval_sets(lay: Layout, names=("heldout", "mt_bench")):
    return {name: [(r["prompt_token_ids"], r["completion_token_ids"]) for r in read_jsonl(lay.evalset(name))]
            for name in names if lay.evalset(name).exists()}


def evaluate(lay: Layout, sizes, trainers, ks, device, sets=("heldout", "mt_bench")):
    """Offline acceptance of every trained draft at each k in ``ks`` (a DFlash draft also at its own block, less
    the anchor), n-gram and the target alone, per evaluation set; rows appended to ``eval_results.jsonl``."""
    from eaglenest.draft.dflash_format import config_from_json, speculative_tokens
    from eaglenest.draft.vllm_format import kind_of
    from eaglenest.states.target import load_target
    from eaglenest.validation.predict import ngram_acceptance, offline_acceptance

    cfg = preset()
    model = load_target(str(lay.target), device=device, dtype=cfg["hidden"]["dtype"])
    ngram = cfg["validate"]["ngram"]
    results = []
    for name, seqs in eval_sets(lay, sets).items():
        for k in ks:
            ng = ngram_acceptance(seqs, k, ngram["prompt_lookup_min"], ngram["prompt_lookup_max"])
            results.append({"set": name, "method": "ngram", "k": k, **_figures(ng)})
        results.append({"set": name, "method": "target", "tokens_per_step": 1.0})
        for n in sizes:
            for tr in trainers:
                d = lay.size_dir(n) / tr / "export"
                if not (d / "config.json").exists():
                    continue
                config = json.loads((d / "config.json").read_text())
                kind = kind_of(config)
                own = [speculative_tokens(config_from_json(config)[0])] if kind == "dflash" else []
                for k in dict.fromkeys([*ks, *own]):
                    r = offline_acceptance(str(lay.target), d, k=k, sequences=seqs, model=model, progress=False)
                    results.append({"set": name, "method": "eagle3", "kind": kind, "k": k, "trainer": tr, "answers": n,
                                    **_figures(r)})
                    log(f"eval {name} {tr} ({kind}) {n} k={k}: {r.get('tokens_per_step', r['acceptance_length']):.3f} "
                        f"tokens/step, per position {[round(p, 3) for p in r['per_position']]}")
    out = lay.root / "eval_results.jsonl"  # the other sets' rows of an earlier call stay
    kept = [r for r in read_jsonl(out) if r["set"] not in sets] if out.exists() else []
    write_jsonl(out, kept + results)
    return results


def _figures(r):
    keys = ("tokens_per_step", "drafted_share", "acceptance_length", "per_position", "drafts", "accepted",
            "completion_tokens", "sequences", "target_agreement")
    return {k: r[k] for k in keys if k in r}


# ----------------------------------------------------------------------------- report


def report(lay: Layout):
    import pandas as pd

    rows = read_jsonl(lay.root / "eval_results.jsonl")
    trains = {(r["answers"], r["trainer"]): r for r in read_jsonl(lay.root / "train_results.jsonl")} \
        if (lay.root / "train_results.jsonl").exists() else {}
    k0 = min((r.get("k", 3) for r in rows if r["method"] == "eagle3"), default=3)  # the table: the smallest k
    df = pd.DataFrame([r for r in rows if r["method"] == "eagle3" and r.get("k", k0) == k0])
    table = df.pivot_table(index="answers", columns=["set", "trainer"], values="tokens_per_step")
    lines = ["| answers | " + " | ".join(f"{s} {t}" for s, t in table.columns) + " |",
             "|---" * (len(table.columns) + 1) + "|"]
    for n, row in table.iterrows():
        lines.append(f"| {n:,} | " + " | ".join(f"{v:.3f}" for v in row.values) + " |")
    for r in rows:
        if r["method"] == "ngram":
            if r.get("drafted_share"):
                lines.append(f"\nn-gram on {r['set']} (k={r.get('k', 3)}): {r['tokens_per_step']:.3f} tokens per step "
                             f"(drafted on {r['drafted_share']:.0%} of steps; {r['acceptance_length']:.3f} per drafted step)")
            else:  # no n-gram matched anywhere: vLLM's per-draft figures are undefined
                lines.append(f"\nn-gram on {r['set']}: never drafted, 1.000 tokens per step")
    sizes = sorted(table.index)
    for col in table.columns:
        gains = [table[col][b] - table[col][a] for a, b in zip(sizes, sizes[1:]) if b == 4 * a]
        if gains:
            lines.append(f"gain per 4x data, {col[0]} {col[1]}: " + ", ".join(f"{g:+.3f}" for g in gains))
    for (n, tr), t in sorted(trains.items()):
        lines.append(f"train {tr} {n}: {t.get('seconds')} s, {t.get('steps')} steps")
    (lay.root / "quality.md").write_text("\n".join(lines) + "\n")
    (lay.root / "quality.json").write_text(json.dumps({
        "tokens_per_step": {f"{s} {t}": {str(n): v for n, v in table[(s, t)].items()} for s, t in table.columns},
        "eval": rows, "train": list(trains.values())}, indent=2, default=str) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for col in table.columns:
            ax.plot(table.index, table[col], marker="o", label=f"{col[0]} {col[1]}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training answers")
        ax.set_ylabel("tokens per target forward (k=3, T=0)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(lay.root / "quality.png", dpi=120)
    except ImportError:
        log("report: no matplotlib, no plot")


# ----------------------------------------------------------------------------- main


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=["data", "states", "train", "check", "eval", "report"])
    p.add_argument("--dir", default="dq")
    p.add_argument("--from-run", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gguf")
    p.add_argument("--mtbench")
    p.add_argument("--answers", type=int, default=32000)
    p.add_argument("--heldout", type=int, default=200)
    p.add_argument("--eval-limit", type=int, default=None, help="MT-Bench first turns asked (default: all 80)")
    p.add_argument("--heldout-from", default=None, help="states: the held-out set's greedy answers from this trace file")
    p.add_argument("--questions", default=None, help="a JSON-lines file of questions instead of the target's own")
    p.add_argument("--max-tokens", type=int, default=None, help="answer tokens (default: the preset's)")
    p.add_argument("--chunk", type=int, default=2000)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 8000, 32000])
    p.add_argument("--trainers", nargs="+", default=["ours", "peer"],
                   help="ours, peer, or ours:KEY=VALUE[,KEY=VALUE] for our trainer with config overrides")
    p.add_argument("--k", type=int, nargs="+", default=[3], help="eval: draft tokens per step (several: each)")
    p.add_argument("--sets", nargs="+", default=["heldout", "mt_bench"],
                   help="eval: the evaluation sets measured (the other sets' rows already written are kept)")
    a = p.parse_args(argv)
    lay = Layout(a.dir, a.from_run)
    lay.root.mkdir(parents=True, exist_ok=True)
    if a.stage == "data":
        write_data(lay, a.gguf, a.mtbench, answers=a.answers, heldout=a.heldout, chunk=a.chunk, batch=a.batch,
                   device=a.device, eval_limit=a.eval_limit,
                   questions_file=a.questions, max_tokens=a.max_tokens)
    elif a.stage == "states":
        extract_states(lay, a.sizes, a.device)
        if a.heldout_from:  # greedy answers never trained on (e.g. a workflow shard past the largest size)
            write_jsonl(lay.evalset("heldout"), read_jsonl(a.heldout_from)[:a.heldout])
    elif a.stage == "check":
        print(json.dumps(check_peer_batch(lay, a.sizes[0], a.device)))
    elif a.stage == "train":
        out = lay.root / "train_results.jsonl"
        done = read_jsonl(out) if out.exists() else []
        for n in a.sizes:
            for tr in a.trainers:
                if any(r["answers"] == n and r["trainer"] == tr.partition(":")[0] for r in done):
                    continue
                log(f"train {tr} on {n} answers")
                if tr == "peer":
                    r = train_peer(lay, n, a.device)
                else:
                    name, _, spec = tr.partition(":")
                    overrides = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
                    r = train_ours(lay, n, name, {k: yaml_value(v) for k, v in overrides.items()}, a.device)
                    r["overrides"] = overrides
                row = {**r, "trainer": tr.partition(":")[0], "answers": n}
                done.append(row)
                with open(out, "a") as f:  # one line appended: trainers run side by side append to the same file
                    f.write(json.dumps(row) + "\n")
    elif a.stage == "eval":
        trainers = sorted({p.parent.name for p in lay.root.glob("sizes/*/*/export")})
        evaluate(lay, a.sizes, trainers, a.k, a.device, a.sets)
    elif a.stage == "report":
        report(lay)


def yaml_value(v):
    import yaml

    return yaml.safe_load(v)


if __name__ == "__main__":
    main()
