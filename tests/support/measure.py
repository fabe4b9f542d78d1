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
    from eaglenest.settings import ValidateSettings
    from eaglenest.validation.evalsets import read_prompts
    from eaglenest.validation.requests import request_settings
    from eaglenest.validation.runs import measure_run

    requests = request_settings(ValidateSettings.defaults().replace(max_tokens=cfg["generation"]["max_tokens"]))
    run = measure_run(name, ServerConfig.from_dict(server or cfg["server"]), spec,
                      read_prompts(wd / "data/prompts/heldout.jsonl"), requests,
                      log_dir=log_dir or wd / "logs/validate", concurrency=8, warmup_requests=1,
                      min_seconds=0.0, workflow_pid=os.getpid())
    return {k: v for k, v in run.items() if k != "answers"}


def eagle3(draft_dir: Path) -> dict:
    """The speculative config that serves the vLLM-format draft in `draft_dir` with K tokens."""
    from eaglenest.vllm_facts import speculative_config

    return speculative_config("eagle3", K, draft_dir)


def train_on_run(wd: Path, cfg: dict, out: Path, **draft) -> Path:
    """A draft trained on the states of the run in `wd` (its shards, vocabulary and target head) with the
    run's training settings and the `draft:` keys `draft` changed, exported in vLLM's format (float32, as
    the toy is served): its directory."""
    from eaglenest.config import validate_config
    from eaglenest.draft.export import export_draft
    from eaglenest.draft.train import train_draft
    from eaglenest.settings import TrainSettings

    settings = TrainSettings.from_config(validate_config({**cfg, "draft": {**cfg.get("draft", {}), **draft}}))
    train_draft(sorted(wd.glob("hidden/shard_*.safetensors")), wd / "draft/vocab.safetensors", out / "checkpoint.safetensors",
                out / "train_metrics.csv", head_path=wd / "hidden/target_head.safetensors", settings=settings.replace(device="cpu"),
                state_dir=out / ".train_state", progress=False)
    export_draft(out / "checkpoint.safetensors", out / "draft", dtype="float32")
    return out / "draft"


def offline_prediction(wd: Path, cfg: dict, draft_dir: Path) -> dict:
    """The draft in `draft_dir` predicted offline: the transformers target's greedy answers to the held-out
    prompts of the run in `wd`, K tokens (what vLLM's figure for it is checked against)."""
    from eaglenest.validation.predict import offline_acceptance
    from eaglenest.validation.evalsets import read_prompts

    return offline_acceptance(cfg["server"]["model"], draft_dir, k=K, prompts=read_prompts(wd / "data/prompts/heldout.jsonl"),
                              dtype="float32", device="cpu", max_tokens=cfg["generation"]["max_tokens"], progress=False)
