"""The shipped toy target (toy/target) and prompts (toy/prompts.jsonl): tokenizer, chat template,
greedy quality, and the prompt generator."""

import json
import random
from pathlib import Path

import pytest

from eaglenest.util import usable_threads
from toy import build as toy  # the toy builder lives beside the toy it builds (toy/build.py)

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "toy" / "target"
PROMPTS = ROOT / "toy" / "prompts.jsonl"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def greedy(tok):
    """Greedy completions of the first 40 shipped prompts, with their rows."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(usable_threads(2))
    model = AutoModelForCausalLM.from_pretrained(TARGET).eval()
    rows = toy.read_prompts(PROMPTS)[:40]
    return rows, toy.greedy_completions(model, tok, [r["conversations"][0]["value"] for r in rows])


def test_shipped_target_is_a_small_deep_llama_stored_in_bf16_computing_in_float32():
    from safetensors import safe_open

    config = json.loads((TARGET / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"  # what transformers computes in; vLLM gets --dtype float32
    assert config["num_hidden_layers"] == toy.LAYERS >= 16  # a target that costs many draft steps
    with safe_open(TARGET / "model.safetensors", "pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    assert sum(f.stat().st_size for f in TARGET.iterdir()) < 10 * 2**20


def test_growing_keeps_the_function_and_leaves_no_layer_idle():
    """grow() is exact (new layers add nothing until trained); the shipped model's grown layers did train."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    tok = toy.build_tokenizer()
    torch.manual_seed(0)
    shallow = LlamaForCausalLM(toy.model_config(tok, toy.BASE_LAYERS)).eval()
    deep = toy.grow(shallow, tok, 10).eval()
    ids = torch.randint(0, len(tok), (2, 24))
    with torch.no_grad():
        assert torch.equal(shallow(ids).logits, deep(ids).logits)
    shipped = load_file(TARGET / "model.safetensors")
    for i in range(toy.LAYERS):
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            assert shipped[f"model.layers.{i}.{proj}.weight"].abs().max() > 0, (i, proj)


def test_tokenizer_round_trip(tok):
    text = toy.CHARS + "What is 347 + 589?\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_think_markers_are_single_tokens_that_survive_decoding(tok):
    for marker in (toy.THINK_START, toy.THINK_END):
        ids = tok(marker, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] != tok.unk_token_id
    # vLLM decodes with skip_special_tokens=True and splits reasoning on the "</think>" text
    text = "<|assistant|><think>\n1+2=3\n</think>\n\n3</s>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\n1+2=3\n</think>\n\n3"


def test_chat_template_opens_thinking(tok):
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|user|>What is 1 + 2?<|assistant|><think>\n"
    assert prompt == toy.render_prompt("What is 1 + 2?")  # the renderer training uses
    with_system = [{"role": "system", "content": "Be exact."}, *messages]
    prompt = tok.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>Be exact.<|user|>What is 1 + 2?<|assistant|><think>\n"
    assert prompt == toy.render_prompt("What is 1 + 2?", "Be exact.")


def test_greedy_answers_are_diverse_terminated_and_mostly_correct(tok, greedy):
    rows, completions = greedy
    quality = toy.answer_quality(completions)
    assert quality["unique_fraction"] >= 0.9
    assert quality["distinct_4gram_ratio"] >= 0.5
    think_end = tok.convert_tokens_to_ids(toy.THINK_END)
    assert all(think_end in c and c[-1] == tok.eos_token_id for c in completions)
    correct = sum(toy.final_answer(tok, c) == r["conversations"][1]["value"]
                  for c, r in zip(completions, rows))
    assert correct > len(rows) / 2


def test_answer_quality_flags_loops_and_repeats():
    assert toy.answer_quality([[1, 2, 3, 4, 5]] * 4)["unique_fraction"] == 0.25
    assert toy.answer_quality([[7] * 40])["distinct_4gram_ratio"] == pytest.approx(1 / 37)
    assert toy.answer_quality([[1, 2, 3, 4, 1, 2, 3, 4]])["distinct_4gram_ratio"] == 0.8


def test_make_sample_is_consistent():
    rng = random.Random(0)
    for _ in range(200):
        s = toy.make_sample(rng)
        x, op, y, _, result = s["answer"].split()
        assert int(result) == {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
        assert x in s["question"] and y in s["question"]
        assert s["reasoning"].startswith(f"{x}{op}{y}\n")


def test_write_prompts_is_deterministic_and_matches_schema(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    toy.write_prompts(a, 50, seed=0)
    toy.write_prompts(b, 50, seed=0)
    toy.write_prompts(c, 50, seed=1)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    rows = toy.read_prompts(a)
    assert len(rows) == 50
    assert len({r["conversations"][0]["value"] for r in rows}) == 50
    for r in rows:
        assert set(r) == {"conversations", "source"}
        assert r["source"] == "eaglenest-toy/arithmetic"
        assert [t["from"] for t in r["conversations"]] == ["human", "gpt"]
        assert all(isinstance(t["value"], str) and t["value"] for t in r["conversations"])


def test_shipped_prompts_are_reproducible(tmp_path):
    toy.write_prompts(tmp_path / "p.jsonl", 2000, seed=0)
    assert (tmp_path / "p.jsonl").read_bytes() == PROMPTS.read_bytes()
