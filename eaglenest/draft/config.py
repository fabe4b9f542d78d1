"""The draft's shape: one config class that export writes to ``config.json`` (draft.vllm_format) and
validation reads back. It sits low, so export and the report read a checkpoint without the trainer.

``target_vocab_size`` is stored under ``vocab_size`` (``STORED_AS``), the key vLLM's config.json gives
the target's vocabulary, in checkpoints too.

The draft's kind (setting ``draft.kind``) is not a field of its own: ``KINDS`` says which of vLLM's
switches each kind turns on, and the config holds those switches (``fc_norm``, ``norm_output``,
``parallel_drafting``), so a config read back from any config.json is the one vLLM runs."""

from dataclasses import asdict, dataclass, field

# Fields whose stored key (checkpoint, vLLM's config.json) is not their Python name.
STORED_AS = {"target_vocab_size": "vocab_size"}

# Draft kind -> the switches of vLLM 0.32's llama_eagle3.py it sets (DraftConfig fields of those names).
# EAGLE-3.1 is EAGLE-3 with a per-aux-layer RMSNorm before fc and the post-norm state fed forward.
# P-EAGLE ("peagle", the name of vLLM's and speculators' loaders) is EAGLE-3's layer drafting all k tokens
# in one forward (vLLM's speculative config key ``parallel_drafting``), with speculators' P-EAGLE switches.
KINDS = {
    "eagle3": {"fc_norm": False, "norm_output": False, "parallel_drafting": False},
    "eagle3.1": {"fc_norm": True, "norm_output": True, "parallel_drafting": False},
    "peagle": {"fc_norm": False, "norm_output": False, "parallel_drafting": True},
}


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_vocab_size: int  # the target's vocabulary: rows of the shared embedding, length of t2d
    draft_vocab_size: int  # the draft's (config draft.vocab_size): rows of lm_head, length of d2t
    target_hidden_size: int
    num_aux_layers: int = 3
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    # vLLM's ``norm_before_fc``: one RMSNorm over fc's whole n_aux·H_t input (``input_norm.weight``)
    # before fc_norm and fc; speculators' trainer turns it on for its EAGLE-3 drafts.
    norm_before_fc: bool = False
    # vLLM's ``fc_norm``: each aux layer's H_t-wide chunk of fc's input has its own RMSNorm
    # (``fc_norm.{i}.weight``) before fc (EAGLE-3.1).
    fc_norm: bool = False
    # vLLM's ``norm_output``: the next draft step is fed the output after ``norm`` (the state the
    # logits come from) instead of the pre-norm sum (EAGLE-3.1).
    norm_output: bool = False
    # P-EAGLE: the k draft positions run in one forward. Position 0 is EAGLE-3's step 0 (the token after
    # the last verified one, the target's fused features); positions 1..k-1 read ``mask_token_id``'s
    # embedding and ``mask_hidden`` (a learned [1, n_aux·H_t] stand-in for the target's aux states, fused
    # by fc like them). vLLM serves it with ``parallel_drafting: true`` in the speculative config.
    parallel_drafting: bool = False
    # The target's token id the positions not yet drafted read (config.json ``mask_token_id``, which
    # vLLM's proposer reads); None unless parallel_drafting. Its embedding is the target's (shared).
    mask_token_id: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self):
        # vLLM feeds the draft the target's embedding (no embed_tokens in the checkpoint) and asserts
        # that hidden states and embeddings have the same width (llama_eagle3.py, LlamaModel.forward).
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"draft hidden_size {self.hidden_size} must equal the target's {self.target_hidden_size}: "
                "the draft shares the target's token embedding"
            )
        if self.parallel_drafting and not (isinstance(self.mask_token_id, int) and 0 <= self.mask_token_id < self.target_vocab_size):
            raise ValueError(f"a parallel-drafting (P-EAGLE) draft needs a mask token id in the target's vocabulary "
                             f"[0, {self.target_vocab_size}), got {self.mask_token_id!r} (draft.mask_token_id)")

    @property
    def kind(self) -> str | None:
        """The ``KINDS`` name of this config's switches (None: a combination no kind names)."""
        return next((k for k, flags in KINDS.items() if all(getattr(self, f) == v for f, v in flags.items())), None)

    @classmethod
    def from_target(cls, info, draft_vocab_size: int, kind: str | None = None, **overrides):
        """Sizes default to the target's (``info``: its ``target.TargetFacts``); ``overrides`` win when not
        None; ``kind`` (a ``KINDS`` name; None: eagle3) sets the switches of that kind. A parallel kind's
        mask token defaults to the target's last id (``default_mask_token_id``); other kinds have none."""
        if (kind or "eagle3") not in KINDS:
            raise ValueError(f"unknown draft kind {kind!r}; known: {sorted(KINDS)}")
        cfg = {
            "hidden_size": info.hidden_size,
            "intermediate_size": info.intermediate_size,
            "num_attention_heads": info.num_attention_heads,
            "num_key_value_heads": info.num_key_value_heads,
            "head_dim": info.head_dim,
            "target_vocab_size": info.vocab_size,
            "draft_vocab_size": draft_vocab_size,
            "target_hidden_size": info.hidden_size,
            "num_aux_layers": len(info.aux_layers),
            "rms_norm_eps": info.rms_norm_eps,
            "rope_parameters": dict(info.rope_parameters),
            "max_position_embeddings": info.max_position_embeddings,
            **KINDS[kind or "eagle3"],
        }
        cfg.update({k: v for k, v in overrides.items() if v is not None})
        cfg["mask_token_id"] = (cfg.get("mask_token_id", default_mask_token_id(info.vocab_size))
                                if cfg["parallel_drafting"] else None)
        return cls(**cfg)

    def to_dict(self) -> dict:
        """The fields under their stored names (a checkpoint's ``draft_config``)."""
        return {STORED_AS.get(name, name): value for name, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, stored: dict):
        """The config ``to_dict`` wrote."""
        names = {key: name for name, key in STORED_AS.items()}
        return cls(**{names.get(key, key): value for key, value in stored.items()})


def default_mask_token_id(vocab_size: int) -> int:
    """The mask token of a P-EAGLE draft when draft.mask_token_id is null: the target's last id. Any id
    works (the masked positions also read the learned ``mask_hidden``, which tells them apart from a real
    token); the last one is an unused reserved or padding row in Llama-3's and Qwen's vocabularies."""
    return vocab_size - 1
