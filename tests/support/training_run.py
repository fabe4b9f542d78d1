"""A short training run on the ``data`` fixture's states (tests/conftest.py): the draft the training, export,
report and format tests start from."""
from eaglenest.draft.train import train_draft
from tests.support.training import train_settings

CONFIG = {"ttt_length": 3, "batch_tokens": 200, "max_steps": 6, "save_every": 2, "lr": 3e-3, "warmup_steps": 2, "seed": 3}


def run(data, out, config=CONFIG):
    """train_draft on CPU with ``config`` (the training keys ``train_settings`` takes): the checkpoint, the metrics and the
    resume state under ``out``; returns its stats."""
    return train_draft(
        data["hidden_paths"], data["vocab_path"], out / "checkpoint.safetensors", out / "train_metrics.csv",
        head_path=data["head_path"], settings=train_settings(config), state_dir=out / ".train_state", progress=False,
    )
