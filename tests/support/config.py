"""The tests' configs: the toy target and prompts, the base config every run starts from, the shipped
default made to run anywhere, and the sections several tests' runs share."""
import copy
import os
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
TOY_TARGET = ROOT / "toy" / "target"
TOY_PROMPTS = ROOT / "toy" / "prompts.jsonl"

# Every test's vLLM runs eagerly. vLLM 0.32 on CPU compiles the model at each start (its AOT compile
# cache never loads there: "'function' object has no attribute 'finalize_loading'"); --enforce-eager
# skips that (the start times: benchmarks/RESULTS.md, "Test suite"). The shipped config.yaml runs the
# toy eagerly too (server.extra_args), so the default-workflow test (default_config below) runs it as
# users do.
TEST_SERVER_ARGS = ["--enforce-eager"]


def eager(server: dict) -> dict:
    """A ``server`` config section whose vLLM runs eagerly (``TEST_SERVER_ARGS`` after its own extra_args)."""
    return {**server, "extra_args": [*server.get("extra_args", []), *TEST_SERVER_ARGS]}

BASE_CONFIG = {
    "dataset": {"path": str(TOY_PROMPTS), "limit": 48, "heldout": 8},
    "shards": 2,
    "server": {"mode": "local", "model": str(TOY_TARGET), "served_model_name": "toy", "max_model_len": 512,
               "reasoning_parser": "deepseek_r1", "kv_cache_gb": 1, "dtype": "float32", "poll_interval": 1, "ready_timeout": 600,
               "extra_args": TEST_SERVER_ARGS},
    # The toy's whole vocabulary, and sequences no longer than the servers hold (both checked before any job).
    "draft": {"aux_layers": [1, 2, 3], "vocab_size": 105},
    "hidden": {"max_length": 512},
    "generation": {"max_tokens": 256, "concurrency": 16, "request_timeout": 300, "max_retries": 3},
}


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def write_config(workdir: Path, **overrides) -> dict:
    cfg = merge(BASE_CONFIG, overrides)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))
    return cfg


def _portable(node, key=None):
    """The default config made to run anywhere: repo-relative paths (toy target, bundled prompts)
    absolute (its servers take free ports where they run: no port is set)."""
    if isinstance(node, dict):
        return {k: _portable(v, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_portable(v) for v in node]
    if isinstance(node, str) and not os.path.isabs(node) and "/" in node and (ROOT / node).exists():
        return str(ROOT / node)
    return node


def default_config() -> dict:
    """The shipped config.yaml, as the default workflow's test runs it."""
    return _portable(yaml.safe_load((ROOT / "config.yaml").read_text()))


# The toy's draft training in the tests: short, but enough for the draft to learn much of the toy's
# arithmetic (its time on 2 cores: benchmarks/RESULTS.md, "Test suite"); two epochs of 300 traces, so
# stream mode reads sequences again. save_every is not in the training fingerprint: saving resume points
# changes no weight.
TRAIN = {"max_steps": 60, "lr": 3e-3, "warmup_steps": 5, "batch_tokens": 2048, "ttt_length": 3, "save_every": 10}

# The session's vLLM-backend run (conftest.vllm_backend_run), which the transformers-backend run repeats
# with its other backend.
VLLM_BACKEND_RUN = dict(dataset={"limit": 300, "heldout": 24}, shards=1, generation={"concurrency": 64}, train=TRAIN,
                        hidden={"backend": "vllm", "dtype": "float32"})
