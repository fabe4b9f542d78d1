"""An untrained EAGLE-3 draft of the test states' target, exported in vLLM's format: what validation's tests
serve (vLLM faked) where the draft's weights do not matter, and what the export test compares a trained
draft's shape with."""


def export_untrained(vocab_path, head_path, out_dir, *, seed=0, dtype="bfloat16") -> dict:
    """Export a randomly initialised draft of the shape ``train_draft`` makes with the schema's defaults
    (the target head and vocabulary of ``head_path`` and ``vocab_path``) to ``out_dir``; returns its config."""
    import torch

    from eaglenest.draft.checkpoint import draft_config
    from eaglenest.draft.export import write_draft
    from eaglenest.draft.model import Eagle3Draft
    from eaglenest.draft.vocab import load_vocab
    from eaglenest.settings import DraftSettings
    from eaglenest.states.target import load_target_head

    head, info = load_target_head(head_path)
    d2t, t2d = load_vocab(vocab_path)
    cfg = draft_config(info, len(d2t), DraftSettings.defaults())
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    model.set_target(head["embed_tokens.weight"], d2t, t2d)
    return write_draft(out_dir, cfg, info, model.state_dict(), None, None, dtype)
