"""Second turns in validation (eaglenest.validation.second_turns): the rows cut at their first turn, the turn-2
prompts built from the target alone's own answers, and the report's section. The requests themselves, on the
suite's toy server: tests/test_real_server.py::test_second_turns_are_asked_after_the_target_alones_answers."""
import json

from transformers import AutoTokenizer

from eaglenest.settings import ValidateSettings
from eaglenest.validation.evalsets import read_prompts
from eaglenest.validation.second_turns import (first_turn, second_turns_markdown, second_turns_said,
                                               second_turns_section, turn_two_cells, turn_two_prompts)
from eaglenest.validation.page import render_html
from tests.support.config import TOY_TARGET

SYSTEM = {"role": "system", "content": "Be brief."}
CONVERSATION = {"id": "c1", "source": "mt", "messages": [
    SYSTEM, {"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant"},
    {"role": "user", "content": "And times 2?"}, {"role": "assistant"}, {"role": "user", "content": "And minus 1?"},
    {"role": "assistant"}]}  # prepare_prompts' conversation rows end on the slot of the last answer
SINGLE = {"id": "s1", "source": "mt", "messages": [{"role": "user", "content": "What is 1 + 1?"}]}
TOOLS = {"id": "t1", "source": "mt", "messages": [
    {"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [{"id": "x", "type": "function"}]},
    {"role": "tool", "tool_call_id": "x", "content": "sunny"}, {"role": "user", "content": "Thanks"}]}


def test_a_prompt_row_is_sent_as_its_first_turn_with_the_next_user_turn_beside_it(tmp_path):
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (CONVERSATION, SINGLE, TOOLS)))
    conv, single, tools = read_prompts(path)
    assert conv == {"id": "c1", "source": "mt", "messages": CONVERSATION["messages"][:2], "second_turn": "And times 2?"}
    assert single == SINGLE and first_turn(SINGLE) is SINGLE
    one_slot = {**SINGLE, "messages": [*SINGLE["messages"], {"role": "assistant"}]}
    assert first_turn(one_slot) == SINGLE
    # a tool call between the turns is no plain second turn: the first turn alone
    assert tools == {**TOOLS, "messages": TOOLS["messages"][:1]}


def test_the_second_turn_follows_the_target_alones_own_answer_as_the_chat_template_renders_it():
    toy = AutoTokenizer.from_pretrained(TOY_TARGET)
    rows = [first_turn(r) for r in (CONVERSATION, SINGLE, {**CONVERSATION, "id": "c2"})]
    # the target alone's trace records of the three rows, in order: the reasoning apart, one cut before any content
    answers = [{"id": "c1", "reasoning": "12 and 30", "content": "42"}, {"id": "s1", "content": "2"},
               {"id": "c2", "reasoning": "12 and", "content": None}]
    two = turn_two_prompts(rows, answers)
    assert [p["id"] for p in two] == ["c1/turn2", "c2/turn2"]
    assert two[0]["messages"] == [SYSTEM, {"role": "user", "content": "What is 12 + 30?"},
                                  {"role": "assistant", "content": "42"}, {"role": "user", "content": "And times 2?"}]
    assert two[1]["messages"][2] == {"role": "assistant", "content": ""}
    text = toy.apply_chat_template(two[0]["messages"], tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>Be brief.<|user|>What is 12 + 30?<|assistant|>42</s><|user|>And times 2?<|assistant|><think>\n"
    # token for token: the first turn's conversation, then the answer's tokens, then the second user turn
    def ids(messages, generation_prompt):
        return toy.encode(toy.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt),
                          add_special_tokens=False)
    turn_one, turn_two = ids(rows[0]["messages"], False), ids(two[0]["messages"], True)
    answer = toy.encode("<|assistant|>42</s>", add_special_tokens=False)
    assert turn_two[:len(turn_one) + len(answer)] == turn_one + answer


def test_turn_two_cells_come_from_the_target_alones_t0_answers_of_the_same_set():
    rows = [first_turn(CONVERSATION), first_turn(SINGLE)]
    settings = {"temperature": 0.0, "max_tokens": 8}
    cells = [{"set": "mt", "temperature": 0, "prompts": rows, "settings": settings, "headline": False},
             {"set": "mt", "temperature": 1.0, "prompts": rows, "settings": {}, "headline": False},
             {"set": "heldout", "temperature": 0, "prompts": [first_turn(SINGLE)], "settings": settings, "headline": True}]
    baseline = [{"set": "mt", "temperature": 1.0, "answers": [{"content": "sampled"}, {"content": "x"}]},
                {"set": "mt", "temperature": 0, "answers": [{"content": "greedy 42"}, {"content": "2"}]},
                {"set": "heldout", "temperature": 0, "answers": [{"content": "2"}]}]
    made = turn_two_cells(cells, baseline)
    assert [(c["set"], c["temperature"], c["turn"], len(c["prompts"])) for c in made] == [("mt", 0, 2, 1)]
    assert made[0]["prompts"][0]["messages"][-2]["content"] == "greedy 42" and made[0]["settings"] is settings


def test_the_report_shows_turn_two_beside_turn_one_for_every_run():
    def cell(tps, al, turn_one):
        return ({"set": "mt", "temperature": 0, "prompts": 5, "output_tokens": 80, "tokens_per_step": tps,
                 "acceptance_length": al, "drafted_share": 1.0 if al else None, "per_position": None,
                 "one_request": {"output_tokens_per_s": 9.0}},
                {"set": "mt", "temperature": 0, "tokens_per_step": turn_one})
    runs = {}
    for name, tps, al, one in (("baseline", 1.0, None, 1.0), ("eagle3", 1.6, 1.7, 1.9), ("ngram", 1.2, 1.5, 1.1)):
        two, first = cell(tps, al, one)
        runs[name] = {"cells": [first, {**first, "temperature": 1.0, "tokens_per_step": 0.1}], "second_turns": [two]}
    section = second_turns_section(runs)
    assert len(section) == 1 and section[0]["set"] == "mt" and section[0]["prompts"] == 5
    assert section[0]["runs"]["eagle3"]["tokens_per_step"] == 1.6
    assert section[0]["runs"]["eagle3"]["turn_1_tokens_per_step"] == 1.9  # the T=0 cell's, not T=1's
    md = "\n".join(second_turns_markdown(section))
    assert "| mt | EAGLE-3 | 1.900 | 1.600 | 1.700 |" in md and "| mt | target alone | 1.000 | 1.000 | – |" in md
    (line,) = second_turns_said(section)
    assert line.startswith("mt turn 2 (5 prompts") and "EAGLE-3 1.600 tokens per target step (turn 1 1.900" in line
    assert second_turns_markdown([]) == [] and second_turns_said([]) == []


def test_the_report_page_has_the_second_turns_section_only_where_they_were_asked():
    from tests.support.reports import sample_report

    section = [{"set": "mt_bench", "turn": 2, "prompts": 6, "runs": {
        "eagle3": {"tokens_per_step": 1.25, "acceptance_length": 1.5, "turn_1_tokens_per_step": 1.75}}}]
    r = sample_report()
    assert "Second turns" not in render_html(r)
    r["second_turns"] = section
    html = render_html(r)
    assert "<h2>Second turns</h2>" in html and "<td>mt_bench</td><td>EAGLE-3</td><td>1.750</td><td>1.250</td>" in html


def test_second_turns_on_by_default_keep_an_earlier_validations_fingerprint():
    on = ValidateSettings.defaults()
    assert on.second_turns is True and "second_turns" not in on.fingerprint()["validate"]
    off = on.replace(second_turns=False)
    assert off.fingerprint()["validate"]["second_turns"] is False


def test_the_embedded_defaults_sets_have_no_second_turn_so_its_validation_asks_none():
    """config.yaml validates on the held-out split of toy/prompts.jsonl and on toy/eval_prompts.jsonl: read as
    validation reads them, neither goes on to a second turn, so the default run's validation time is unchanged."""
    import yaml

    from eaglenest.validation.evalsets import load_set, resolve_sets
    from eaglenest.validation.second_turns import has_second_turns

    config = yaml.safe_load(open("config.yaml"))
    sets = resolve_sets(config["validate"]["datasets"], "unused")[1:]
    sets.append({**sets[0], "name": "training_data", "path": config["dataset"]["path"]})  # the held-out split's source
    for spec in sets:
        rows = load_set(spec)
        assert rows and not has_second_turns(rows), spec["name"]
