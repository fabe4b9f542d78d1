"""Conversations regenerated turn by turn by a real vLLM server (the session's toy server, conftest.toy_server):
prepare_prompts keeps a dataset's conversations (system, user and tool turns, an assistant slot per answer),
generate_shard answers every slot given the target's own earlier answers, token-exact, ends a conversation
where it no longer fits (context, a tool result that does not fit the target's call) and resumes a kill -9
at the next turn.

The toy writes no tool call by itself: the tool conversation's requests carry a structured-output regex
(generation.extra_body) that makes it write the pythonic call the server's tool parser (pythonic, which the
session server runs with) turns into a real tool call."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eaglenest.data.conversations import ENDINGS, assistant_message, ending, request_messages
from eaglenest.data.prompts import prepare_prompts, read_prompt_shard, summary
from eaglenest.data.traces import answers_key, generate_shard
from eaglenest.settings import GenerationSettings, PromptSettings
from eaglenest.states.target import chat_prompt_ids
from tests.support.config import TOY_TARGET

REPO = Path(__file__).resolve().parent.parent
GENERATION = {"max_tokens": 64, "temperature": 0.0, "concurrency": 4, "request_timeout": 120, "max_retries": 1}
LIMITS = {"max_turns": 3, "max_context_tokens": 300}
ADD = {"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
# The pythonic call the tool conversation's answers are held to (vLLM's structured outputs).
CALL = {"structured_outputs": {"regex": r"\[add\(a=1, b=2\)\]"}}


def settings(generation=GENERATION, limits=LIMITS):
    """The toy's GenerationSettings: ``generation``'s keys and the conversation ``limits`` over the defaults."""
    return GenerationSettings.defaults().replace(model="toy", **generation, **limits)


def chat(*turns, system=None, **extra):
    """A dataset row of OpenAI messages: user and assistant turns alternating, the data's answers."""
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"messages": messages, **extra}


ROWS = [
    {"id": "single", **chat("What is 4 + 4?", "8")},
    {"id": "system", **chat("What is 1 + 1?", "2", "And 2 + 2?", "4", system="Answer with a number.")},
    # four questions: the fourth is past max_turns 3
    {"id": "three", **chat("What is 3 + 3?", "6", "And 5 + 5?", "10", "And 6 + 1?", "7", "And 9 + 9?", "18")},
    {"id": "tool", "tools": [ADD], "messages": [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_data", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_data", "content": "3"},
        {"role": "assistant", "content": "It is 3."}]},
    # past max_context_tokens at its second turn (about 330 prompt tokens + max_tokens)
    {"id": "long", **chat("What is 2 + 2?", "4", "Add these: " + "12 + 34, " * 28)},
    # past the server's max_model_len (512) at its second turn: vLLM refuses it
    {"id": "huge", **chat("What is 5 + 5?", "10", "Add these: " + "12 + 34, " * 70)},
]


def _lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _prepare(tmp_path, rows, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"source": "fixture", **r}) + "\n" for r in rows))
    settings = PromptSettings.defaults().replace(path=str(data), shards=1, heldout=0, keep_system=True,
                                                 **{"columns": {"id": "id"}, **kw})
    stats = prepare_prompts(tmp_path / "prompts", settings, progress=False)
    return stats, {p["id"]: p for p in read_prompt_shard(tmp_path / "prompts/shard_0.jsonl")}


def _shard(path, prompts):
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOY_TARGET)


@pytest.fixture(scope="module")
def traces(toy_server, tmp_path_factory):
    """The prompts of ROWS (max_turns 3) and their traces: every conversation without tool calls forced
    (the tool conversation then ends at a mismatch), and the tool conversation with its call forced."""
    cfg, _ = toy_server
    url = cfg.url_at(cfg.port)
    tmp = tmp_path_factory.mktemp("conversations")
    _, prompts = _prepare(tmp, ROWS, max_turns=3)
    plain = generate_shard(_shard(tmp / "plain.jsonl", prompts.values()), tmp / "traces/plain.jsonl", settings(),
                           urls=[url], progress=False)
    called = generate_shard(_shard(tmp / "called.jsonl", [prompts["tool"]]), tmp / "traces/called.jsonl",
                            settings({**GENERATION, "extra_body": CALL}), urls=[url], progress=False)
    return {"prompts": prompts, "plain": {r["id"]: r for r in _lines(tmp / "traces/plain.jsonl")}, "plain_stats": plain,
            "called": _lines(tmp / "traces/called.jsonl")[0], "called_stats": called}


# -- the prompt records ----------------------------------------------------------------------------

def test_a_conversation_keeps_user_and_tool_turns_and_a_slot_per_answer(tmp_path):
    stats, prompts = _prepare(tmp_path, ROWS, max_turns=3)
    assert prompts["single"]["messages"] == [{"role": "user", "content": "What is 4 + 4?"}]
    assert "tools" not in prompts["single"]
    assert prompts["system"]["messages"] == [
        {"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant"}, {"role": "user", "content": "And 2 + 2?"}, {"role": "assistant"}]
    three = prompts["three"]["messages"]
    assert [m["role"] for m in three] == ["user", "assistant"] * 3 and three[-2]["content"] == "And 6 + 1?"
    tool = prompts["tool"]
    assert tool["tools"] == [ADD]
    assert tool["messages"][1] == {"role": "assistant", "tool_calls": ROWS[3]["messages"][1]["tool_calls"]}
    assert tool["messages"][2] == {"role": "tool", "content": "3", "tool_call_id": "call_data"}
    assert tool["messages"][3] == {"role": "assistant"}
    assert stats["conversations"] == 5 and stats["turns_dropped"] == 1  # "And 9 + 9?"
    assert "5 conversations, 1 user turns past max_turns 3 dropped" in summary(stats)


def test_sharegpt_function_calls_are_the_assistants_and_observations_their_results(tmp_path):
    """ShareGPT's function calling (glaive, LLaMA-Factory): a function_call turn is the assistant's call (its
    value {"name", "arguments"} in JSON), an observation the tool's result, and bare functions in the tools
    column are OpenAI tools; a function_call that holds no call is a malformed row, counted."""
    row = {"id": "fc", "tools": json.dumps([ADD["function"]]), "conversations": [
        {"from": "human", "value": "What is 1 + 2?"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})},
        {"from": "observation", "value": "3"},
        {"from": "gpt", "value": "It is 3."}]}
    broken = {"id": "bad", "conversations": [{"from": "human", "value": "What is 2 + 2?"},
                                             {"from": "function_call", "value": "add two numbers"},
                                             {"from": "observation", "value": "4"}]}
    stats, prompts = _prepare(tmp_path, [row, broken], max_turns=3)
    assert prompts["fc"]["tools"] == [ADD]
    assert prompts["fc"]["messages"] == [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3"}, {"role": "assistant"}]
    assert "bad" not in prompts and stats["dropped"]["malformed"] == 1, stats


def test_max_turns_1_keeps_the_first_turns_records_and_ids(tmp_path):
    first, one = _prepare(tmp_path / "a", ROWS[:3], max_turns=1, columns={})
    _, four = _prepare(tmp_path / "b", ROWS[:3], max_turns=4, columns={})
    assert [p["messages"] for p in one.values()] == [
        [{"role": "user", "content": "What is 4 + 4?"}],
        [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 1 + 1?"}],
        [{"role": "user", "content": "What is 3 + 3?"}]]
    assert "conversations" not in first and "max_turns" not in first  # the stats of before
    (single,) = set(one) & set(four)  # the hash id of the single-turn row does not move; the others' do
    assert one[single] == four[single]


# -- the traces ------------------------------------------------------------------------------------

def test_every_turn_is_the_servers_prompt_of_the_conversation_so_far(traces, tokenizer):
    records = [*traces["plain"].values(), traces["called"]]
    answered = 0  # later turns after an answer with content or a call
    for r in records:
        if "turns" not in r:
            continue
        prompt = traces["prompts"][r["id"]]
        turns = r["turns"]
        for i, turn in enumerate(turns):
            messages = request_messages(prompt, turns[:i])
            assert turn["prompt_token_ids"] == chat_prompt_ids(tokenizer, messages), (r["id"], i)
            if i:  # the target's own earlier answer is in the next prompt, as the toy's template writes it
                before = turns[i - 1]
                calls = "".join(f"[{c['function']['name']}]" for c in before["tool_calls"] or ())
                said = f"<|assistant|>{before['content'] or ''}{calls}</s>"
                assert said in tokenizer.decode(turn["prompt_token_ids"]), (r["id"], i)
                answered += bool(before["content"] or calls)
        last = turns[-1]
        assert all(r[k] == last[k] for k in ("prompt_token_ids", "completion_token_ids", "content", "finish_reason"))
        # the conversation as regenerated: the data's turns, the target's answers in the slots
        assert r["messages"] == request_messages(prompt, turns[:-1]) + [assistant_message(last)]
        assert [m["role"] for m in r["messages"]].count("assistant") == len(turns)
    assert answered >= 3


def test_conversations_end_where_they_no_longer_fit(traces):
    plain, stats = traces["plain"], traces["plain_stats"]
    assert "turns" not in plain["single"] and plain["single"]["content"]  # a single question: as before
    assert (plain["system"]["ended"], len(plain["system"]["turns"])) == ("done", 2)
    assert (plain["three"]["ended"], len(plain["three"]["turns"])) == ("done", 3)
    # the toy answered in words where the data has a tool result: the conversation ends there
    assert (plain["tool"]["ended"], len(plain["tool"]["turns"]), plain["tool"]["turns_dropped"]) == ("tool_mismatch", 1, 0)
    assert plain["tool"]["turns"][0]["tool_calls"] is None
    for rid in ("long", "huge"):  # past max_context_tokens, past the server's max_model_len
        assert (plain[rid]["ended"], len(plain[rid]["turns"]), plain[rid]["turns_dropped"]) == ("context", 1, 1), rid
    assert stats["errors"] == 0 and stats["conversations"]["ended"] == {"done": 2, "tool_mismatch": 1, "context": 2}
    assert stats["conversations"]["turns"] == 2 + 3 + 1 + 1 + 1 and set(stats["conversations"]["ended"]) <= set(ENDINGS)


def test_the_data_tool_result_answers_the_targets_own_call(traces):
    r = traces["called"]
    assert (r["ended"], len(r["turns"])) == ("done", 2)
    (call,) = r["turns"][0]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
    assert r["messages"][1]["tool_calls"] == [call] and r["messages"][1]["reasoning_content"]
    assert r["messages"][2] == {"role": "tool", "tool_call_id": call["id"], "content": "3"}  # the target's id
    assert r["tools"] == [ADD] and r["turns"][0]["finish_reason"] == "tool_calls"


def _answer(*names, truncated=False):
    calls = [{"id": f"call_{n}", "type": "function", "function": {"name": n, "arguments": "{}"}} for n in names]
    return {"prompt_token_ids": [0], "completion_token_ids": [1], "reasoning": None, "content": None if names else "x",
            "tool_calls": calls or None, "finish_reason": "length" if truncated else "stop", "truncated": truncated,
            "usage": None}


def test_where_a_conversation_ends_given_the_targets_answers():
    slot = {"role": "assistant", "tool_calls": [{**_answer("add")["tool_calls"][0], "id": "call_data"}]}
    tool = {"messages": [{"role": "user", "content": "q"}, slot, {"role": "tool", "tool_call_id": "call_data",
                                                                  "content": "3"}, {"role": "assistant"}]}
    assert ending(tool, [], 4) is None
    assert ending(tool, [_answer("add")], 4) is None  # the data's result fits the target's call
    assert ending(tool, [_answer()], 4) == "tool_mismatch"  # no call where the data has a result
    assert ending(tool, [_answer("mul")], 4) == "tool_mismatch"  # another function
    assert ending(tool, [_answer("add", "add")], 4) == "tool_mismatch"  # more calls than the data answers
    assert ending(tool, [_answer("add", truncated=True)], 4) == "truncated"
    assert ending(tool, [_answer("add")], 1) == "max_turns"
    assert ending(tool, [_answer("add"), _answer()], 4) == "done"
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}, {"role": "user", "content": "r"},
                         {"role": "assistant"}]}
    assert ending(chat, [_answer("add")], 4) == "tool_mismatch"  # a call the data goes on without answering
    assert ending(chat, [_answer()], 4) is None and ending(chat, [_answer(), _answer("add")], 4) == "done"
    # the data's result answers the target's call under the target's id
    assert request_messages(tool, [_answer("add")])[2] == {"role": "tool", "tool_call_id": "call_add", "content": "3"}


def test_limits_name_the_partial_file_of_conversations_only():
    key = answers_key(settings(), conversations=True)
    assert key != answers_key(settings()) != answers_key(settings(limits={**LIMITS, "max_turns": 2}), conversations=True)
    assert key != answers_key(settings(limits={**LIMITS, "max_context_tokens": None}), conversations=True)


# -- kill -9 mid-conversation ----------------------------------------------------------------------

CLIENT = """
import json, sys
from eaglenest.data.traces import generate_shard
from eaglenest.settings import GenerationSettings
settings = GenerationSettings.defaults().replace(model="toy", **json.loads(sys.argv[4]), **json.loads(sys.argv[5]))
generate_shard(sys.argv[1], sys.argv[2], settings, urls=[sys.argv[3]], progress=False)
"""


def _turn_lines(partial):
    lines = [json.loads(x) for x in partial.read_bytes().splitlines(keepends=True) if x.endswith(b"\n")]
    return [x for x in lines if "turn_of" in x], {x["id"] for x in lines if "id" in x}


def _mid_conversation(partial):
    """Whether the partial file holds a finished conversation and the turns of one not finished."""
    turns, finished = _turn_lines(partial)
    return bool(finished) and any(t["turn_of"] not in finished for t in turns)


def test_kill_9_mid_conversation_then_rerun_asks_every_turn_once(toy_server, tmp_path):
    cfg, _ = toy_server
    url = cfg.url_at(cfg.port)
    rows = [{"id": f"c{i}", **chat(f"What is {i} + 1?", "a", f"And {i} + 2?", "b", f"And {i} + 3?", "c")}
            for i in range(4)]
    _, prompts = _prepare(tmp_path, rows, max_turns=3)
    shard = _shard(tmp_path / "prompts.jsonl", prompts.values())
    out = tmp_path / "traces/shard_0.jsonl"
    generation = {**GENERATION, "concurrency": 2}
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(shard), str(out), url, json.dumps(generation),
                               json.dumps(LIMITS)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    mid, size = None, 0
    while mid is None and time.monotonic() < deadline and client.poll() is None:
        for partial in (tmp_path / "traces/partial").glob("*.partial.jsonl"):
            if partial.stat().st_size == size:
                continue  # read it again once a line was added (the toy server shares the CPU with this loop)
            size = partial.stat().st_size
            if not _mid_conversation(partial):
                continue
            client.send_signal(signal.SIGSTOP)  # frozen, then checked again: a short answer may have ended it
            if _mid_conversation(partial):
                mid = partial
                break
            client.send_signal(signal.SIGCONT)
        time.sleep(0.01)
    client.send_signal(signal.SIGKILL)
    client.wait()
    assert mid is not None and not out.exists(), "the kill did not land mid-conversation"
    before, finished = _turn_lines(mid)
    open_turns = [t for t in before if t["turn_of"] not in finished]
    assert open_turns and len({(t["turn_of"], t["turn"]) for t in before}) == len(before)

    stats = generate_shard(shard, out, settings(generation), urls=[url], progress=False)
    records = {r["id"]: r for r in _lines(out)}
    assert sorted(records) == sorted(prompts) and all(len(r["turns"]) == 3 for r in records.values())
    total = sum(len(r["turns"]) for r in records.values())
    assert stats["resumed"] == len(finished)
    assert stats["completed"] == total - len(before), "a turn answered before the kill was asked again"
    for t in open_turns:  # the turns kept from the killed run are in the records as they were
        turn = records[t["turn_of"]]["turns"][t["turn"]]
        assert turn["prompt_token_ids"] == t["prompt_token_ids"]
        assert turn["completion_token_ids"] == t["completion_token_ids"]
    assert stats["conversations"] == {"records": 4, "turns": 12, "turns_dropped": 0, "ended": {"done": 4}}
