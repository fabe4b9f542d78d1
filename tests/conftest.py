"""Shared helpers: run the real workflow in a temporary directory with a small config."""
import copy
import dataclasses
import json
import os
import random
import re
import signal
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
    # The toy's whole vocabulary, and sequences no longer than the servers hold (both checked before any job).
    "draft": {"aux_layers": [1, 2, 3], "vocab_size": 105},
    "hidden": {"max_length": 512},
    "generation": {"max_tokens": 256, "concurrency": 16, "request_timeout": 300, "max_retries": 3},
}


# ----------------------------------------------------------------------------- two test processes (pytest-xdist)
# `make test` runs the suite in two pytest processes (`-n 2`): most of a vLLM test's time is a start that
# keeps one core busy, so two tests at once use the machine's two cores. A session fixture lives once per
# process, so the tests that share a costly one (a whole workflow run, the SLURM cluster) run in one
# process, and so do a module's tests (its module fixtures): the scheduler below sends each group below,
# and every other module, to one process as a unit. (Not xdist's loadgroup: under pytest 9.2 its
# xdist_group marks no longer reach the scheduler.)
SHARED_RUNS = {  # group (the shared session fixture) -> the test modules that use it
    "default_run": ("test_default_workflow.py", "test_formats.py"),
    "vllm_backend_run": ("test_backends_acceptance.py", "test_extract_vllm.py", "test_stream.py", "test_train_rule.py"),
    "slurm_cluster": ("test_api_key.py", "test_slurm.py", "test_slurm_cluster.py", "test_slurm_replicas.py",
                      "test_slurm_workflow.py"),
}
SHARED_FIXTURES = {"default_run": "default_run", "vllm_backend_run": "vllm_backend_run",
                   "transformers_backend_run": "vllm_backend_run", "slurm_cluster": "slurm_cluster"}
_GROUP_OF = {module: group for group, modules in SHARED_RUNS.items() for module in modules}


def schedule_unit(nodeid: str) -> str:
    """The unit a test is scheduled in: its shared run's group, else its module."""
    module = nodeid.split("::", 1)[0]
    return _GROUP_OF.get(Path(module).name, module)


SESSION_CPUS = sorted(os.sched_getaffinity(0))  # before pytest_configure takes this process's share


def pytest_configure(config):
    """In a test process of `-n N`: its own share of the CPUs (every Nth of those this session may use),
    inherited by every server, workflow and training it starts. Without it each process's vLLM and
    torch spread their threads over all the cores, and two processes' threads wait on each other
    (the default workflow took over twice its time beside another)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker and 1 < count <= len(SESSION_CPUS):
        os.sched_setaffinity(0, SESSION_CPUS[int(worker.removeprefix("gw")) % count::count])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SharedRunScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return schedule_unit(nodeid)

    config.option.loadscopereorder = False  # the collection order below: the longest units first
    return SharedRunScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, group in SHARED_FIXTURES.items():
            if fixture in item.fixturenames and schedule_unit(item.nodeid) != group:
                raise pytest.UsageError(f"{item.nodeid} uses the session fixture {fixture}: add its module to "
                                        f"SHARED_RUNS[{group!r}] in tests/conftest.py, so it runs in that run's process")
    starts_vllm = {schedule_unit(item.nodeid) for item in items if item.get_closest_marker("vllm")}
    order = list(SHARED_RUNS)

    def rank(item):  # the shared runs first (the longest, the default run, first), then the other vLLM
        group = schedule_unit(item.nodeid)  # starters, then the rest, which fill the gaps at the end
        return (0, order.index(group)) if group in SHARED_RUNS else ((1 if group in starts_vllm else 2), 0)

    items.sort(key=rank)  # stable: a module's tests keep their order


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick for a bind to port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_ports(wd) -> list[int]:
    """Every port a server under ``wd`` listened on (the port launchers' records, serving.port)."""
    from eaglenest.serving.port import PORT_FILE, read_port_record

    records = [read_port_record(p) for p in Path(wd).rglob(PORT_FILE)]
    return sorted({r["port"] for r in records if r and r.get("port")})


def servers_gone(wd, timeout: float = 30.0) -> None:
    """Every server a workflow in ``wd`` started is gone (``server_gone`` on each port it used)."""
    ports = served_ports(wd)
    assert ports, f"no port record under {wd}"
    for port in ports:
        server_gone(port, timeout=timeout)


def wait_port(log_dir, timeout: float = 120.0) -> int:
    """The port the server whose records live in ``log_dir`` took, once its launcher wrote it."""
    from eaglenest.serving.port import PORT_FILE, read_port_record

    deadline = time.monotonic() + timeout
    while True:
        record = read_port_record(Path(log_dir) / PORT_FILE)
        if record and record.get("port"):
            return record["port"]
        if time.monotonic() > deadline:
            pytest.fail(f"no port record in {log_dir} within {timeout:g} s")
        time.sleep(0.2)


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def write_config(workdir: Path, **overrides) -> dict:
    cfg = merge(BASE_CONFIG, overrides)
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


def rules_run(out: subprocess.CompletedProcess) -> set[str]:
    """The rules of the jobs a Snakemake run (or dry run) printed ("rule X:" / "localrule X:"), not
    the other lines that name rules (the plan's, for one)."""
    return set(re.findall(r"^(?:local)?rule (\w+):$", out.stdout + out.stderr, re.M))


def _processes():
    """(pid, the fields of /proc/PID/stat after the command name) of every process still readable:
    fields[0] the state, [1] the parent, [2] the process group, [19] the start time in clock ticks."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            yield int(proc.name), (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue


def cmdline(pid: int) -> list[str]:
    """The command line of `pid` (empty when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def vllm_pids(port: int) -> list[int]:
    """Processes of a vLLM server on `port` (an API server's command line holds `--port N`; its engine
    processes share its process group)."""
    pids = []
    for pid, fields in _processes():
        argv = cmdline(pid) if fields[0] != "Z" else []
        if any("vllm" in a for a in argv) and "--port" in argv \
                and argv[argv.index("--port") + 1:argv.index("--port") + 2] == [str(port)]:
            pids.append(pid)
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
        for pid, _ in _processes():
            try:
                if any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir()):
                    found.add(pid)
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


def started_at(pid: int) -> float:
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
    return [pid for pid, fields in _processes() if fields[0] != "Z" and int(fields[2]) == pgid]


def server_gone(port: int, pgids=(), timeout: float = 30.0) -> None:
    """The server is gone: no vLLM process for `port`, none left in its process groups `pgids`, and
    the port is free. Not the pidfile: stop_local deletes that whatever happens to the process."""
    # Call it once the server should be gone. On a shared machine another test may start a server on
    # the same port meanwhile: a process that started after this call is not ours.
    since = _uptime()

    def ours(pids):
        return sorted({p for p in pids if started_at(p) <= since})

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
    for proc, fields in _processes():
        children.setdefault(int(fields[1]), []).append(proc)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def descendants_running(pid: int, script: str) -> list[int]:
    """The processes below `pid` whose command line names `script` (never a stranger's process)."""
    return [child for child in descendants(pid) if any(script in a for a in cmdline(child))]


# ----------------------------------------------------------------------------- the toy server, once a session

def start_toy_server(log_dir: Path):
    """A vLLM serving the toy target (BASE_CONFIG's server on a free port) that the test started and owns,
    as a user's systemd service or hand-started server would be: (ServerConfig, pidfile record)."""
    from eaglenest.serving.lifecycle import wait_ready
    from eaglenest.serving.local import LocalPaths, start_local, stop_local
    from eaglenest.serving.settings import ServerConfig

    cfg = ServerConfig.from_dict(BASE_CONFIG["server"])  # no port: the launcher takes a free one
    paths = LocalPaths(log_dir)
    record = start_local(cfg, paths, log=print)  # no workflow pid: no watchdog, the test owns it
    try:
        ready = wait_ready(cfg, paths, log=print)
    except BaseException:
        stop_local(paths)
        raise
    return dataclasses.replace(cfg, port=int(ready["urls"][0].rsplit(":", 1)[1])), record


@pytest.fixture(scope="session")
def toy_server(tmp_path_factory):
    """One toy server for the tests that only send it requests or point a workflow at it in
    `server.mode: external` (which never stops it): (ServerConfig, pidfile record). Tests that kill,
    fault or key a server start their own. Stopped at the end of the session, and checked gone."""
    from eaglenest.serving.local import LocalPaths, stop_local

    log_dir = tmp_path_factory.mktemp("toy_server")
    cfg, record = start_toy_server(log_dir)
    yield cfg, record
    stop_local(LocalPaths(log_dir))
    server_gone(cfg.port, pgids=[record["pgid"]])


# ----------------------------------------------------------------------------- workflows a test interrupts

def read_lines(path) -> list[dict]:
    """The records of a JSON-lines file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def prompt_ids(wd, shards) -> list[str]:
    """The sorted prompt ids of the first `shards` prompt shards of the run in `wd`."""
    return sorted(r["id"] for i in range(shards) for r in read_lines(wd / f"data/prompts/shard_{i}.jsonl"))


def _default_sigint():
    # A shell that starts a command in the background (`make test &`, CI runners) starts it with SIGINT
    # ignored, and every process below inherits that: Ctrl-C would then reach a Snakemake that ignores
    # it. A user's terminal leaves SIGINT at its default; so does this, for the workflows the tests start.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_workflow(wd, *args) -> subprocess.Popen:
    """Snakemake on `wd` in the background, in its own session, with SIGINT at its default (as in a terminal)."""
    return subprocess.Popen(snakemake_cmd(wd, *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_default_sigint)


def wait_partial(wd, n, proc, timeout=600):
    """The partial trace file of shard 0 once it holds `n` records (fails if `proc` ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parts = list((wd / "traces/partial").glob("shard_0*.jsonl")) if (wd / "traces/partial").exists() else []
        if parts and parts[0].read_text().count("\n") >= n:
            return parts[0]
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    pytest.fail("no partial records appeared")


def finished_before(partial):
    """The complete records of a partial trace file (its last line may be cut)."""
    return [l for l in partial.read_text().split("\n")[:-1] if l.strip()]


def assert_traces_complete(wd, before_lines):
    """Shard 0 answers every prompt exactly once and keeps each record finished before a crash as it was."""
    final = (wd / "traces/shard_0.jsonl").read_text().splitlines()
    ids = [json.loads(l)["id"] for l in final]
    assert sorted(ids) == prompt_ids(wd, 1), "every prompt answered exactly once"
    by_id = {json.loads(l)["id"]: json.loads(l) for l in final}
    for line in before_lines:
        rec = json.loads(line)
        assert by_id[rec["id"]] == rec, "a record finished before the crash is kept as it was"


# ----------------------------------------------------------------------------- the tests' own SLURM cluster

SLURM_SCRIPT = ROOT / "ci" / "slurm.sh"


def slurm_script(command: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`ci/slurm.sh COMMAND` (up, down or env); its progress and errors are on stderr. The cluster is the
    machine's, not this test process's: it runs on every CPU the session had (`slurmd -C` sizes the node
    by the CPUs it may use), whatever share of them this process has."""
    return subprocess.run(["bash", str(SLURM_SCRIPT), command], capture_output=True, text=True, timeout=timeout,
                          env=env, preexec_fn=lambda: os.sched_setaffinity(0, SESSION_CPUS))


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


def slurm_command(args, **kw) -> subprocess.CompletedProcess:
    """A SLURM client command (scancel, scontrol, squeue, ...) against the tests' cluster, within a minute."""
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kw)


def scontrol_job(job_id) -> str:
    """`scontrol show job` of `job_id` on one line (empty once SLURM has forgotten it)."""
    return slurm_command(["scontrol", "--oneliner", "show", "job", job_id]).stdout


@pytest.fixture
def cluster(slurm_cluster):
    """A list a test appends its SLURM job names to before it submits: every job of those names is
    cancelled when the test ends, passed or failed (scancel --name matches whole names)."""
    submitted = []
    yield submitted
    for name in submitted:
        slurm_command(["scancel", "--me", "--name", name])


# ----------------------------------------------------------------------------- the default workflow, once a session
# Shared by tests/test_default_workflow.py and tests/test_formats.py: the most expensive run of the suite.

def _portable(node, key=None):
    """The default config made to run anywhere: repo-relative paths (toy target, bundled prompts)
    absolute (its servers take free ports where they run: no port is set)."""
    if isinstance(node, dict):
        return {k: _portable(v, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_portable(v) for v in node]
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


# ----------------------------------------------------------------------------- a draft measured in vLLM

K = 3  # speculative tokens of every test's measurement
# The toy's draft training in the tests: short, but enough for the draft to learn much of the toy's
# arithmetic (about 1.5 minutes on 2 cores); two epochs of 300 traces, so stream mode reads sequences
# again. save_every is not in the training fingerprint: saving resume points changes no weight.
TRAIN = {"max_steps": 60, "lr": 3e-3, "warmup_steps": 5, "batch_tokens": 2048, "ttt_length": 3, "save_every": 10}


def measure_draft(name, wd: Path, cfg: dict, spec: dict, *, server: dict | None = None, log_dir=None) -> dict:
    """vLLM serving the target of the run in `wd` (config `cfg`) with `spec` as its speculative config,
    measured on that run's held-out prompts (eight at a time after one warm-up request; this test's process
    is the watchdog's workflow). `server`: a server section other than cfg's. The answers are left out."""
    from eaglenest.serving.settings import ServerConfig
    from eaglenest.validation.validate import measure_run, read_prompts, request_settings

    run = measure_run(name, ServerConfig.from_dict(server or cfg["server"]), spec,
                      read_prompts(wd / "data/prompts/heldout.jsonl"), request_settings(cfg["generation"]["max_tokens"]),
                      log_dir=log_dir or wd / "logs/validate", concurrency=8, warmup_requests=1,
                      workflow_pid=os.getpid())
    return {k: v for k, v in run.items() if k != "answers"}


def eagle3(draft_dir: Path) -> dict:
    """The speculative config that serves the vLLM-format draft in `draft_dir` with K tokens."""
    from eaglenest.serving.vllm import speculative_config

    return speculative_config("eagle3", K, draft_dir)


# ----------------------------------------------------------------------------- the vLLM-backend run, once a session
# Shared by tests/test_backends_acceptance.py, tests/test_extract_vllm.py, tests/test_stream.py and
# tests/test_train_rule.py: they compare another way of getting the hidden states (the transformers
# backend; stream mode) with this run on its traces, check its extraction, or train from its files.

VLLM_BACKEND_RUN = dict(dataset={"limit": 300, "heldout": 24}, shards=1, generation={"concurrency": 64}, train=TRAIN,
                        hidden={"backend": "vllm", "dtype": "float32"})


@pytest.fixture(scope="session")
def vllm_backend_run(tmp_path_factory):
    """The workflow with `hidden.backend: vllm` in files mode up to draft/checkpoint (trace server,
    extraction server, one shard, training, export): (wd, cfg). Tests copy its prompts and traces and
    write nothing into it but the measurement's logs."""
    wd = tmp_path_factory.mktemp("vllm_backend")
    cfg = write_config(wd, **VLLM_BACKEND_RUN)
    run_snakemake(wd, "draft/checkpoint", timeout=1500)
    return wd, cfg


@pytest.fixture(scope="session")
def transformers_backend_run(vllm_backend_run, tmp_path_factory):
    """The same run with `hidden.backend: transformers` on the vLLM-backend run's prompts and traces
    (copied: only the hidden states differ), up to draft/checkpoint; starts no server: (wd, cfg)."""
    wd_v, cfg_v = vllm_backend_run
    wd = tmp_path_factory.mktemp("transformers_backend")
    cfg = write_config(wd, **{**VLLM_BACKEND_RUN, "hidden": {"backend": "transformers", "dtype": "float32"}})
    copy_traces(wd_v, wd)
    out = run_snakemake(wd, "draft/checkpoint", timeout=1200)
    assert "generate_traces" not in rules_run(out), "the copied traces were used as they are"
    return wd, cfg


def copy_traces(src: Path, dst: Path) -> None:
    """`src`'s prompts and traces (mtimes kept, with its server.stopped) into `dst`: nothing upstream
    of the hidden states reruns there."""
    import shutil

    for part in ("data", "traces"):
        shutil.copytree(src / part, dst / part)
    shutil.copy2(src / "server.stopped", dst / "server.stopped")


# ----------------------------------------------------------------------------- a tiny random target's data, once a session
# The pipeline's files for the training, export, report and DDP tests (no server, no Snakemake).

VOCAB, HIDDEN, LAYERS = 100, 64, 4


def tiny_target(path, seed=0):
    """A randomly initialised 4-layer Llama (hidden 64, vocab 100) saved to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def fake_traces(path, n=12, seed=0, truncated_every=4):
    """Trace records with random token ids; every ``truncated_every``-th one is truncated."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 10))]
            # skewed so that some tokens are frequent: the draft vocabulary then means something
            completion = [min(VOCAB - 1, int(rng.expovariate(0.08))) for _ in range(rng.randint(5, 30))]
            rec = {
                "id": f"q{i}", "source": "test", "messages": [], "reasoning": "", "content": "",
                "finish_reason": "length" if i % truncated_every == 1 else "stop",
                "truncated": i % truncated_every == 1, "prompt_token_ids": prompt,
                "completion_token_ids": completion, "usage": {}, "latency_s": 0.0, "server": "test",
            }
            f.write(json.dumps(rec) + "\n")
    return path


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """Traces -> hidden shard + target head + vocab of a tiny random target. Tests read these files and
    write only under their own directories."""
    from eaglenest.draft.vocab import build_vocab
    from eaglenest.settings import DraftSettings, HiddenSettings
    from eaglenest.states.hidden import extract_hidden
    from eaglenest.states.target import save_target_head

    root = tmp_path_factory.mktemp("pipeline")
    target = tiny_target(root / "target")
    traces = fake_traces(root / "traces.jsonl", n=24)
    extract_hidden(traces, root / "hidden" / "shard_0.safetensors", HiddenSettings.defaults().replace(target=target, max_length=48), progress=False)
    save_target_head(root / "hidden" / "target_head.safetensors", HiddenSettings.defaults().replace(target=target))
    build_vocab(traces, root / "vocab.safetensors", 100, DraftSettings.defaults().replace(vocab_size=40))
    return {
        "hidden_paths": [root / "hidden" / "shard_0.safetensors"],
        "vocab_path": root / "vocab.safetensors",
        "head_path": root / "hidden" / "target_head.safetensors",
    }
