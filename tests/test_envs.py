"""The conda environments, pyproject.toml and the CPU lock pin the same versions."""
import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _pins(lines):
    pins = {}
    for line in lines:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)==([^\s;#]+)\s*", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
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


def test_lock_agrees_with_pyproject():
    core, extras = _project_pins()
    lock = _pins((ROOT / "requirements" / "cpu.lock").read_text().splitlines())
    for name, version in {**core, **extras["cpu"], **extras["slurm"], **extras["test"]}.items():
        assert lock.get(name, "").split("+")[0] == version, name
