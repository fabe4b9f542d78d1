"""/proc scans: a port's listeners, a vLLM server's processes, a process's descendants and start time.
Linux only, as the tests' servers are."""
import os
import socket
from pathlib import Path


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


def uptime() -> float:
    """Seconds since boot (the clock of `started_at`)."""
    return float(Path("/proc/uptime").read_text().split()[0])


def group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid` (a local server's engine processes share its group)."""
    return [pid for pid, fields in _processes() if fields[0] != "Z" and int(fields[2]) == pgid]


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
