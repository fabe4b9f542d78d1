#!/usr/bin/env python3
"""Conversations against first turns (issue 54): a draft trained on two-turn conversations against one trained
on first turns only, on the same number of answer tokens, measured on MT-Bench's second turns.

Runs after ``draft_quality.py data`` in the same working directory (``--dir``, default ``dq``), whose first-turn
answers it continues, on the lent GPU like it (transformers, batched):

  data   for the first ``--conversations`` training questions whose first answer ended (not truncated), the
         target writes a follow-up question after its own answer (Magpie, as ``dataset.generate.turns`` does:
         the template's user prefix after the conversation so far, sampled at the preset's question settings;
         a follow-up the model did not end, shorter than ``min_chars`` or one of MT-Bench's is dropped and the
         conversation stays one turn) and answers it greedily given the whole conversation. Two training sets
         with the same answer tokens, each a working directory of its own that ``draft_quality.py`` stages
         take as ``--dir``:
           DIR/conv/traces    the conversations as the workflow's trace records (``turns``, ``ended``;
                              eaglenest.data.sequences trains every assistant turn of each)
           DIR/first/traces   first-turn answers only (the same first answers, then later questions' answers)
                              up to the conversations' answer tokens
         and the evaluation set ``eval/mt_bench_t2.jsonl``: MT-Bench's second turns asked after the target's
         own greedy first answer (``validate.second_turns`` in the workflow), answered greedily.
  counts print both sets' records and answer tokens.

Then, per set S in conv, first (gpu_quality.sh ``conv`` does it all):
  draft_quality.py states --dir DIR/S --sizes N_S
  draft_quality.py train  --dir DIR/S --sizes N_S --trainers ours31:draft.kind=eagle3.1
  draft_quality.py eval   --dir DIR/S --sizes N_S --sets mt_bench_t2 mt_bench heldout
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from draft_quality import Layout, batched_generate, log, preset, read_jsonl, write_jsonl  # noqa: E402

CHUNK = 2000  # records per trace file


def answer_text(tok, record) -> str:
    """The text of a greedy answer as the next turn's template renders it (its end-of-turn token dropped)."""
    ids = record["completion_token_ids"]
    return tok.decode(ids[:-1] if not record["truncated"] else ids, skip_special_tokens=True)


def first_turn(record) -> dict:
    keys = ("prompt_token_ids", "completion_token_ids", "truncated")
    return {k: record[k] for k in keys} | {"finish_reason": "length" if record["truncated"] else "stop"}


def conversation_record(tok, record, q2, prompt2, completion2, finished2) -> dict:
    """A two-turn trace record in the workflow's format: ``turns`` in order, the last turn's ids on top."""
    turns = [first_turn(record), {"prompt_token_ids": prompt2, "completion_token_ids": completion2,
                                  "truncated": not finished2, "finish_reason": "stop" if finished2 else "length"}]
    messages = [*record["messages"], {"role": "assistant", "content": answer_text(tok, record)}, {"role": "user", "content": q2}]
    return {"id": record["id"], "messages": messages, "turns": turns, "ended": "max_turns" if finished2 else "truncated",
            "turns_dropped": 0, **turns[-1]}


def answer_tokens(record) -> int:
    return sum(len(t["completion_token_ids"]) for t in record.get("turns", [record]))


def follow_ups(model, tok, records, excluded, batch, seed=0):
    """The follow-up question the target writes after each record's first answer (None where dropped)."""
    from eaglenest.data.questions import fold, user_turn

    g = preset()["dataset"]["generate"]
    prompts, stops = [], None
    for r in records:
        prefix, stop = user_turn(tok, [*r["messages"], {"role": "assistant", "content": answer_text(tok, r)}])
        prompts.append(tok.encode(prefix, add_special_tokens=False))
        stops = stop
    got = batched_generate(model, tok, prompts, max_new_tokens=g["max_tokens"], stop_ids=stops, batch=batch, sample=True,
                           seed=seed, temperature=g["temperature"], top_p=g["top_p"], desc="follow-ups")
    out, dropped = [], {"cut": 0, "short": 0, "in_eval_set": 0}
    for ids, finished in got:
        text = tok.decode(ids[:-1] if finished else ids, skip_special_tokens=True).strip()
        reason = "cut" if not finished else "short" if len(text) < g["min_chars"] else \
            "in_eval_set" if fold(text) in excluded else None
        if reason:
            dropped[reason] += 1
        out.append(None if reason else text)
    return out, dropped


def second_answers(model, tok, records, questions, batch, desc, max_tokens=None):
    """(prompt ids, completion ids, finished) of the greedy answer to each second question, given the first turn."""
    from eaglenest.states.target import chat_prompt_ids

    cfg = preset()
    eos = model.generation_config.eos_token_id
    eos = sorted(set([eos] if isinstance(eos, int) else eos) | {tok.eos_token_id})
    prompts = [chat_prompt_ids(tok, [*r["messages"], {"role": "assistant", "content": answer_text(tok, r)},
                                     {"role": "user", "content": q}]) for r, q in zip(records, questions)]
    done = batched_generate(model, tok, prompts, max_new_tokens=max_tokens or cfg["generation"]["max_tokens"], stop_ids=eos, batch=batch,
                            desc=desc)
    return [(p, c, fin) for p, (c, fin) in zip(prompts, done)]


def matched_sets(conv, first):
    """The longest run of conversations whose answer tokens the first-turn records can match, and the fewest
    first-turn records that reach as many tokens: (conversations, first-turn records)."""
    supply = sum(answer_tokens(r) for r in first)
    total, n_conv = 0, 0
    for r in conv:
        if total + answer_tokens(r) > supply:
            break
        total += answer_tokens(r)
        n_conv += 1
    reached, n_first = 0, 0
    while reached < total:
        reached += answer_tokens(first[n_first])
        n_first += 1
    return conv[:n_conv], first[:n_first]


def write_set(root: Path, lay: Layout, records):
    """A working directory of ``records`` that draft_quality's stages read: traces in chunks, the target and the
    evaluation sets shared with ``lay`` by links."""
    (root / "traces").mkdir(parents=True, exist_ok=True)
    for old in (root / "traces").glob("chunk_*.jsonl"):
        old.unlink()
    for c in range(0, len(records), CHUNK):
        write_jsonl(root / "traces" / f"chunk_{c // CHUNK:03d}.jsonl", records[c:c + CHUNK])
    for name in ("target", "eval"):
        link = root / name
        if not link.exists():
            os.symlink((lay.root / name).resolve(), link)


def write_conversations(lay: Layout, mtbench, *, conversations, batch, device, max_tokens=None):
    from transformers import AutoTokenizer

    from eaglenest.data.questions import fold
    from eaglenest.states.target import load_target

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(lay.target)
    model = load_target(str(lay.target), device=device, dtype=preset()["hidden"]["dtype"])
    mt = {f"mt{q['question_id']}": q["turns"] for q in read_jsonl(mtbench)}
    excluded = {fold(t) for turns in mt.values() for t in turns}

    t2 = lay.evalset("mt_bench_t2")
    if not t2.exists():  # MT-Bench's second turns after the target's own first answers
        rows = [r for r in read_jsonl(lay.evalset("mt_bench")) if len(mt.get(r["id"], [])) > 1]
        got = second_answers(model, tok, rows, [mt[r["id"]][1] for r in rows], batch, "MT-Bench turn 2", max_tokens)
        write_jsonl(t2, [{"id": r["id"], "prompt_token_ids": p, "completion_token_ids": c, "truncated": not fin}
                         for r, (p, c, fin) in zip(rows, got)])

    first = [r for t in lay.traces() for r in read_jsonl(t)]
    started = [r for r in first if not r["truncated"]][:conversations]
    questions, dropped = follow_ups(model, tok, started, excluded, batch)
    asked = [(r, q) for r, q in zip(started, questions) if q]
    got = second_answers(model, tok, [r for r, _ in asked], [q for _, q in asked], batch, "second answers", max_tokens)
    second = {r["id"]: conversation_record(tok, r, q, *g) for (r, q), g in zip(asked, got)}
    ids = {r["id"] for r in started}
    conv = [second.get(r["id"], r) for r in first if r["id"] in ids]  # a dropped follow-up: one turn
    conv, first_only = matched_sets(conv, first)
    write_set(lay.root / "conv", lay, conv)
    write_set(lay.root / "first", lay, first_only)
    log(f"conversations: {len(asked)} of {len(started)} went on to a second turn (dropped follow-ups {dropped}); "
        f"{len(conv)} conversations ({sum(map(answer_tokens, conv))} answer tokens) against {len(first_only)} first turns "
        f"({sum(map(answer_tokens, first_only))}), in {time.time() - t0:.0f} s")


def counts(lay: Layout):
    for name in ("conv", "first"):
        records = [r for t in Layout(lay.root / name).traces() for r in read_jsonl(t)]
        turns = sum(len(r.get("turns", [r])) for r in records)
        print(f"{name}: {len(records)} records, {turns} answers, {sum(map(answer_tokens, records))} answer tokens")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=["data", "counts"])
    p.add_argument("--dir", default="dq")
    p.add_argument("--mtbench", help="MT-Bench's question.jsonl (both turns)")
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--device", default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="second answers' tokens (default: the preset's; as data's)")
    a = p.parse_args(argv)
    import torch

    lay = Layout(a.dir)
    if a.stage == "data":
        write_conversations(lay, a.mtbench, conversations=a.conversations, batch=a.batch,
                            device=a.device or ("cuda" if torch.cuda.is_available() else "cpu"), max_tokens=a.max_tokens)
    counts(lay)


if __name__ == "__main__":
    main()
