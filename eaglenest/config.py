"""Validate a workflow config against schemas/config.schema.yaml and fill in its defaults.

The schema is the only source of defaults: the workflow hands the library a resolved config, and
library code called without Snakemake (tests, notebooks) takes its defaults from `defaults(section)`.
Errors name the key path (`generation.max_tokens`) and what is wrong, before any job runs."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

from .errors import ConfigError
from .packaged import file_settings, resolve_config

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "config.schema.yaml"

# Keys that moved: a config that still has one is refused, naming where it went (docs/settings.md).
MOVED_KEYS = {
    **{f"train.{k}": f"draft.{k}" for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads",
                                              "head_dim")},
    # hidden: once flat, now each in the part that reads it (the vLLM extraction server and its client, the
    # transformers forward, stream mode)
    **{f"hidden.{k}": f"hidden.{part}.{k}" for part, keys in (
        ("vllm", ("concurrency", "port", "request_timeout", "max_retries", "backoff_base", "backoff_max", "states_dir",
                  "server_env", "gpu_memory_utilization", "gpu_memory_gib")),
        ("transformers", ("device", "batch_tokens")),
        ("stream", ("max_disk_gb", "cache", "stream_ahead", "placement"))) for k in keys},
}


def load_schema(path: str | Path = SCHEMA_PATH) -> dict:
    return yaml.safe_load(Path(path).read_text())


@functools.lru_cache(maxsize=1)
def _resolved_defaults() -> dict:
    return _fill_defaults(load_schema(), {})


def defaults(section: str = "") -> dict:
    """The schema's defaults for one section, e.g. ``defaults("train")`` or ``defaults("server.slurm")``
    (a fresh copy: the caller may change it). An empty section gives the whole default config."""
    value = _resolved_defaults()
    for key in filter(None, section.split(".")):
        value = value[key]
    return copy.deepcopy(value)


def _fill_defaults(schema: dict, value):
    """Recursively add the schema's defaults for missing object keys."""
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _fill_defaults(sub, value[key])
    return value


def _key_path(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def check_moved_keys(config: dict, source: str = "config") -> None:
    """Refuse a config that sets a key of MOVED_KEYS, naming each one's new place."""
    found = []
    for old, new in MOVED_KEYS.items():
        section, key = old.rsplit(".", 1)
        value = config
        for part in section.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, dict) and key in value:
            found.append(f"{old} moved to {new}")
    if found:
        raise ConfigError(f"{source}: " + "; ".join(found) + " (docs/settings.md): move the key(s) there")


def validate_config(config: dict, schema: dict | None = None, source: str = "config") -> dict:
    """Return a copy of `config` with defaults filled in; raise ConfigError naming every bad key."""
    schema = schema or load_schema()
    check_moved_keys(config or {}, source)
    config = _fill_defaults(schema, copy.deepcopy(config or {}))
    import jsonschema  # only where a config is validated: the library's defaults need just the schema file

    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        lines = []
        for e in errors:
            if e.validator == "additionalProperties":
                allowed = ", ".join(sorted(e.schema.get("properties", {})))
                lines.append(f"{_key_path(e)}: {e.message} (allowed keys: {allowed})")
            else:
                lines.append(f"{_key_path(e)}: {e.message}")
        raise ConfigError(f"{source} is not valid ({SCHEMA_PATH.name}):\n  " + "\n  ".join(lines))
    return resolve_config(config)  # pkg:<module>/<file> names -> the installed files' paths


def resolve_shipped_paths(config: dict, workdir: str | Path, basedir: str | Path) -> list[str]:
    """Relative paths resolved as Snakemake resolves a workflow's files: one that exists under ``workdir`` is
    the user's and stays; one that exists only under ``basedir`` (the workflow's own directory: toy/..., what
    the embedded default names) becomes that file's absolute path, in place. Returns a note per path changed."""
    workdir, basedir = Path(workdir).resolve(), Path(basedir).resolve()
    notes = []
    if workdir == basedir:
        return notes
    for key, holder, name in file_settings(config):
        value = holder[name]
        if not value or Path(value).expanduser().is_absolute() or (workdir / value).exists():
            continue
        if (basedir / value).exists():
            holder[name] = str(basedir / value)
            notes.append(f"{key} {value}: not in the working directory {workdir}, so the workflow's own {holder[name]}")
    return notes


def write_resolved_config(config: dict, path: str | Path, sources=(), notes=()) -> None:
    """Write the config a run uses (defaults filled in) as YAML, headed by the files it came from and
    ``notes`` (e.g. the paths found in the workflow's own directory, ``resolve_shipped_paths``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = f"# The resolved config of the last run: {' + '.join(map(str, sources)) or 'no file'}, --config, " \
           f"then the defaults of schemas/{SCHEMA_PATH.name}.\n" + "".join(f"# {note}\n" for note in notes)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(head + yaml.safe_dump(config, sort_keys=False))
    tmp.replace(path)


def load_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path} does not exist") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    return validate_config(raw, source=str(path))
