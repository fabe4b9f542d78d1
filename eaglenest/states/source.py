"""What training reads the target's states through: ``StateSource``, the protocol both sources meet.

``shards.HiddenShards`` reads shards written ahead (``hidden.mode: files``); ``stream.StreamedStates``
fetches the same sequences' states from the extraction server while training runs (``stream``).
``draft.train`` and ``draft.batches`` use only what this protocol names.
"""

from typing import Protocol

import torch


class StateSource(Protocol):
    aux_layers: list
    """The target's layer ids (vLLM's convention) whose states ``aux_hidden`` concatenates."""
    hidden_size: int
    """The target's hidden size H."""
    without_target_next: list
    """The shards whose rows lack ``target_next`` (written by an older eaglenest); empty if none."""

    def __len__(self) -> int:
        """The number of sequences."""

    def length(self, k: int) -> int:
        """The token count of sequence ``k``."""

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        """The rows of sequence ``k``: input_ids, loss_mask, aux_hidden, last_hidden (and target_next)."""

    def fingerprint_facts(self):
        """What the data is (JSON-able), for the resume fingerprint of ``draft.train``."""

    def follow(self, order) -> None:
        """The sequences will be read in ``order`` (an iterable of indices, repeats allowed)."""

    def close(self) -> None:
        """Stop whatever ``follow`` started and free what it holds."""
