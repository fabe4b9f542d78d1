"""How the draft runs its training-time test (``Runtime``): the attention path, compilation, recomputation and
the loss, chosen per device by ``device.resolve_runtime``; the model (``model.Eagle3Draft``) and the batches
(``batches.BatchLoader``) read it."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Runtime:
    """How the TTT runs: the same model and losses either way. The defaults are the reference path;
    ``device.resolve_runtime`` picks the device's (on CUDA: the flex path, compiled and fused). A P-EAGLE
    draft (``Eagle3Draft._parallel``) runs its positions in one layer call on the flex path and as the
    dense TTT steps on the sdpa path: of these only ``attention``, ``recompute`` and ``fused_loss`` apply."""

    attention: str = "sdpa"
    """"sdpa": a dense boolean mask, keys concatenated step by step (any device); "flex": fixed-shape
    steps over a preallocated key buffer with block-sparse flex attention (T a multiple of
    FLEX_BLOCK; CUDA for speed, CPU works for tests)."""
    compiled: bool = False
    """The flex step is one torch.compile'd function (see ``Eagle3Draft._flex_step``)."""
    recompute: bool = False
    """Each TTT step's activations are recomputed in backward instead of kept."""
    fused_loss: bool = False
    """``ttt_loss_fused`` (lm_head and loss gradient together, no logits kept)."""
    split_step_grads: bool = False
    """Each flex TTT step gets its own alias of the weights the steps share, and their gradients are
    summed in one pass when backward is done (``StepGrads``) instead of autograd adding them into one
    buffer step by step (6 bf16 adds at TTT 7: benchmarks/RESULTS.md, "Figures moved out of code
    comments"); costs ttt_length bf16 gradients of the layer at the end of backward. Not under DDP,
    whose hooks watch the parameters' own gradients."""
    diag_split: bool = False
    """Flex path: flex attention over step 0's causal keys only, the later steps' keys (one per
    query, on the diagonal) merged in elementwise (``Attention.attend_ttt``)."""
    skip_unscored: bool = False
    """With diag_split and targets: the later TTT steps (j >= 1) run only at the base positions whose
    chain still has a scored token ahead (``ttt_chains``): not at prompt or padding positions. Exact:
    a later step's output at t only feeds its own chain at t."""

    @property
    def runs_chains(self) -> bool:
        """The later TTT steps run at the scored chains only: ``skip_unscored`` on the flex path with ``diag_split``
        (the batches then carry the chains in their loss plan, ``batches.BatchLoader``)."""
        return self.attention == "flex" and self.diag_split and self.skip_unscored

    @classmethod
    def from_settings(cls, settings, world=1):
        """From ``device.resolve_runtime``'s TrainSettings (its ``compile`` is ``compiled`` here);
        ``split_step_grads`` only in a single process (DDP's reducer watches the parameters' own
        gradients)."""
        return cls(attention=settings.attention, compiled=settings.compile, recompute=settings.recompute,
                   fused_loss=settings.fused_loss, split_step_grads=settings.split_step_grads and world == 1,
                   diag_split=settings.diag_split, skip_unscored=settings.skip_unscored)
