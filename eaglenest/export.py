"""Export of a draft in vLLM's EAGLE-3 format: the one place for its tensor names and config keys.

``out_dir/config.json`` + ``out_dir/model.safetensors`` + a short ``README.md``. What vLLM 0.32
reads (``model_executor/models/llama_eagle3.py`` and the v1 model runner):

- ``architectures: ["LlamaForCausalLMEagle3"]`` selects ``Eagle3LlamaForCausalLM`` (registry.py);
  ``model_type: llama`` makes transformers parse the rest as a ``LlamaConfig``.
- ``eagle_aux_hidden_state_layer_ids`` (top level) tells the target which states to capture
  (``gpu_model_runner.py``, ``_get_eagle3_aux_layers_from_config``); without it vLLM uses its
  default, which for shallow targets collides (see layers.py).
- ``draft_vocab_size`` sizes ``lm_head``; when it differs from ``vocab_size`` vLLM builds
  ``draft_id_to_target_id`` and loads ``d2t`` into it; when they are equal it builds no such
  parameter and a ``d2t`` tensor would fail the load, so then ``d2t`` (all zeros) is left out.
  ``t2d`` is skipped by the loader; it is written for other tools.
- ``target_hidden_size`` (only when it differs from ``hidden_size``) sizes ``fc``'s input.
- ``norm_before_residual`` is written out: loaders disagree on its default.
- no ``embed_tokens.weight``: vLLM then shares the target's embedding with the draft.
"""

import json
from pathlib import Path

import torch

from .util import save_safetensors, say
from .model import DraftConfig, Eagle3Draft

ARCHITECTURE = "LlamaForCausalLMEagle3"


def tensor_shapes(cfg: DraftConfig) -> dict:
    """Name -> shape of every tensor vLLM's EAGLE-3 loader takes (d2t/t2d: see ``vllm_tensors``)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "fc.weight": (H, cfg.num_aux_layers * cfg.target_hidden_size),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def vllm_config(cfg: DraftConfig, aux_layers, dtype="bfloat16") -> dict:
    """config.json of the exported draft."""
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": dict(cfg.rope_parameters),
        "rope_theta": cfg.rope_parameters.get("rope_theta"),  # for readers older than transformers 5
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "norm_before_residual": cfg.norm_before_residual,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": dtype,
        "torch_dtype": dtype,  # the pre-transformers-5 name of "dtype"
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    return config


def vllm_tensors(state_dict, cfg: DraftConfig, dtype="bfloat16") -> dict:
    """The draft's state dict as vLLM loads it: float tensors in ``dtype``, d2t int64, t2d bool."""
    shapes = tensor_shapes(cfg)
    if set(state_dict) != set(shapes):
        raise ValueError(f"draft tensors {sorted(set(state_dict) ^ set(shapes))} do not match vLLM's EAGLE-3 names")
    out = {}
    for name, t in state_dict.items():
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, vLLM expects {shapes[name]}")
        out[name] = t.detach().to("cpu", getattr(torch, dtype) if t.is_floating_point() else t.dtype).contiguous()
    if cfg.draft_vocab_size == cfg.vocab_size:
        if out["d2t"].any():
            raise ValueError("a draft vocabulary as large as the target's must be the identity (d2t all zero)")
        del out["d2t"]  # vLLM has no draft_id_to_target_id then (llama_eagle3.py) and would refuse it
    return out


def model_card(config, info, card, train=None) -> str:
    """A short README.md: what the draft is for, how it was made, how to serve it."""
    card = card or {}
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
        f"vllm serve {card.get('target', info.get('target', 'TARGET'))} --speculative-config "
        "'{\"method\":\"eagle3\",\"model\":\"THIS_DIR\",\"num_speculative_tokens\":3}'",
        "```",
        "",
    ]
    return "\n".join(lines)


def _write(out_dir, cfg: DraftConfig, info, state_dict, card, train, dtype):
    out_dir = Path(out_dir)
    config = vllm_config(cfg, info["aux_layers"], dtype)
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
    return _write(out_dir, cfg, info, tensors, card, train, dtype)


def export_untrained(vocab_path, head_path, out_dir, *, config=None, seed=0, card=None, dtype="bfloat16") -> dict:
    """Export a randomly initialised draft of the shape ``train_draft`` would make with ``config``
    (the training config dict): the baseline of the acceptance test. Returns the config."""
    from .hidden import load_target_head
    from .train import draft_config, resolve_config
    from .vocab import load_vocab

    head, info = load_target_head(head_path)
    d2t, t2d = load_vocab(vocab_path)
    cfg = draft_config(info, len(d2t), resolve_config(config))
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    model.set_target(head["embed_tokens.weight"], d2t, t2d)
    return _write(out_dir, cfg, info, model.state_dict(), card, None, dtype)


def load_exported(out_dir):
    """``(config, tensors)`` of an exported draft directory."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    return json.loads((out_dir / "config.json").read_text()), load_file(str(out_dir / "model.safetensors"))
