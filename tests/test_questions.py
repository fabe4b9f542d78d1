"""dataset.generate: where the target's questions start and stop, from its chat template (eaglenest.data.questions).
The questions themselves, written by the suite's toy server: tests/test_real_server.py."""
from transformers import AutoTokenizer

from eaglenest.data.questions import user_turn
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
