"""`make install` keeps the set a venv holds unless asked for the other: a login node without GPUs (no
nvidia-smi) keeps the GPU set `make install GPU=1` built there, through `make run` and `make plan` alike.
Checked with `make -n` (what make would run) against a venv directory holding only the stamp."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _planned(venv: Path, *args, **env) -> str:
    out = subprocess.run(["make", "-n", "-C", str(ROOT), "install", f"VENV={venv}", *args], capture_output=True,
                         text=True, env={**{k: v for k, v in os.environ.items() if k not in ("GPU", "EAGLENEST_DEVICE")},
                                         "PATH": "/usr/bin:/bin", **env})  # no nvidia-smi on this PATH
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture
def gpu_venv(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".eaglenest-installed").write_text("GPU=1\n")  # newer than the locks: up to date
    return venv


def test_an_installed_gpu_set_is_kept_where_no_gpu_is_seen(gpu_venv):
    assert "uv pip install" not in _planned(gpu_venv)


@pytest.mark.parametrize("ask", [("GPU=0",), ()])
def test_the_other_set_is_installed_only_when_asked(gpu_venv, ask):
    env = {} if ask else {"EAGLENEST_DEVICE": "cpu"}
    planned = _planned(gpu_venv, *ask, **env)
    assert "-r requirements/cpu.lock" in planned and "gpu.lock" not in planned


def test_a_first_install_without_a_gpu_takes_the_cpu_set(tmp_path):
    planned = _planned(tmp_path / "fresh")
    assert "-r requirements/cpu.lock" in planned and "-r requirements/gpu.lock" not in planned
