"""Shared helpers: run the real workflow in a temporary directory with a small config."""
import copy
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
TOY_TARGET = ROOT / "toy" / "target"
TOY_PROMPTS = ROOT / "toy" / "prompts.jsonl"

# Every test's vLLM runs eagerly. vLLM 0.32 on CPU compiles the model at each start (its AOT compile
# cache never loads there: "'function' object has no attribute 'finalize_loading'"), about 50 s a start
# on this machine; --enforce-eager skips that (the toy's start went from 77 s to 26 s, measured while the
# suite ran). The shipped config.yaml runs the toy eagerly too (server.extra_args), so the default-
# workflow test (default_config below) runs it as users do.
TEST_SERVER_ARGS = ["--enforce-eager"]


def eager(server: dict) -> dict:
    """A ``server`` config section whose vLLM runs eagerly (``TEST_SERVER_ARGS`` after its own extra_args)."""
    return {**server, "extra_args": [*server.get("extra_args", []), *TEST_SERVER_ARGS]}

BASE_CONFIG = {
    "dataset": {"path": str(TOY_PROMPTS), "limit": 48, "heldout": 8},
    "shards": 2,
    "server": {"mode": "local", "model": str(TOY_TARGET), "served_model_name": "toy", "max_model_len": 512,
               "reasoning_parser": "deepseek_r1", "kv_cache_gb": 1, "dtype": "float32", "poll_interval": 1, "ready_timeout": 600,
               "extra_args": TEST_SERVER_ARGS},
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


def vllm_pids(port: int) -> list[int]:
    """Processes of a vLLM server on `port` (an API server's command line holds `--port N`; its engine
    processes share its process group)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any("vllm" in a for a in argv) and "--port" in argv \
                and argv[argv.index("--port") + 1:argv.index("--port") + 2] == [str(port)]:
            pids.append(int(proc.name))
    return sorted(pids)


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    return inodes


def listeners(port: int) -> list[int]:
    """Processes holding a listening socket on `port` (IPv4 or IPv6)."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    found = set()
    if inodes:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                    found.add(int(proc.name))
            except OSError:
                continue
    return sorted(found)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on `port` and a connection to it is refused. Connections left in TIME_WAIT by a
    closed server do not hold it: the next server binds it."""
    if _listening_inodes(port):
        return False
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


def _started_at(pid: int) -> float:
    """Seconds after boot the process started (inf when it is gone)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return float("inf")
    return ticks / os.sysconf("SC_CLK_TCK")


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid` (a local server's engine processes share its group)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if proc.name.isdigit() and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(proc.name))
    return out


def server_gone(port: int, pgids=(), timeout: float = 30.0) -> None:
    """The server is gone: no vLLM process for `port`, none left in its process groups `pgids`, and
    the port is free. Not the pidfile: stop_local deletes that whatever happens to the process."""
    # Call it once the server should be gone. On a shared machine another test may start a server on
    # the same port meanwhile: a process that started after this call is not ours.
    since = _uptime()

    def ours(pids):
        return sorted({p for p in pids if _started_at(p) <= since})

    deadline = time.monotonic() + timeout
    while True:
        left = ours(vllm_pids(port) + [p for g in pgids for p in group_members(g)])
        held_by = ours(listeners(port))
        if not left and not held_by:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the server on port {port} is not gone: processes {left}, port held by {held_by}")
        time.sleep(0.5)



def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...): the processes a test may signal."""
    children = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def descendants_running(pid: int, script: str) -> list[int]:
    """The processes below `pid` whose command line names `script` (never a stranger's process)."""
    found = []
    for child in descendants(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(script in a for a in argv):
            found.append(child)
    return found


# ----------------------------------------------------------------------------- the tests' own SLURM cluster

SLURM_SCRIPT = ROOT / "ci" / "slurm.sh"


def slurm_script(command: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`ci/slurm.sh COMMAND` (up, down or env); its progress and errors are on stderr."""
    return subprocess.run(["bash", str(SLURM_SCRIPT), command], capture_output=True, text=True, timeout=timeout,
                          env=env)


def script_values(out: subprocess.CompletedProcess) -> dict:
    """The KEY=VALUE lines `ci/slurm.sh up` prints on stdout (SLURM_CONF, STARTED)."""
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The tests' private one-node SLURM cluster (ci/slurm.sh): its SLURM_CONF path. The session's
    environment gets SLURM_CONF, so every SLURM command of the tests and of what they start (eaglenest,
    Snakemake's SLURM executor, the jobs) talks to it and never to a system cluster. Skips with the
    reason where this machine cannot run it (not root, no slurm-wlm); fails where it should start and
    does not. Stopped at the end if this session started it; one already running is reused and left up."""
    out = slurm_script("up")
    if out.returncode == 77:
        pytest.skip(out.stderr.strip().splitlines()[-1])
    if out.returncode != 0:
        pytest.fail(f"the tests' SLURM cluster did not start (ci/slurm.sh up, exit {out.returncode}):\n{out.stderr[-6000:]}")
    values = script_values(out)
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = values["SLURM_CONF"]
    try:
        yield values["SLURM_CONF"]
    finally:
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        if values.get("STARTED") == "yes":
            slurm_script("down")


# ----------------------------------------------------------------------------- the default workflow, once a session
# Shared by tests/test_default_workflow.py and tests/test_formats.py: the most expensive run of the suite.

def _portable(node, key=None):
    """The default config made to run anywhere: repo-relative paths (toy target, bundled prompts)
    absolute, and every `port` (the generation server's, and any other server's) a free one."""
    if isinstance(node, dict):
        return {k: _portable(v, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_portable(v) for v in node]
    if key == "port" and isinstance(node, int):
        return free_port()
    if isinstance(node, str) and not os.path.isabs(node) and "/" in node and (ROOT / node).exists():
        return str(ROOT / node)
    return node


def default_config() -> dict:
    return _portable(yaml.safe_load((ROOT / "config.yaml").read_text()))


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    # EAGLENEST_DEFAULT_RUN: a directory of an earlier run of this test to finish or reuse (Snakemake
    # redoes only what is stale there), for working on the assertions without a fresh 15-minute run.
    reuse = os.environ.get("EAGLENEST_DEFAULT_RUN")
    wd = Path(reuse) if reuse else tmp_path_factory.mktemp("default")
    if not (wd / "config.yaml").exists():
        (wd / "config.yaml").write_text(yaml.safe_dump(default_config()))
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    t0 = time.monotonic()
    run_snakemake(wd, timeout=3600)
    seconds = time.monotonic() - t0
    (wd / "wall_seconds.txt").write_text(f"{seconds:.0f}\n")
    print(f"default workflow: {seconds:.0f} s in {wd}")
    return wd, cfg, json.loads((wd / "reports/validation.json").read_text())
