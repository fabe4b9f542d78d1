"""The `server:` section of the config and the facts every mode shares: the API key (the user's, or
the run's own), and the check of a local model path.

A server that listens beyond this machine (slurm mode binds 0.0.0.0; local mode with `server.host`
not a loopback address) always requires an API key: the user's (`server.api_key_env`), else a random
key made for the run (`run_key`), kept in a mode-0600 file under the mode-0700 `.eaglenest/` of the
working directory, which jobs on other nodes read through the shared working directory. The key
reaches vLLM by environment only (VLLM_API_KEY), never a command line, script, sentinel or log.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import ConfigError, ServerError
from ..settings import Stage, setting
from ..util import is_local_path

# Addresses only this machine reaches: a server bound to anything else requires an API key.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# The run's own API key, relative to the working directory (which jobs on every node share).
RUN_KEY_FILE = Path(".eaglenest") / "api_key"


@dataclass(frozen=True)
class SlurmSettings(Stage):
    """`server.slurm:` in the workflow config: what the server job asks SLURM for."""

    partition: str | None = setting("server.slurm.partition")  # the GPU partition (serving.slurm_cluster.gpu_partition)
    account: str | None = setting("server.slurm.account")      # None: $SBATCH_ACCOUNT, else none
    time: str | int = setting("server.slurm.time")             # sbatch --time; an int is minutes
    cpus: int = setting("server.slurm.cpus")                   # --cpus-per-task of the one task
    mem: str | int | None = setting("server.slurm.mem")        # --mem (e.g. "200G"; an int is MB)
    gpus: int | None = setting("server.slurm.gpus")            # --gres=gpu:N; None: the GPUs a server uses
    extra_sbatch_args: list[str] = setting("server.slurm.extra_sbatch_args")  # e.g. ["--qos=high"]
    # What the GPU nodes were sized as, for the checks before any job (eaglenest.checks), never sent to sbatch:
    gpu_type: str | None = setting("server.slurm.gpu_type", reruns=False)  # the GPU, e.g. H200 (gpus.GPU_MEMORY_GIB)
    node_gpus: int | None = setting("server.slurm.node_gpus", reruns=False)  # GPUs a node has, where sinfo does not say

    @classmethod
    def from_dict(cls, d: dict | None) -> "SlurmSettings":
        """The job's settings from a `server.slurm:` section (a key it lacks: the schema's default)."""
        return cls(**{k: v for k, v in (d or {}).items() if k in cls.__dataclass_fields__})


# server.slurm keys that state the GPU nodes a config was sized for: read by the checks before any job
# (eaglenest.checks), never by the server's job, so they start no server again.
CHECKED_ONLY = tuple(f.name for f in fields(SlurmSettings) if not f.metadata["reruns"])


@dataclass(frozen=True)
class ServerConfig(Stage):
    """The `server:` section of the workflow config, the server stage's settings, declared as eaglenest.settings'
    stages are (``setting``); schemas/config.schema.yaml documents each key and holds its default (the only
    place it is written)."""

    mode: str = setting("server.mode")
    model: str = setting("server.model")
    served_model_name: str | None = setting("server.served_model_name")
    host: str = setting("server.host")
    port: int | None = setting("server.port")  # None: a free port where the server runs (serving.port)
    urls: list[str] = setting("server.urls")
    replicas: int = setting("server.replicas")
    tensor_parallel_size: int = setting("server.tensor_parallel_size")
    max_model_len: int | None = setting("server.max_model_len")
    reasoning_parser: str | None = setting("server.reasoning_parser")
    gpu_memory_utilization: float | None = setting("server.gpu_memory_utilization")
    kv_cache_gb: float | None = setting("server.kv_cache_gb")
    dtype: str | None = setting("server.dtype")
    extra_args: list[str] = setting("server.extra_args")
    env: dict[str, str] = setting("server.env")
    api_key_env: str | None = setting("server.api_key_env")
    poll_interval: float = setting("server.poll_interval")
    ready_timeout: float = setting("server.ready_timeout")
    keep_server: bool = setting("server.keep_server")
    python: str | None = setting("server.python")  # interpreter that has vLLM; None: this one
    slurm: dict = setting("server.slurm")  # mode slurm: SlurmSettings' keys

    @classmethod
    def from_dict(cls, d: dict) -> "ServerConfig":
        """The server's settings from a `server:` section (a key it lacks: the schema's default)."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def fingerprint(self) -> dict:
        """Every server key but what the checks alone read (CHECKED_ONLY): any change starts (or finds) the
        server again."""
        slurm = {k: v for k, v in self.slurm.items() if k not in CHECKED_ONLY}
        return {**dataclasses.asdict(self), "slurm": slurm}

    @property
    def model_id(self) -> str:
        """The model name clients send: the served name, else the model path as vLLM reports it."""
        return self.served_model_name or self.model

    def url_at(self, port: int) -> str:
        """The URL this machine reaches a server of this config at, listening on ``port`` here."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{port}"

    def base_urls(self) -> list[str]:
        """The URLs of an external server (server.urls); other modes read theirs from the port record."""
        if not self.urls:
            raise ServerError("server.mode is 'external' but server.urls is empty: "
                              "give the base URL(s) of the running server(s), e.g. http://host:8000")
        return [u.rstrip("/") for u in self.urls]

    @property
    def needs_key(self) -> bool:
        """Whether the server the workflow starts listens beyond this machine, so it must require a key:
        slurm mode (the job binds 0.0.0.0 for other nodes), or local mode on a non-loopback host."""
        return self.mode == "slurm" or (self.mode == "local" and self.host not in LOOPBACK_HOSTS)

    def api_key(self, create: bool = False) -> str | None:
        """The API key servers and clients use: the variable named by `api_key_env` (never stored), else,
        where a server listens beyond this machine, the run's own key (`run_key`; `create` makes it
        when missing: only what starts a server does), else None."""
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ServerError(f"server.api_key_env names ${self.api_key_env}, which is not set: "
                                  f"export it before running the workflow")
            return key
        return run_key(create=create) if self.needs_key else None


def run_key(create: bool = False) -> str:
    """The run's random API key from RUN_KEY_FILE under the working directory; `create` makes it first
    when missing (a 0600 file in a 0700 directory, linked into place whole, so concurrent starters
    agree on one key). Refuses a key file other users can read."""
    path = RUN_KEY_FILE.resolve()
    if create and not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        tmp = path.with_name(f".api_key.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_urlsafe(32).encode())
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another starter made it first: use theirs
        finally:
            tmp.unlink()
    try:
        mode = path.stat().st_mode & 0o777
        key = path.read_text().strip()
    except FileNotFoundError:
        raise ServerError(f"the server requires an API key (it listens beyond this machine) and no "
                          f"server.api_key_env is set, but the run's key {path} does not exist: the server "
                          f"was not started by this workflow in this directory. Delete server.ready and "
                          f"rerun, so the workflow starts the server (and its key) again") from None
    if mode & 0o077:
        raise ServerError(f"{path} (the run's API key) is readable by other users (mode {mode:o}): "
                          f"delete it (the next server start makes a new one) or `chmod 600` it")
    if not key:
        raise ServerError(f"{path} (the run's API key) is empty: delete it and rerun")
    return key


def forget_run_key() -> None:
    """Remove the run's key once no server of this run is left; the next run makes a new one."""
    RUN_KEY_FILE.unlink(missing_ok=True)


def key_hint(api_key: str | None) -> str:
    """What to do when a server answers 401/403: the key sent was missing or wrong."""
    what = "no API key was sent" if not api_key else "the API key sent is not the server's"
    return (f"{what}. A server the workflow starts beyond this machine uses the run's key "
            f"({RUN_KEY_FILE}) unless server.api_key_env names a variable holding one; for a server "
            f"started otherwise, set server.api_key_env to the variable that holds its key")


def looks_like_local_path(model: str) -> bool:
    """Whether `server.model` names a local path rather than a hub id (`org/name`).

    A path: what `util.is_local_path` calls one (spelled as one, or existing here), a name with more
    than one slash (a hub id has one), or one whose first component is a directory here (`toy/target`).
    `org/name` with no `org` directory is a hub id."""
    if is_local_path(model):
        return True
    parts = model.split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def check_model_path(model: str, key: str = "server.model") -> None:
    """Fail at once, naming the path, when `model` is a local path that does not exist (vLLM would
    first try the hub with it and fail half a minute later)."""
    if model and looks_like_local_path(model) and not Path(model).expanduser().exists():
        raise ConfigError(f"{key} is {model!r}, a local path that does not exist "
                          f"({Path(model).expanduser().resolve()}): fix the path, or give a hub name "
                          f"such as org/name")
