"""Shared helpers: run the real workflow in a temporary directory with a small config."""
import copy
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
TOY_TARGET = ROOT / "toy" / "target"
TOY_PROMPTS = ROOT / "toy" / "prompts.jsonl"

BASE_CONFIG = {
    "dataset": {"path": str(TOY_PROMPTS), "limit": 48, "heldout": 8},
    "shards": 2,
    "server": {"mode": "local", "model": str(TOY_TARGET), "served_model_name": "toy", "max_model_len": 512,
               "reasoning_parser": "deepseek_r1", "gpu_memory_utilization": 0.1, "dtype": "float32", "poll_interval": 1, "ready_timeout": 600},
    "draft": {"aux_layers": [1, 2, 3]},
    "generation": {"max_tokens": 256, "concurrency": 16, "request_timeout": 300, "max_retries": 3},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def write_config(workdir: Path, **overrides) -> dict:
    cfg = merge(BASE_CONFIG, overrides)
    cfg["server"].setdefault("port", free_port())
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))
    return cfg


def snakemake_cmd(workdir: Path, *args) -> list[str]:
    return [str(Path(sys.executable).parent / "snakemake"), "-s", str(ROOT / "Snakefile"), "-d", str(workdir),
            "--cores", "2", *args]


def run_snakemake(workdir: Path, *args, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(snakemake_cmd(workdir, *args), capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if check and out.returncode != 0:
        pytest.fail(f"snakemake {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}")
    return out
