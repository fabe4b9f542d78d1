"""Training in several processes: ``train_in_processes`` starts ``train.train_draft`` in this process or
under torchrun, and ``main`` is what torchrun starts once per process (``python -m eaglenest.draft.launch``).
The processes take the run's TrainSettings from a file the launcher writes (``write_settings``)."""

import json
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from ..settings import TrainSettings
from ..util import say
from .train import train_draft


def write_settings(settings: TrainSettings, directory) -> Path:
    """``settings`` in a new file of ``directory`` that ``main --settings`` reads back (the caller removes it)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=directory, prefix="settings_", suffix=".pickle", delete=False) as f:
        pickle.dump(settings, f)
    return Path(f.name)


def read_settings(path) -> TrainSettings:
    """The TrainSettings ``write_settings`` wrote at ``path``."""
    settings = pickle.loads(Path(path).read_bytes())
    if not isinstance(settings, TrainSettings):
        raise ValueError(f"{path}: not a TrainSettings file (write_settings writes them), got {type(settings).__name__}")
    return settings


def train_in_processes(nproc: int, hidden_paths, vocab_path, out_path, metrics_path, *, head_path, settings: TrainSettings,
                       state_dir, stream=None, snapshot_paths=()) -> int:
    """``train_draft`` in this process (``nproc`` 1), or in ``nproc`` processes under torchrun, each
    started with ``main``'s arguments. Returns the exit status."""
    if nproc <= 1:
        train_draft(hidden_paths, vocab_path, out_path, metrics_path, head_path=head_path, settings=settings,
                    state_dir=state_dir, stream=stream, snapshot_paths=snapshot_paths)
        return 0
    settings_file = write_settings(settings, state_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "eaglenest.draft.launch", "--hidden", *map(str, hidden_paths), "--vocab", str(vocab_path),
           "--head", str(head_path), "--out", str(out_path), "--metrics", str(metrics_path), "--state-dir", str(state_dir),
           "--snapshots", *map(str, snapshot_paths), "--settings", str(settings_file),
           *(["--stream", json.dumps(stream)] if stream else [])]
    say("launching: " + " ".join(cmd))
    try:
        # sys.stdout, not the inherited descriptors: a rule script's output goes to its log (logs.to_log)
        return subprocess.run(cmd, stdout=sys.stdout, stderr=sys.stderr).returncode
    finally:
        settings_file.unlink(missing_ok=True)


def main(argv=None):
    """`python -m eaglenest.draft.launch ...`: the entry point torchrun starts once per process."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m eaglenest.draft.launch")
    p.add_argument("--hidden", nargs="*", default=[])
    p.add_argument("--stream", default=None, help="hidden.mode stream: stream.open_stream's settings as JSON")
    p.add_argument("--vocab", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--snapshots", nargs="*", default=[], help="where the drafts kept along training go")
    p.add_argument("--settings", required=True, help="the run's TrainSettings, as write_settings wrote them")
    a = p.parse_args(argv)
    train_draft(a.hidden, a.vocab, a.out, a.metrics, head_path=a.head, settings=read_settings(a.settings),
                state_dir=a.state_dir, stream=json.loads(a.stream) if a.stream else None, snapshot_paths=a.snapshots)


if __name__ == "__main__":
    main()
