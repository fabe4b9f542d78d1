"""Small helpers every stage shares: atomic file writes, safetensors saving, the log line, progress,
whether a name is a local path or a hub name.

One logging style: `say` writes one line to stderr, which a rule script has pointed at its log
(`eaglenest.logs.to_log`). Long work shows progress through `progress_bar`: a tqdm bar on a terminal,
a plain line every `LOG_INTERVAL_S` seconds in a log file (no carriage-return line per update).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

LOG_INTERVAL_S = 30.0  # seconds between progress lines when stderr is a file, not a terminal


def say(message: str) -> None:
    """One line for the rule's log (stderr, where the progress lines go too)."""
    print(message, file=sys.stderr, flush=True)


def file_in(attribute: str, name: str) -> property:
    """A read-only property: the file ``name`` in the directory the instance's ``attribute`` holds
    (e.g. ``log = file_in("log_dir", "vllm.log")``)."""
    return property(lambda self: Path(getattr(self, attribute)) / name, doc=f"{attribute}/{name}")


def usable_threads(wanted: int) -> int:
    """``wanted`` threads, but no more than the CPUs this process may run on (taskset, a SLURM job's
    cpuset): more compute threads than CPUs make OpenMP's threads wait on each other."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cpus = os.cpu_count() or 1
    return max(1, min(wanted, cpus))


# Spellings that make a name a local path, never a Hugging Face hub name (``org/name``).
PATH_PREFIXES = ("/", "./", "../", "~", ".\\")


def is_local_path(name, base=None) -> bool:
    """Whether ``name`` (a model, dataset or verifier) is a local path rather than a hub name: spelled
    as one (``PATH_PREFIXES``, ``.``, ``..``) or existing here, relative to ``base`` (default: the
    working directory). Callers add what their kind of name adds (a dataset's file extension)."""
    name = str(name or "")
    if not name:
        return False
    if name.startswith(PATH_PREFIXES) or name in (".", ".."):
        return True
    path = Path(name).expanduser()
    return (Path(base) / path if base is not None else path).exists()


# ---------------------------------------------------------------------------------------------
# Atomic writes: a reader never sees half a file, even after a crash.


@contextlib.contextmanager
def atomic_path(path: str | Path, fsync: bool = True):
    """Yield a temporary path beside `path`; when the block ends without error, the file written
    there replaces `path` (readable by all, 0644). On error the temporary file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | Path, data, *, indent: int | None = 2) -> None:
    """Write `data` to `path` whole or not at all: bytes as they are, str as UTF-8, anything else
    as JSON (with `indent`) and a final newline."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    elif not isinstance(data, (bytes, bytearray, memoryview)):
        data = (json.dumps(data, indent=indent) + "\n").encode("utf-8")
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def atomic_dir(path: str | Path):
    """Yield a temporary directory beside ``path``; when the block ends without error it replaces
    ``path`` (an old one is removed first). On error the temporary directory is removed."""
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        tmp.chmod(0o755)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def open_locked(path: str | Path, busy_error: Exception) -> int:
    """Open (creating) ``path`` read-write and take its exclusive flock without waiting; raises
    ``busy_error`` when another process holds it. The kernel drops the lock when the holder exits
    (kill -9 included), so a crashed run never blocks the next one."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise busy_error from None
    return fd


def save_safetensors(tensors, path, metadata=None) -> None:
    """Write a safetensors file atomically, readable by all (safetensors itself creates files 0600)."""
    from safetensors.torch import save_file

    with atomic_path(path, fsync=False) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


# ---------------------------------------------------------------------------------------------
# Progress


class _LineFile:
    """A file for tqdm that turns each redraw ('\\r' + status) into one plain line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        line = s.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable=None, *, total=None, desc=None, unit="it", initial=0, disable=False, **kwargs):
    """A tqdm progress bar on stderr: redrawn in place on a terminal, one line every
    `LOG_INTERVAL_S` seconds (and a last one at the end) when stderr is a log file."""
    from tqdm import tqdm

    stream = sys.stderr
    if stream.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, disable=disable,
                    file=stream, **kwargs)
    kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, disable=disable,
                file=_LineFile(stream), dynamic_ncols=False, ncols=100, **kwargs)
