"""requirements/gpu.lock installs on Linux x86_64 for every Python docs/install.md names, and the project's
pins without the lock do not (what `pip install -e '.[gpu,slurm,test]'` met).

uv resolves from the index's metadata for another platform and Python without downloading a wheel
(a few seconds once its cache is warm). Needs PyPI: skipped, saying so, where it is unreachable."""
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "gpu.lock"
OVERRIDES = ROOT / "requirements" / "overrides.txt"
PYTHONS = ("3.11", "3.12")  # docs/install.md, "Installing"
PLATFORM = "x86_64-manylinux_2_28"


def _pins(text):
    pins = {}
    for line in text.splitlines():
        m = re.match(r"([A-Za-z0-9_.\-]+)==([^\s;\\]+)", line)
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


@pytest.fixture(scope="module")
def uv():
    try:
        from uv import find_uv_bin
    except ImportError:
        pytest.fail("uv is not installed: it is in the test extra and both locks; run `make install`")
    try:
        urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=15).close()
    except OSError as e:
        pytest.skip(f"PyPI unreachable ({e}): the GPU lock's installability is checked against its index")
    return find_uv_bin()


def resolve(uv, *requirements, python, overrides=True, extras=()):
    """``uv pip compile`` for Linux x86_64 and ``python``: (exit status, resolved pins, stderr)."""
    cmd = [uv, "pip", "compile", *map(str, requirements), *(a for e in extras for a in ("--extra", e)),
           "--python-platform", PLATFORM, "--python-version", python, "--no-python-downloads",
           "--no-header", "--no-annotate", "--quiet"]
    if overrides:
        cmd += ["--override", str(OVERRIDES)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return proc.returncode, _pins(proc.stdout), proc.stderr


@pytest.mark.parametrize("python", PYTHONS)
def test_gpu_lock_resolves_as_it_is(uv, python):
    """Every pin of the lock exists for this Python on Linux x86_64, every declared requirement of
    every locked package holds (but the overrides'), and nothing is missing: the resolution of the
    lock is the lock."""
    rc, resolved, err = resolve(uv, LOCK, python=python)
    assert rc == 0, f"requirements/gpu.lock does not resolve for Python {python} on Linux x86_64:\n{err}"
    lock = _pins(LOCK.read_text())
    assert resolved == lock, {k: (lock.get(k), resolved.get(k)) for k in set(lock) | set(resolved)
                              if lock.get(k) != resolved.get(k)}


def test_gpu_lock_needs_exactly_its_override(uv):
    """The lock without requirements/overrides.txt has no solution, for mistral-common's numpy cap (the
    pin its header names), and neither have the project's own pins: the unlocked
    `.[gpu,slurm,test]` that `make install` used to resolve."""
    rc, _, err = resolve(uv, LOCK, python="3.12", overrides=False)
    assert rc != 0 and "mistral-common" in err and "numpy" in err, err
    rc, _, err = resolve(uv, "pyproject.toml", python="3.12", overrides=False, extras=("gpu", "slurm", "test"))
    assert rc != 0 and "numpy" in err, err
