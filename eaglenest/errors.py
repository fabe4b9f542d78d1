"""Every error a user can cause, under one base class, so a rule script catches one thing.

A user error's message names the file, key or URL, says what failed and what to do; the scripts
print it as one line in the rule's log and exit 1. A traceback is for our bugs. Each class also
keeps the built-in base it had before (ValueError, RuntimeError, OSError), so code that caught
those still does.
"""

from __future__ import annotations


class EaglenestError(Exception):
    """Base of every error a user can see and fix; its message says what to do."""


class ConfigError(EaglenestError, ValueError):
    """A config the user wrote is wrong; the message names the key."""


class ServerError(EaglenestError, RuntimeError):
    """A server problem a user can fix; the message says what failed, where, and what to do."""


class PromptsError(EaglenestError, ValueError):
    """A problem the user can fix: the message names the dataset, column or row and what to do."""


class RowError(EaglenestError, ValueError):
    """A row that cannot give a question; `reason` is one of prompts.REASONS. Counted, never fatal."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class TracesError(EaglenestError, RuntimeError):
    """A failure the user can fix (server down, bad shard, too many failed requests)."""


class DiskSpaceError(EaglenestError, OSError):
    """Not enough free disk for a shard: the message says needed vs free bytes and where."""


class ValidationError(EaglenestError, RuntimeError):
    """A validation step failed in a way the user can act on; the message says what and where."""


class GpuError(EaglenestError, RuntimeError):
    """A job asks for more GPUs than the machine has, or waited too long for free ones."""


class TraceRecordError(EaglenestError, ValueError):
    """A trace record that gives no training sequence (malformed, or token ids that are not lists of
    ints); the message names the file and line."""
