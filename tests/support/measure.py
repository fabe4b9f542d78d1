"""A draft measured in vLLM: the speculative config the tests serve and one measurement on a run's
held-out prompts."""
import os
from pathlib import Path

K = 3  # speculative tokens of every test's measurement


def measure_draft(name, wd: Path, cfg: dict, spec: dict, *, server: dict | None = None, log_dir=None) -> dict:
    """vLLM serving the target of the run in `wd` (config `cfg`) with `spec` as its speculative config,
    measured on that run's held-out prompts (eight at a time after one warm-up request; this test's process
    is the watchdog's workflow). `server`: a server section other than cfg's. The answers are left out."""
    from eaglenest.serving.settings import ServerConfig
    from eaglenest.validation.validate import measure_run, read_prompts, request_settings

    run = measure_run(name, ServerConfig.from_dict(server or cfg["server"]), spec,
                      read_prompts(wd / "data/prompts/heldout.jsonl"), request_settings(cfg["generation"]["max_tokens"]),
                      log_dir=log_dir or wd / "logs/validate", concurrency=8, warmup_requests=1,
                      workflow_pid=os.getpid())
    return {k: v for k, v in run.items() if k != "answers"}


def eagle3(draft_dir: Path) -> dict:
    """The speculative config that serves the vLLM-format draft in `draft_dir` with K tokens."""
    from eaglenest.vllm_facts import speculative_config

    return speculative_config("eagle3", K, draft_dir)
