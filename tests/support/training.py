"""The tests' training settings: the schema's TrainSettings with a few keys changed, as the tests write them
(flat, one dict: ``checkpoint.settings_with``), on the CPU."""
from eaglenest.draft.checkpoint import settings_with
from eaglenest.settings import TrainSettings


def train_settings(changes=None, device="cpu") -> TrainSettings:
    """The schema's TrainSettings on ``device`` with ``changes`` (``train_record``'s keys)."""
    return settings_with(changes or {}).replace(device=device)
