"""dataset.generate: the target writes its own questions (eaglenest.data.questions), here on the suite's toy server."""
import json

import pytest
from transformers import AutoTokenizer

from conftest import TOY_TARGET, read_lines
from eaglenest.data.questions import user_turn, write_questions

pytestmark = pytest.mark.vllm


def test_the_user_prefix_and_stop_token_come_from_the_chat_template(tmp_path):
    toy = AutoTokenizer.from_pretrained(TOY_TARGET)
    prefix, stop = user_turn(toy)
    assert prefix == "<s><|user|>" and toy.convert_ids_to_tokens(stop) == ["<|assistant|>"]
    chatml = AutoTokenizer.from_pretrained(TOY_TARGET)
    chatml.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chatml.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    prefix, stop = user_turn(chatml)
    assert prefix == "<|im_start|>user\n" and chatml.convert_ids_to_tokens(stop) == ["<|im_end|>"]


def test_the_target_writes_distinct_questions_and_a_rerun_keeps_what_a_crash_left(toy_server, tmp_path):
    cfg, _ = toy_server
    tok = AutoTokenizer.from_pretrained(TOY_TARGET)
    out = tmp_path / "questions.jsonl"
    # A crash left two answers and a cut line: the planted answer is kept as it is, the cut line asked again.
    planted = "what is the planted question left by the crash?"
    out.with_name(out.name + ".partial").write_text(
        json.dumps({"i": 0, "text": planted, "finish_reason": "stop"}) + "\n"
        + json.dumps({"i": 1, "text": "cut at max_tokens", "finish_reason": "length"}) + "\n" + '{"i": 2, "te')
    settings = dict(url=f"http://127.0.0.1:{cfg.port}", model=cfg.model_id, tokenizer=tok, max_tokens=48,
                    min_chars=4, concurrency=8, progress=False)
    stats = write_questions(out, questions=12, exclude=["What is the PLANTED question  left by the crash?"],
                            **settings)
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
    write_questions(again, questions=12, **settings)
    assert planted in [r["messages"][0]["content"] for r in read_lines(again)]
