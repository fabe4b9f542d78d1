"""The crash-safe partial file of a trace shard (see ``traces``' module doc): finished records are
appended and flushed one by one, a rerun drops a torn last line and resumes from the rest, and the
declared output is written from it in prompt order, atomically, once the shard is complete."""

import json
import os

from ..errors import TracesError
from ..util import open_locked, say


def json_line(obj):
    """``obj`` as one compact JSON line, bytes."""
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PartialFile:
    """The finished records of one shard, ``path`` (locked while open); ``index``: id -> (offset,
    length) of its line. A conversation's answered turns are lines of their own ({"turn_of": id, ...},
    ``append_turn``) until its record is appended; they are read back, never copied to the output."""

    def __init__(self, path, shard):
        self.path, self.shard = path, shard
        self.index = {}
        self.file = None
        self.end = 0  # offset of the next record

    def open(self, wanted, on_record, on_turn=None):
        """Open (and lock) the file, drop a torn last line, index the finished records of the ids
        ``wanted`` (``on_record`` is called with each; ``on_turn`` with each turn line of a wanted id
        whose record is not in the file)."""
        turns = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_locked(self.path, TracesError(
            f"{self.shard}: another process is writing {self.path}; "
            "wait for it to finish (or stop it) before rerunning this shard"))
        f = os.fdopen(fd, "r+b")
        offset = bad = 0
        for line in f:
            if not line.endswith(b"\n"):
                break  # torn by a crash mid-write: dropped below
            try:
                record = json.loads(line)
                rid = record["turn_of"] if "turn_of" in record else record["id"]
            except (ValueError, KeyError, TypeError):
                bad += 1  # a complete but unreadable line: its prompt is sent again
            else:
                if "turn_of" in record:
                    if rid in wanted:
                        turns.append(record)
                elif rid in wanted and rid not in self.index:
                    self.index[rid] = (offset, len(line))
                    on_record(record)
            offset += len(line)
        if on_turn is not None:
            for record in turns:
                if record["turn_of"] not in self.index:
                    on_turn(record)
        f.truncate(offset)
        f.seek(offset)
        self.end = offset
        self.file = f
        if bad:
            say(f"{self.shard}: skipped {bad} unreadable lines in {self.path}; "
                "their prompts are sent again")

    def append(self, record):
        """Write and flush one finished record."""
        line = json_line(record)
        self.file.write(line)
        self.file.flush()
        self.index[record["id"]] = (self.end, len(line))
        self.end += len(line)

    def append_turn(self, line):
        """Write and flush one answered turn of a conversation (not a record: not indexed)."""
        data = json_line(line)
        self.file.write(data)
        self.file.flush()
        self.end += len(data)

    def close(self):
        self.file.close()  # flushed per record already; closing releases the lock

    def write_output(self, prompts, output_path):
        """Copy the finished records into ``output_path``, in prompt order, atomically."""
        out = output_path
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
        with open(self.path, "rb") as src, open(tmp, "wb") as dst:
            fd = src.fileno()
            for p in prompts:
                where = self.index.get(p["id"])
                if where is not None:
                    dst.write(os.pread(fd, where[1], where[0]))
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)

    def link_to(self, output_path):
        """Keep the finished shard resumable without a second copy on disk: the file becomes a hard
        link to ``output_path``."""
        link = self.path.with_name(self.path.name + ".link")
        try:
            link.unlink(missing_ok=True)
            os.link(output_path, link)
            os.replace(link, self.path)
        except OSError:
            pass  # another filesystem: the partial file itself holds the same records
