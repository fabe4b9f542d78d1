"""dataset.generate: where the target's questions start and stop, from its chat template (eaglenest.data.questions).
The questions themselves, written by the suite's toy server: tests/test_real_server.py."""
from transformers import AutoTokenizer

from eaglenest.data.questions import user_turn
from eaglenest.settings import QuestionSettings
from tests.support.config import TOY_TARGET


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


def test_a_follow_up_starts_after_the_conversation_with_the_targets_answer_and_turns_1_reruns_nothing():
    toy = AutoTokenizer.from_pretrained(TOY_TARGET)
    history = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"}]
    prefix, stop = user_turn(toy, history)
    assert prefix == "<s><|user|>What is 1 + 2?<|assistant|>3</s><|user|>"
    assert toy.convert_ids_to_tokens(stop) == ["<|assistant|>"]
    # the written questions of a run from before conversations keep their fingerprint
    one = QuestionSettings.defaults()
    assert one.turns == 1 and "turns" not in one.fingerprint() and "answer_max_tokens" not in one.fingerprint()
    two = one.replace(turns=2)
    assert two.fingerprint()["turns"] == 2 and two.fingerprint()["answer_max_tokens"] == one.answer_max_tokens
