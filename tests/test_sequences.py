"""Training on conversations (issue 54): every assistant turn scored exactly once, no system, user or tool
token ever scored, in the sequences (data.sequences) and in the shards of both backends and stream mode.
Records are built with the toy target's real tokenizer and chat template (tests/support/conversations.py);
no server, no Snakemake."""
import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from eaglenest.data.sequences import read_training_sequences, training_sequences
from eaglenest.errors import TraceRecordError
from eaglenest.settings import HiddenSettings
from eaglenest.states.hidden import extract_hidden
from eaglenest.states.shards import HiddenShards, shard_sequences
from tests.support.config import TOY_TARGET
from tests.support.conversations import REASONING_TEMPLATE, conversation_record, data_turn_tokens

SYSTEM = {"role": "system", "content": "be brief"}
SLOT = {"role": "assistant"}
# system, three user turns, the target's three answers
THREE_TURNS = [SYSTEM, {"role": "user", "content": "what is two plus two"}, SLOT,
               {"role": "user", "content": "and times three"}, SLOT, {"role": "user", "content": "say it in words"}, SLOT]
THREE_ANSWERS = [("add them", "four"), ("four times three", "twelve"), ("spell it", "twelve in words")]
# a user turn, then a tool call whose result the target answers
WITH_TOOL = [SYSTEM, {"role": "user", "content": "what is two plus two"}, SLOT,
             {"role": "user", "content": "now add five"}, SLOT, {"role": "tool", "content": "result nine"}, SLOT]
TOOL_ANSWERS = [("add them", "four"), ("use the tool", "call add four five"), ("the tool said", "nine")]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOY_TARGET)


def scored(sequences):
    """The scored token ids of every sequence, concatenated in order, and the masks."""
    masks = []
    for ids, spans in sequences:
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            mask[start:end] = True
        masks.append(mask)
    return [t for (ids, _), m in zip(sequences, masks) for t in np.asarray(ids)[m].tolist()], masks


def occurrences(ids, pattern):
    return [i for i in range(len(ids) - len(pattern) + 1) if ids[i:i + len(pattern)] == pattern]


def assert_only_assistant_tokens_scored(tok, record, sequences):
    """The scored ids are the turns' completions, each once, in order; no data turn's token is scored
    wherever it appears, and every data turn appears in the last sequence."""
    completions = [t for turn in record["turns"] for t in turn["completion_token_ids"]]
    got, masks = scored(sequences)
    assert got == completions
    data_turns = [m for m in record["messages"] if m["role"] in ("system", "user", "tool")]
    for (ids, _), mask in zip(sequences, masks):
        for m in data_turns:
            pattern = data_turn_tokens(tok, m)
            for at in occurrences(ids, pattern):
                assert not mask[at:at + len(pattern)].any(), (m, at)
    last_ids = sequences[-1][0]
    assert all(occurrences(last_ids, data_turn_tokens(tok, m)) for m in data_turns)


def test_a_single_answer_record_gives_the_one_sequence_it_always_did():
    record = {"id": "q", "prompt_token_ids": [0, 5, 20, 6], "completion_token_ids": [21, 22, 1]}
    assert training_sequences(record) == [([0, 5, 20, 6, 21, 22, 1], [(4, 7)])]
    # a conversation of that one turn is the same sequence
    assert training_sequences({**record, "turns": [dict(record)]}) == training_sequences(record)


def test_the_toys_template_drops_past_reasoning_so_each_turn_is_its_own_sequence(tok):
    """The toy's real template renders a past answer as its content alone: the next prompt does not continue
    the answer as generated (reasoning and all), so every turn starts a new chain, each scored once."""
    record = conversation_record(tok, THREE_TURNS, THREE_ANSWERS)
    sequences = training_sequences(record)
    assert [len(spans) for _, spans in sequences] == [1, 1, 1]
    assert [ids for ids, _ in sequences] == [t["prompt_token_ids"] + t["completion_token_ids"] for t in record["turns"]]
    assert_only_assistant_tokens_scored(tok, record, sequences)


def test_a_template_that_renders_past_answers_as_generated_chains_three_turns_into_one_sequence(tok):
    record = conversation_record(tok, THREE_TURNS, THREE_ANSWERS, {"chat_template": REASONING_TEMPLATE, "keep_all": True})
    sequences = training_sequences(record)
    assert len(sequences) == 1 and len(sequences[0][1]) == 3
    last = record["turns"][-1]
    assert sequences[0][0] == last["prompt_token_ids"] + last["completion_token_ids"]
    assert_only_assistant_tokens_scored(tok, record, sequences)


def test_a_template_that_changes_an_earlier_answer_starts_a_new_chain_and_scores_each_token_once(tok):
    """Reasoning kept only after the last user turn (Qwen3's way): the answer before the second user turn
    loses it (a new chain), the tool-call answer keeps it (the tool result's answer continues its chain)."""
    record = conversation_record(tok, WITH_TOOL, TOOL_ANSWERS, {"chat_template": REASONING_TEMPLATE})
    turns = record["turns"]
    first = turns[0]["prompt_token_ids"] + turns[0]["completion_token_ids"]
    assert turns[1]["prompt_token_ids"][: len(first)] != first  # the template changed the first answer
    sequences = training_sequences(record)
    assert [len(spans) for _, spans in sequences] == [1, 2]
    assert_only_assistant_tokens_scored(tok, record, sequences)
    tool_tokens = data_turn_tokens(tok, WITH_TOOL[5])
    assert len(occurrences(sequences[1][0], tool_tokens)) == 1  # the tool result sits between two scored answers


def test_a_truncated_last_turn_is_left_out_without_use_truncated(tok):
    record = conversation_record(tok, THREE_TURNS, THREE_ANSWERS, truncated_last=True)
    assert len(training_sequences(record, use_truncated=False)) == 2
    assert len(training_sequences(record)) == 3


def test_a_malformed_record_is_refused_with_its_file_and_line(tmp_path, tok):
    good = conversation_record(tok, THREE_TURNS, THREE_ANSWERS)
    bad = json.loads(json.dumps(good))
    del bad["turns"][1]["completion_token_ids"]
    path = tmp_path / "shard_0.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceRecordError, match=r"shard_0\.jsonl:2: .*turns\[1\]\.completion_token_ids is missing"):
        list(read_training_sequences([path]))
    path.write_text(json.dumps({**good, "turns": []}) + "\n")
    with pytest.raises(TraceRecordError, match=r"shard_0\.jsonl:1: .*'turns' is \[\]"):
        list(read_training_sequences([path]))


def test_the_shard_holds_each_chain_with_its_assistant_tokens_masked(tok, tmp_path):
    """The transformers backend on the toy target (2.4M parameters): a conversation's chains are the shard's
    sequences, their loss_mask exactly the assistant tokens."""
    records = [conversation_record(tok, WITH_TOOL, TOOL_ANSWERS, {"chat_template": REASONING_TEMPLATE}, rid="tool"),
               conversation_record(tok, THREE_TURNS, THREE_ANSWERS, rid="three")]
    traces = tmp_path / "shard_0.jsonl"
    traces.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "shard_0.safetensors"
    stats = extract_hidden([traces], out, HiddenSettings.defaults().replace(target=str(TOY_TARGET), max_length=512),
                           progress=False)
    expected = [s for r in records for s in training_sequences(r)]
    shards = HiddenShards(out)
    assert len(shards) == stats["sequences"] == len(expected) == 5 and stats["records"] == 2 and stats["answers"] == 6
    got = []
    for k, (ids, spans) in enumerate(expected):
        row = shards[k]
        assert row["input_ids"].tolist() == ids
        assert row["loss_mask"].tolist() == scored([(ids, spans)])[1][0].tolist()
        got += row["input_ids"][row["loss_mask"]].tolist()
    assert got == [t for r in records for turn in r["turns"] for t in turn["completion_token_ids"]]
    assert stats["loss_tokens"] == len(got)


def test_single_answer_records_give_the_same_shard_bytes_as_one_turn_conversations(tok, tmp_path):
    """The conversation path adds nothing to a single answer: the same tokens, mask and bytes."""
    records = [conversation_record(tok, THREE_TURNS[:3], THREE_ANSWERS[:1], rid=f"q{i}") for i in range(3)]
    single = [{k: v for k, v in r.items() if k not in ("turns", "ended", "turns_dropped")} for r in records]
    settings = HiddenSettings.defaults().replace(target=str(TOY_TARGET), max_length=40)  # cut inside the answer
    shards = []
    for name, recs in (("single", single), ("conversation", records)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        shards.append(tmp_path / name / "shard_0.safetensors")
        extract_hidden([tmp_path / f"{name}.jsonl"], shards[-1], settings, progress=False)
    assert shards[0].read_bytes() == shards[1].read_bytes()
    row = HiddenShards(shards[0])[0]
    n_prompt = len(single[0]["prompt_token_ids"])
    assert row["loss_mask"].tolist() == [i >= n_prompt for i in range(40)]


def test_the_vllm_backend_and_stream_mode_write_the_same_masks(tok, tmp_path):
    """extract_hidden_vllm's shard and stream mode's rows, from the stub extraction server of
    test_stream_stub (no vLLM start: the mask comes from the traces, not from the states)."""
    from eaglenest.serving.connector import storage_dir
    from eaglenest.states.extract import extract_hidden_vllm
    from eaglenest.states.stream import open_stream
    from eaglenest.states.target import save_target_head
    from tests.support.extraction_stub import SeededStub

    record = conversation_record(tok, WITH_TOOL, TOOL_ANSWERS, {"chat_template": REASONING_TEMPLATE})
    traces = tmp_path / "shard_0.jsonl"
    traces.write_text(json.dumps(record) + "\n")
    head = tmp_path / "target_head.safetensors"
    save_target_head(head, HiddenSettings.defaults().replace(target=str(TOY_TARGET), aux_layers=[1, 2, 3]))
    seqs = shard_sequences([traces], 512)[0]
    storage = storage_dir(tmp_path / "states")
    with SeededStub(storage, 4, 128) as stub:
        extract_hidden_vllm([traces], tmp_path / "shard_0.safetensors",
                            HiddenSettings.defaults().replace(max_length=512, max_retries=0),
                            url=stub.url, model="toy", head_path=head, storage=storage, progress=False)
        stream = open_stream({"traces": [str(traces)], "url": stub.url, "model": "toy", "head": str(head),
                              "storage": str(storage), "server": {}, "max_length": 512, "use_truncated": True,
                              "concurrency": 2, "request_timeout": 30, "max_retries": 0, "backoff_base": 1.0,
                              "backoff_max": 30.0, "max_disk_gb": 1.0,
                              "cache": False, "ahead_tokens": 4096, "cache_dir": str(tmp_path / "cache")})
        try:
            stream.follow(range(len(seqs)))
            streamed = [stream[k] for k in range(len(seqs))]
        finally:
            stream.close()
    shards = HiddenShards(tmp_path / "shard_0.safetensors")
    assert len(shards) == len(streamed) == 2
    for k, (_, ids, mask) in enumerate(seqs):
        for row in (shards[k], streamed[k]):
            assert row["input_ids"].tolist() == ids.tolist()
            assert torch.equal(row["loss_mask"], torch.from_numpy(mask))
    masked = [t for k in range(2) for t in shards[k]["input_ids"][shards[k]["loss_mask"]].tolist()]
    assert masked == [t for turn in record["turns"] for t in turn["completion_token_ids"]]
