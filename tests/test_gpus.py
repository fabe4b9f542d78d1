"""GPU slots: jobs started side by side get different devices; a killed job frees its devices.

Real processes contend for real flock locks; the device list is given (this machine has no GPU),
which is the only thing nvidia-smi would add.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglenest.errors import GpuError
from eaglenest.gpus import claim_gpus

ROOT = Path(__file__).resolve().parent.parent

HOLDER = """
import os, sys, time
from pathlib import Path
from eaglenest.errors import GpuError
from eaglenest.gpus import claim_gpus
n, devices, locks, out = int(sys.argv[1]), [int(d) for d in sys.argv[2].split(",")], sys.argv[3], Path(sys.argv[4])
with claim_gpus(n, devices=devices, locks=locks, poll_s=0.1, log=lambda m: None) as ids:
    out.write_text(os.environ["CUDA_VISIBLE_DEVICES"])
    while not Path(str(out) + ".release").exists():
        time.sleep(0.05)
"""


def start_holder(tmp_path, name, n=1, devices="0,1"):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / name
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(n), devices, str(tmp_path / "locks"), str(out)], env=env)
    return proc, out


def wait_file(path, timeout=30):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    return None


@pytest.fixture
def no_preset(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_side_by_side_jobs_get_different_gpus_and_a_third_waits(tmp_path, no_preset):
    a, out_a = start_holder(tmp_path, "a")
    b, out_b = start_holder(tmp_path, "b")
    try:
        got = {wait_file(out_a), wait_file(out_b)}
        assert got == {"0", "1"}
        c, out_c = start_holder(tmp_path, "c")
        time.sleep(1.0)
        assert not out_c.exists(), "a third job ran while both GPUs were held"
        (tmp_path / "a.release").touch()
        assert wait_file(out_c) == out_a.read_text()  # it took the GPU the first job gave back
        (tmp_path / "b.release").touch()
        (tmp_path / "c.release").touch()
        for p in (a, b, c):
            assert p.wait(timeout=30) == 0
    finally:
        for p in (a, b):
            p.kill()


def test_a_killed_job_frees_its_gpus(tmp_path, no_preset):
    a, out_a = start_holder(tmp_path, "a", n=2)
    assert wait_file(out_a) == "0,1"
    b, out_b = start_holder(tmp_path, "b", n=2)
    time.sleep(0.5)
    assert not out_b.exists()
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    assert wait_file(out_b) == "0,1"
    (tmp_path / "b.release").touch()
    assert b.wait(timeout=30) == 0


def test_an_assignment_made_by_the_scheduler_is_used_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with claim_gpus(2, devices=[0, 1], locks=tmp_path, log=lambda m: None) as ids:
        assert ids == [3, 5]
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert not list(tmp_path.iterdir())  # nothing locked


def test_claim_sets_and_restores_the_environment(tmp_path, no_preset):
    with claim_gpus(1, devices=[0, 1], locks=tmp_path, log=lambda m: None) as ids:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == str(ids[0])
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_more_gpus_than_the_machine_has_is_a_clear_error(tmp_path, no_preset):
    with pytest.raises(GpuError, match="asks for 3 GPUs but this machine has 2"):
        with claim_gpus(3, devices=[0, 1], locks=tmp_path):
            pass


def test_no_gpu_machine_claims_nothing(tmp_path, no_preset):
    with claim_gpus(1, devices=[], locks=tmp_path) as ids:
        assert ids == []
        assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_timeout_names_the_locks(tmp_path, no_preset):
    a, out_a = start_holder(tmp_path, "a", n=1, devices="0")
    try:
        assert wait_file(out_a) == "0"
        with pytest.raises(GpuError, match="other jobs still hold"):
            with claim_gpus(1, devices=[0], locks=tmp_path / "locks", poll_s=0.1, timeout_s=0.5, log=lambda m: None):
                pass
    finally:
        (tmp_path / "a.release").touch()
        a.wait(timeout=30)
