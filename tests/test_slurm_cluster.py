"""ci/slurm.sh: the tests' own SLURM cluster leaves a system SLURM on the same machine alone.

Each test starts and stops a second private cluster (its own directory, so the session's
cluster keeps serving the other tests) while decoys stand where a system SLURM would be: a
configuration (/etc/slurm/slurm.conf, or a file the caller's SLURM_CONF names) and processes named
slurmctld, slurmd and munged whose pids are in the system's pidfiles, where the old ci/slurm_up.sh
found the daemons it killed. Afterwards /etc/slurm and /etc/munge are byte-identical, the decoys are
alive and got no signal, and every SLURM or munge daemon that ran before runs still, the same process.
Root only (as the session's cluster): the decoys go where a system SLURM's files go."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.slurm import script_values, slurm_script

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]

ETC = (Path("/etc/slurm"), Path("/etc/munge"))
DAEMONS = ("slurmctld", "slurmd", "munged")
# Where Debian's daemons (and the old ci/slurm_up.sh) keep their pids.
SYSTEM_PIDFILES = {"slurmctld": Path("/run/slurmctld.pid"), "slurmd": Path("/run/slurmd.pid"),
                   "munged": Path("/run/munge/munged.pid")}
DECOY_CONF = "# a real cluster's configuration (decoy)\nClusterName=decoy\nSlurmctldHost=decoy-head\n"

# A process that /proc calls NAME (as pgrep and a pidfile check see it) and notes every signal it gets.
DECOY_DAEMON = r'''
import ctypes, signal, sys, time
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME: /proc/PID/comm
log = open(sys.argv[2], "a")


def note(signum, frame):
    log.write(f"{signal.Signals(signum).name}\n")
    log.flush()


for s in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
    try:
        signal.signal(s, note)
    except (OSError, ValueError):
        pass
print("ready", flush=True)
while True:
    time.sleep(1)
'''


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _running(pid: int, name: str) -> bool:
    """The process `pid` is `name` and runs (is not a zombie waiting for init to reap it)."""
    try:
        return _comm(pid) == name and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _daemons() -> dict[int, str]:
    """{pid: /proc/PID/stat's start time} of every live process named like a SLURM or munge daemon (not
    the zombies a daemon's first process leaves when it forks into the background)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _comm(int(proc.name)) in DAEMONS:
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                out[int(proc.name)] = fields[19]
    return out


def _files(dirs) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for d in dirs if d.is_dir() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def system_decoys(tmp_path, slurm_cluster):
    """Decoy system daemons, in the system's pidfiles where those are free. After the test: each decoy
    alive and unsignalled, and each daemon that ran before the test (the session cluster's, any
    system's) the same process still."""
    before = _daemons()
    decoys, written = {}, []
    try:
        for name, pidfile in SYSTEM_PIDFILES.items():
            log = tmp_path / f"decoy-{name}.signals"
            proc = subprocess.Popen([sys.executable, "-c", DECOY_DAEMON, name, str(log)], stdout=subprocess.PIPE,
                                    text=True)
            decoys[name] = (proc, log)
            assert proc.stdout.readline().strip() == "ready" and _comm(proc.pid) == name
            if pidfile.parent.is_dir() and not pidfile.exists():
                pidfile.write_text(f"{proc.pid}\n")
                written.append((pidfile, proc.pid))
        yield decoys
        for name, (proc, log) in decoys.items():
            assert proc.poll() is None, f"the decoy {name} died"
            assert not log.exists() or not log.read_text(), f"the decoy {name} got {log.read_text().split()}"
        after = _daemons()
        changed = {pid: _comm(pid) for pid, started in before.items() if after.get(pid) != started}
        assert not changed, f"daemons that ran before the test are gone or replaced: {changed}"
    finally:
        for pidfile, pid in written:
            if pidfile.exists() and pidfile.read_text().strip() == str(pid):
                pidfile.unlink()
        for proc, _ in decoys.values():
            proc.kill()
            proc.wait()


@pytest.fixture
def cluster_dir():
    """A directory for a second private cluster: in /tmp, as the default one, since munged wants every
    directory above its socket open to all (pytest's tmp_path is not)."""
    d = Path(tempfile.mkdtemp(prefix="eaglenest-slurm-test-"))
    d.chmod(0o755)
    yield d
    slurm_script("down", env={**os.environ, "EAGLENEST_SLURM_DIR": str(d)}, timeout=120)  # when a test failed
    shutil.rmtree(d, ignore_errors=True)


def _start_and_stop(d: Path, **env) -> dict:
    """Start a private cluster in `d`, look at it, reuse it, stop it; its `up` values."""
    env = {**os.environ, "EAGLENEST_SLURM_DIR": str(d), **env}
    t0 = time.monotonic()
    up = slurm_script("up", env=env, timeout=120)
    assert up.returncode == 0, up.stderr[-4000:]
    values = script_values(up)
    assert values == {"SLURM_CONF": str(d / "etc/slurm.conf"), "STARTED": "yes"}, up.stdout
    started = time.monotonic() - t0

    conf = Path(values["SLURM_CONF"]).read_text()
    ports = {int(p) for p in re.findall(r"^Slurm(?:ctld|d)Port=(\d+)$", conf, re.M)}
    session_conf = Path(os.environ["SLURM_CONF"]).read_text()
    assert len(ports) == 2 and not ports & {6817, 6818}, conf
    assert not ports & {int(p) for p in re.findall(r"^Slurm(?:ctld|d)Port=(\d+)$", session_conf, re.M)}
    assert f"AuthInfo=socket={d}/munge/munge.socket\n" in conf
    paths = re.findall(r"=(/[^\s,]*)", conf)
    assert paths and all(p.startswith(f"{d}/") for p in paths), paths  # no system path
    pids = {name: int((d / sub / f"{name}.pid").read_text()) for name, sub in
            (("munged", "munge"), ("slurmctld", "run"), ("slurmd", "run"))}
    assert all(_running(pid, name) for name, pid in pids.items()), pids
    # slurmd, and its jobs, see the private configuration at SLURM's default path.
    assert Path(f"/proc/{pids['slurmd']}/root/etc/slurm/slurm.conf").read_text() == conf
    sinfo = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30,
                           env={**env, "SLURM_CONF": values["SLURM_CONF"]})
    assert sinfo.stdout.split() == ["idle"], sinfo.stderr

    again = slurm_script("up", env=env, timeout=120)
    assert again.returncode == 0 and script_values(again)["STARTED"] == "no", again.stderr[-4000:]
    assert all(_running(pid, name) for name, pid in pids.items()), "up restarted a running, healthy cluster"

    t1 = time.monotonic()
    down = slurm_script("down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr[-4000:]
    assert not [name for name, pid in pids.items() if _running(pid, name)], down.stderr
    print(f"private cluster: up {started:.1f} s, down {time.monotonic() - t1:.1f} s")
    return values


def test_cluster_starts_and_stops_beside_a_system_configuration(cluster_dir, system_decoys):
    conf = Path("/etc/slurm/slurm.conf")
    made_dir, made = not conf.parent.exists(), not conf.exists()
    if made:  # a decoy, removed afterwards; an existing configuration is only read
        conf.parent.mkdir(exist_ok=True)
        conf.write_text(DECOY_CONF)
    try:
        before = _files(ETC)
        _start_and_stop(cluster_dir)
        assert _files(ETC) == before
    finally:
        if made:
            conf.unlink(missing_ok=True)
        if made_dir:
            conf.parent.rmdir()


def test_cluster_ignores_the_callers_slurm_conf(tmp_path, cluster_dir, system_decoys):
    site = tmp_path / "site" / "slurm.conf"  # where a site's module points SLURM_CONF
    site.parent.mkdir()
    site.write_text(DECOY_CONF)
    before = _files(ETC)
    values = _start_and_stop(cluster_dir, SLURM_CONF=str(site))
    assert values["SLURM_CONF"] != str(site)
    assert site.read_text() == DECOY_CONF and [p.name for p in site.parent.iterdir()] == ["slurm.conf"]
    assert _files(ETC) == before
