"""The tests' training settings: the schema's TrainSettings with a few keys changed, as the tests write them
(flat, one dict: ``checkpoint.settings_with``), on the CPU."""


def train_settings(changes=None, device="cpu"):
    """The schema's TrainSettings on ``device`` with ``changes`` (``train_record``'s keys). Imported here, not at
    the top: conftest imports this module, and torch imported before a test process takes its share of the
    CPUs (scheduling.pin_share) sizes its thread pool for every core."""
    from eaglenest.draft.checkpoint import settings_with

    return settings_with(changes or {}).replace(device=device)
