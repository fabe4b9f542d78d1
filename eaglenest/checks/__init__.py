"""Checks of a resolved config against the target, the disk, the GPUs and the cluster, before any job runs.

`review_config` runs every check, whatever fails, so all failures are reported together; the workflow calls it
at parse time (`snakemake -n` too) and `python -m eaglenest.plan` through `check_config`. Each failure is one
line naming the key, its value, the limit and what to do. A check that needs what is not here (the target's
config.json, where neither a local directory, the Hugging Face cache nor the hub gives it; sinfo, off a
cluster; nvidia-smi) is skipped, and the plan says so in one line.

The checks of the target are `target`'s, of the GPUs `gpus`', of the settings among themselves and the working
directory `settings_checks`'; each reads the stages' settings (eaglenest.plan.RunSettings).
"""

from .review import Review, check_config, review_config
from .target import fetch_config, find_target_config

__all__ = ["Review", "check_config", "fetch_config", "find_target_config", "review_config"]
