"""What the checks of a config found (``Review``): each check module adds its failures and notes to one."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Review:
    """What the checks of a config found: the failures (one line each, key, value, limit and fix), the checks
    that could not run here (one line each, why), and lines for the log of checks that passed."""

    errors: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def add(self, *failures) -> None:
        self.errors += [f for f in failures if f]
