"""The workflow and the trace client against a real vLLM server this test session started itself: external
mode (the workflow uses the server and never stops it), and a real HTTP 400 (a prompt longer than the
toy's max_model_len) counted in the errors file, with the error-fraction gate failing the shard with a
message that says what to do.

The session's toy server (conftest.toy_server, which tests that only send requests share) serves every
test here. Two replicas sharing a shard are tested with the workflow's own replicas (tests/test_replicas.py:
both answer, and their traces equal one server's at temperature 0)."""
import json
from pathlib import Path

import pytest

from transformers import AutoTokenizer

from eaglenest.data.questions import write_questions
from eaglenest.data.traces import generate_shard
from eaglenest.errors import TracesError
from eaglenest.serving.backend import alive
from eaglenest.serving.probe import is_serving
from eaglenest.settings import GenerationSettings, QuestionSettings
from tests.support.config import BASE_CONFIG, TOY_TARGET, write_config
from tests.support.workflow import read_lines, run_snakemake

pytestmark = pytest.mark.vllm
MAX_MODEL_LEN = BASE_CONFIG["server"]["max_model_len"]
GENERATION = {"max_tokens": 64, "concurrency": 8, "request_timeout": 120, "max_retries": 1}


def settings(**changes):
    """The toy's GenerationSettings: GENERATION and ``changes`` over the schema's defaults."""
    return GenerationSettings.defaults().replace(model="toy", **{**GENERATION, **changes})
# The toy's character vocabulary holds these symbols; 40 repeats are ~800 tokens, past max_model_len.
LONG = "What is 123 + 456? " * 40


def _prompts(path: Path, n: int, long_every: int = 0) -> Path:
    lines = []
    for i in range(n):
        text = LONG if long_every and i % long_every == long_every - 1 else f"What is {100 + i} + {200 + i}?"
        lines.append(json.dumps({"id": f"p{i:03d}", "source": "test", "messages": [{"role": "user", "content": text}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_external_mode_uses_the_users_server_and_never_stops_it(toy_server, tmp_path):
    cfg, record = toy_server
    wd = tmp_path / "external"
    write_config(wd, dataset={"limit": 24, "heldout": 4},
                 server={"mode": "external", "urls": [cfg.url_at(cfg.port)], "port": cfg.port})
    run_snakemake(wd, "server.stopped")
    records = [r for i in range(2) for r in _lines(wd / f"traces/shard_{i}.jsonl")]
    prompts = [r for i in range(2) for r in _lines(wd / f"data/prompts/shard_{i}.jsonl")]
    assert len(records) == len(prompts) > 0 and {r["server"] for r in records} == {cfg.url_at(cfg.port)}
    assert not (wd / "logs/server/vllm.pid.json").exists(), "external mode starts no server of its own"
    # The workflow finished (onsuccess ran, stop_server ran): the user's server is untouched.
    assert alive(record["pid"]) and is_serving(cfg.url_at(cfg.port), "toy")


def test_a_real_400_is_counted_in_the_errors_file(toy_server, tmp_path):
    cfg, _ = toy_server
    prompts = _prompts(tmp_path / "prompts.jsonl", 12, long_every=6)  # 2 of 12 too long
    out = tmp_path / "traces/shard_0.jsonl"
    stats = generate_shard(prompts, out, settings(max_error_fraction=0.2), urls=[cfg.url_at(cfg.port)], progress=False)
    assert stats["errors"] == 2 and stats["retries"] == 0 and stats["completed"] == 10, stats
    errors = _lines(tmp_path / "traces/shard_0.errors.jsonl")
    assert sorted(e["id"] for e in errors) == ["p005", "p011"]
    for e in errors:
        assert e["status"] == 400 and e["server"] == cfg.url_at(cfg.port), e
        assert str(MAX_MODEL_LEN) in e["body"], e  # vLLM names the limit it enforced
    assert len(_lines(out)) == 10


def test_the_error_fraction_gate_fails_the_shard_with_what_to_do(toy_server, tmp_path):
    cfg, _ = toy_server
    prompts = _prompts(tmp_path / "prompts.jsonl", 12, long_every=3)  # 4 of 12 too long
    out = tmp_path / "traces/shard_0.jsonl"
    with pytest.raises(TracesError) as e:
        generate_shard(prompts, out, settings(concurrency=1, max_error_fraction=0.1), urls=[cfg.url_at(cfg.port)],
                       progress=False)
    msg = str(e.value)
    assert "shard_0" in msg and "HTTP 400" in msg and "more than 10%" in msg, msg
    assert str(tmp_path / "traces/shard_0.errors.jsonl") in msg and "rerun" in msg, msg
    assert not out.exists()
    errors = _lines(tmp_path / "traces/shard_0.errors.jsonl")
    assert errors and all(e["status"] == 400 for e in errors)


def test_the_target_writes_distinct_questions_and_a_rerun_keeps_what_a_crash_left(toy_server, tmp_path):
    cfg, _ = toy_server
    tok = AutoTokenizer.from_pretrained(TOY_TARGET)
    out = tmp_path / "questions.jsonl"
    # A crash left two answers and a cut line: the planted answer is kept as it is, the cut line asked again.
    planted = "what is the planted question left by the crash?"
    out.with_name(out.name + ".partial").write_text(
        json.dumps({"i": 0, "text": planted, "finish_reason": "stop"}) + "\n"
        + json.dumps({"i": 1, "text": "cut at max_tokens", "finish_reason": "length"}) + "\n" + '{"i": 2, "te')
    settings = dict(url=f"http://127.0.0.1:{cfg.port}", model=cfg.model_id, tokenizer=tok, progress=False)
    twelve = QuestionSettings.defaults().replace(questions=12, max_tokens=48, min_chars=4, concurrency=8)
    stats = write_questions(out, twelve, exclude=["What is the PLANTED question  left by the crash?"], **settings)
    rows = read_lines(out)
    texts = [r["messages"][0]["content"] for r in rows]
    assert len(rows) == stats["questions"] == 12, stats
    assert planted not in texts and stats["dropped"]["in_eval_set"] == 1, "an evaluation question became training data"
    assert stats["dropped"]["cut"] >= 1
    assert len({" ".join(t.lower().split()) for t in texts}) == 12
    assert all(r["messages"][0]["role"] == "user" and r["source"] == "target" and t.strip() == t
               for r, t in zip(rows, texts))
    assert not out.with_name(out.name + ".partial").exists()
    assert json.loads(out.with_name("questions.stats.json").read_text()) == stats
    # Without the exclusion the planted answer is a question, and the seeds ask the same again: same set.
    again = tmp_path / "again.jsonl"
    again.with_name(again.name + ".partial").write_text(json.dumps({"i": 0, "text": planted, "finish_reason": "stop"}) + "\n")
    write_questions(again, twelve, **settings)
    assert planted in [r["messages"][0]["content"] for r in read_lines(again)]


def test_the_target_writes_follow_up_turns_and_a_rerun_keeps_the_answers_a_crash_left(toy_server, tmp_path):
    """dataset.generate.turns 3: after the first questions the target answers and writes the next user turn;
    a follow-up cut or empty ends its conversation, counted. The crash left three first questions, one
    answer and two bad follow-ups, so only what is missing is asked (a few requests)."""
    cfg, _ = toy_server
    out = tmp_path / "conversations.jsonl"
    firsts = ["what is 100 + 200?", "what is 7 + 8 then?", "and what is 3 + 4?"]
    left = [{"i": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(firsts)] + [
        {"i": 0, "turn": 1, "role": "assistant", "text": "the planted answer is 300", "finish_reason": "stop"},
        {"i": 1, "turn": 2, "role": "user", "text": "a follow-up cut at max_tokens", "finish_reason": "length"},
        {"i": 2, "turn": 2, "role": "user", "text": " ", "finish_reason": "stop"}]
    out.with_name(out.name + ".partial").write_text("".join(json.dumps(r) + "\n" for r in left) + '{"i": 0, "tu')
    three = QuestionSettings.defaults().replace(questions=3, turns=3, max_tokens=48, min_chars=4, answer_max_tokens=24)
    stats = write_questions(out, three, url=f"http://127.0.0.1:{cfg.port}", model=cfg.model_id,
                            tokenizer=AutoTokenizer.from_pretrained(TOY_TARGET), progress=False)
    rows = {r["id"]: r["messages"] for r in read_lines(out)}
    assert [m["content"] for i in ("q0", "q1", "q2") for m in rows[i][:1]] == firsts
    # q1 and q2 end where their follow-up was dropped: their answers were asked, then thrown away with it
    assert rows["q1"] == [{"role": "user", "content": firsts[1]}] and rows["q2"] == [{"role": "user", "content": firsts[2]}]
    f = stats["follow_ups"]
    assert f["dropped"]["cut"] >= 1 and f["dropped"]["short"] >= 1
    q0 = rows["q0"]
    assert len(q0) == 1 or q0[1] == {"role": "assistant", "content": "the planted answer is 300"}
    assert [m["role"] for m in q0] == ["user", "assistant"] * ((len(q0) - 1) // 2) + ["user"]
    assert all(m["content"].strip() for m in q0 if m["role"] == "user")
    users = [sum(m["role"] == "user" for m in r) for r in rows.values()]
    assert f["conversations"] == {str(n): users.count(n) for n in (1, 2, 3)}
    # asked: q1's and q2's answers and q0's follow-up (not q0's answer: the crash left it), and where that
    # follow-up was kept, q0's second answer and third question; no first question
    assert f["requests"] == 3 + 2 * (len(q0) >= 3) and stats["requests"] == 3
    assert not out.with_name(out.name + ".partial").exists()


def test_second_turns_are_asked_after_the_target_alones_answers(toy_server, tmp_path):
    """validate.second_turns: a held-out conversation's second turn is sent as [user 1, the target alone's own
    T=0 answer, user 2], token for token as the chat template renders it, and measured on the same server
    start (the target alone's hook) beside turn 1. Two requests: turn 1, then turn 2."""
    from eaglenest.serving.settings import ServerConfig
    from eaglenest.settings import ValidateSettings
    from eaglenest.validation.evalsets import read_prompts, resolve_sets
    from eaglenest.validation.runs import measure_cell
    from eaglenest.validation.validate import _matrix_cells, _second_turns

    cfg, _ = toy_server
    url = f"http://{cfg.host}:{cfg.port}"
    heldout = tmp_path / "heldout.jsonl"
    row = {"id": "c", "source": "t", "messages": [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant"},
                                                   {"role": "user", "content": "What is 189 * 2?"}]}
    heldout.write_text(json.dumps(row) + "\n")
    # 96 tokens: the toy's reasoning, then its answer, the context turn 2 must carry
    s = ValidateSettings.defaults()
    s = s.replace(temperatures=[0.0], max_tokens=96, generation=s.generation.replace(request_timeout=GENERATION["request_timeout"]))
    cells = _matrix_cells(s, [0.0], resolve_sets([], heldout), read_prompts(heldout), print)
    result = {"cells": [measure_cell(url, cfg.model_id, c) for c in cells]}
    (first,) = result["cells"][0]["answers"]
    assert first["content"] and first["reasoning"], first
    logs = []
    hooks = _second_turns({"baseline": (cfg.model, None, None)}, ServerConfig.from_dict({**BASE_CONFIG["server"], "port": cfg.port}),
                          s, cells, engine="transformers", log=logs.append)
    hooks["baseline"](url, None, result)
    (two,) = result["second_turns"]
    assert (two["set"], two["turn"], two["prompts"], two["temperature"]) == ("heldout", 2, 1, 0)
    assert two["output_tokens"] > 0 and two["tokens_per_step"] == 1.0
    conversation = [row["messages"][0], {"role": "assistant", "content": first["content"]}, row["messages"][2]]
    tok = AutoTokenizer.from_pretrained(TOY_TARGET)
    expected = tok.encode(tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    assert two["answers"][0]["prompt_token_ids"] == expected
    assert any("heldout turn 2 at T=0: 1 prompts" in line for line in logs), logs
    # off, or with the target alone last (engine none: its answers come after the drafts' runs): not asked
    assert _second_turns({"baseline": None}, cfg, s.replace(second_turns=False), cells, engine="transformers", log=print) == {}
    assert _second_turns({"baseline": None}, cfg, s, cells, engine="none", log=logs.append) == {}
    assert "no second turns of heldout" in logs[-1]


def test_the_target_alone_server_scores_outputs_as_transformers_does(toy_server, tmp_path):
    """validate.offline.engine none: the lossless check's scores (mean log-prob per completion token under the
    target) come from the target-alone server's prompt_logprobs; they equal the transformers target's, for a
    greedy answer, a sampled one and a wrong one, and an empty completion has none."""
    import torch
    from transformers import AutoModelForCausalLM

    from eaglenest.serving.chat import answer_prompts
    from eaglenest.validation.lossless import sequence_scores, served_scores

    cfg, _ = toy_server
    url = f"http://{cfg.host}:{cfg.port}"
    prompts = [json.loads(line) for line in _prompts(tmp_path / "p.jsonl", 2).read_text().splitlines()]
    greedy = answer_prompts(prompts, url=url, model=cfg.model_id, generation=settings(temperature=0.0))
    sampled = answer_prompts(prompts, url=url, model=cfg.model_id, generation=settings(temperature=1.0, seed=3))
    sequences = [(a["prompt_token_ids"], a["completion_token_ids"]) for a in greedy + sampled]
    wrong = list(reversed(sequences[0][1]))
    sequences += [(sequences[0][0], wrong), (sequences[0][0], [])]
    served = served_scores(url, cfg.model_id, sequences, concurrency=4)
    model = AutoModelForCausalLM.from_pretrained(TOY_TARGET, dtype=torch.float32)
    reference = sequence_scores(model, sequences)
    assert served[-1] is None and reference[-1] is None
    assert served[:-1] == pytest.approx(reference[:-1], abs=2e-3), (served, reference)
    assert served[-2] < served[0], "a reversed answer scores below the greedy one"
