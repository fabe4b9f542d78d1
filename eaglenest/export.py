"""Export of a draft in vLLM's EAGLE-3 format.

``out_dir/config.json`` + ``out_dir/model.safetensors`` + a short ``README.md``. The config keys,
tensor names and shapes, and the ``d2t`` convention are vLLM's facts, kept in ``vllm_format``
(validation reads the export back through the same module).
"""

import json
from pathlib import Path

import torch

from .util import save_safetensors, say
from .model import DraftConfig, Eagle3Draft
from .vllm_format import draft_config_json, speculative_config, vllm_tensors


def model_card(config, info, card, train=None) -> str:
    """A short README.md: what the draft is for, how it was made, how to serve it."""
    card = card or {}
    serve_spec = json.dumps({**speculative_config("eagle3", 3, "."), "model": "THIS_DIR"}, separators=(",", ":"))
    lines = [
        f"# EAGLE-3 draft for {card.get('target', info.get('target', 'the target'))}",
        "",
        card.get("description", "A one-layer EAGLE-3 speculative-decoding draft made by eaglenest."),
        "",
        "| | |",
        "|---|---|",
        f"| target | {card.get('target', info.get('target', '?'))} ({info.get('num_hidden_layers')} layers, hidden {info.get('hidden_size')}) |",
        f"| auxiliary layers (vLLM ids) | {config['eagle_aux_hidden_state_layer_ids']} |",
        f"| draft vocabulary | {config['draft_vocab_size']} of {config['vocab_size']} tokens |",
        f"| draft size | hidden {config['hidden_size']}, intermediate {config['intermediate_size']}, {config['num_attention_heads']} heads / {config['num_key_value_heads']} kv |",
        f"| dtype | {config['dtype']} |",
    ]
    for key, value in card.items():
        if key not in ("target", "description"):
            lines.append(f"| {key} | {value} |")
    if train:
        acc = ", ".join(f"{a:.3f}" for a in train.get("acc", []))
        lines += [
            f"| training | {train.get('steps')} steps, {train.get('tokens')} tokens, {train.get('seconds')} s, "
            f"{train.get('sequences')} sequences |",
            f"| final loss | {train.get('loss', float('nan')):.4f} |",
            f"| top-1 accuracy per TTT step | {acc} |",
        ]
    else:
        lines.append("| training | none: randomly initialised (a baseline) |")
    lines += [
        "",
        "Serve with vLLM:",
        "",
        "```",
        f"vllm serve {card.get('target', info.get('target', 'TARGET'))} --speculative-config '{serve_spec}'",
        "```",
        "",
    ]
    return "\n".join(lines)


def write_draft(out_dir, cfg: DraftConfig, info, state_dict, card, train, dtype):
    out_dir = Path(out_dir)
    config = draft_config_json(cfg, info["aux_layers"], dtype)
    save_safetensors(vllm_tensors(state_dict, cfg, dtype), out_dir / "model.safetensors", {"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "README.md").write_text(model_card(config, info, card, train))
    say(f"export: {'trained' if train else 'untrained'} draft, {len(config)} config keys -> {out_dir}")
    return config


def export_draft(checkpoint_path, out_dir, *, card=None, dtype="bfloat16") -> dict:
    """Export a ``train_draft`` checkpoint (which carries the draft config, the target facts and the
    vocabulary maps) to ``out_dir``; ``card`` adds rows to the model card. Returns the config."""
    from .train import load_checkpoint

    tensors, cfg, info, train = load_checkpoint(checkpoint_path)
    return write_draft(out_dir, cfg, info, tensors, card, train, dtype)


def export_untrained(vocab_path, head_path, out_dir, *, config=None, seed=0, card=None, dtype="bfloat16") -> dict:
    """Export a randomly initialised draft of the shape ``train_draft`` would make with ``config``
    (the training config dict): the baseline of the acceptance test. Returns the config."""
    from .target import load_target_head
    from .train import draft_config, resolve_config
    from .vocab import load_vocab

    head, info = load_target_head(head_path)
    d2t, t2d = load_vocab(vocab_path)
    cfg = draft_config(info, len(d2t), resolve_config(config))
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    model.set_target(head["embed_tokens.weight"], d2t, t2d)
    return write_draft(out_dir, cfg, info, model.state_dict(), card, None, dtype)


def load_exported(out_dir):
    """``(config, tensors)`` of an exported draft directory."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    return json.loads((out_dir / "config.json").read_text()), load_file(str(out_dir / "model.safetensors"))
