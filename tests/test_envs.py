"""The conda environments, pyproject.toml and the two locks pin the same versions."""
import re
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _pins(lines):
    pins = {}
    for line in lines:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)==([^\s;#\\]+)\s*\\?\s*", line)
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def _project_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return _pins(project["dependencies"]), {k: _pins(v) for k, v in project["optional-dependencies"].items()}


def test_every_dependency_is_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [d for v in project["optional-dependencies"].values() for d in v]
    assert all("==" in d for d in deps), [d for d in deps if "==" not in d]


def test_conda_envs_match_pyproject():
    core, extras = _project_pins()
    expected = {**core, **extras["cpu"]}
    for env_file in sorted((ROOT / "envs").glob("*.yaml")):
        deps = yaml.safe_load(env_file.read_text())["dependencies"]
        pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
        assert _pins(pip) == expected, env_file.name


def _lock(name):
    return _pins((ROOT / "requirements" / f"{name}.lock").read_text().splitlines())


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_lock_agrees_with_pyproject(device):
    core, extras = _project_pins()
    lock = _lock(device)
    for name, version in {**core, **extras[device], **extras["slurm"], **extras["test"]}.items():
        assert lock.get(name, "").split("+")[0] == version, name


def test_locks_agree_where_they_share_a_package():
    """A package in both locks has one version, but the few that differ by device (the Makefile's
    DEVICE_PINS, which `make lock-gpu` leaves free)."""
    device_pins = set(re.search(r"^DEVICE_PINS = (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split("|"))
    cpu, gpu = _lock("cpu"), _lock("gpu")
    differ = {name: (cpu[name], gpu[name]) for name in set(cpu) & set(gpu) - device_pins if cpu[name] != gpu[name]}
    assert not differ, differ
    assert device_pins <= set(cpu) & set(gpu), device_pins - (set(cpu) & set(gpu))
