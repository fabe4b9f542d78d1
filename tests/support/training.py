"""The tests' training settings: the schema's TrainSettings with a few keys changed, as the tests write them
(flat, one dict: ``settings_with``), on the CPU."""


def settings_with(changes: dict, base=None):
    """``base`` (None: the schema's TrainSettings) with ``changes``, keyed as ``checkpoint.train_record`` keys them
    (the tests' flat overrides): TrainSettings fields, the draft's shape keys, ``dflash`` (a dict of DFlashSettings
    fields). An unknown key raises, naming the known ones."""
    from eaglenest.draft.checkpoint import train_record
    from eaglenest.settings import TrainSettings

    base = base or TrainSettings.defaults()
    changes = dict(changes)
    unknown = sorted(set(changes) - set(train_record(base)) - {"device"})
    if unknown:
        raise ValueError(f"unknown training keys {unknown}; known: {sorted(train_record(base))}")
    draft = base.draft.replace(**{k: changes.pop(k) for k in list(changes) if k in base.draft.shape()})
    if "dflash" in changes:
        draft = draft.replace(dflash=draft.dflash.replace(**changes.pop("dflash")))
    return base.replace(draft=draft, **changes)


def train_settings(changes=None, device="cpu"):
    """The schema's TrainSettings on ``device`` with ``changes`` (``train_record``'s keys). Imported here, not at
    the top: conftest imports this module, and torch imported before a test process takes its share of the
    CPUs (scheduling.pin_share) sizes its thread pool for every core."""
    return settings_with(changes or {}).replace(device=device)
