"""The DFlash draft directory as vLLM 0.32 loads it with ``method: dflash`` (z-lab's format): what export
writes and validation reads back, from the same code. The EAGLE-3 formats are ``vllm_format``.

What ``config.json`` carries and why (vLLM 0.32):

- ``architectures: ["DFlashDraftModel"]`` selects ``DFlashQwen3ForCausalLM`` (``model_executor/models/
  registry.py``); ``model_type: qwen3`` makes transformers parse the rest as a ``Qwen3Config``, which
  ``SpeculativeConfig`` wraps in an ``EAGLEConfig`` for method dflash. The target may be any model vLLM
  can capture auxiliary states from (``SupportsEagle3``): the Qwen3 is the draft's own layers.
- ``dflash_config.target_layer_ids``: the target layers read, in DFlash's counting (vLLM's ids minus one,
  ``vllm_facts.dflash_target_layer_ids``); their states, concatenated in that order, are ``fc``'s input.
- ``dflash_config.mask_token_id``: the id vLLM puts in the mask slots (``v1/spec_decode/llm_base_proposer.py``).
- ``dflash_config.causal: false``: the block attends to itself both ways (``qwen3_dflash.py``,
  ``_dflash_layer_causal``; absent, it would follow ``layer_types``, all full attention here: the same).
- ``block_size`` (top level, as z-lab writes it, and in ``dflash_config``): what the draft was trained for;
  vLLM 0.32 does not read it: the served block is ``num_speculative_tokens`` + 1 slots.
- ``draft_vocab_size`` sizes ``lm_head``; as for EAGLE-3, ``d2t`` is loaded into ``draft_id_to_target_id``
  only where it is smaller than ``vocab_size`` (the target's), and ``t2d`` is skipped.
- no ``embed_tokens.weight``: vLLM shares the target's embedding with the draft.

Beside it, ``mask_embedding.pt`` (``{"mask_token_id": id, "embedding": [H]}``): the mask slots' trained input,
which vLLM loads from the draft directory and puts wherever the input id is the mask token
(``DFlashQwen3ForCausalLM._read_mask_embedding``).
"""

import json
from pathlib import Path

import torch

from ..util import save_safetensors, say
from ..vllm_facts import aux_layers_of_dflash, dflash_target_layer_ids, speculative_config
from .dflash import DFlashConfig
from .vllm_format import decoder_keys

ARCHITECTURE = "DFlashDraftModel"
MODEL_TYPE = "qwen3"
MASK_EMBEDDING_FILE = "mask_embedding.pt"
METHOD = "dflash"  # --speculative-config's method


def speculative_tokens(cfg: DFlashConfig) -> int:
    """``num_speculative_tokens`` the draft was trained for: its block less the anchor."""
    return cfg.block_size - 1


def tensor_shapes(cfg: DFlashConfig) -> dict:
    """Every tensor of ``model.safetensors`` (vLLM's names) and its shape; ``d2t`` only where the draft
    vocabulary is smaller than the target's."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"fc.weight": (H, cfg.num_aux_layers * cfg.target_hidden_size), "hidden_norm.weight": (H,),
              "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H), "t2d": (cfg.target_vocab_size,)}
    if cfg.draft_vocab_size != cfg.target_vocab_size:
        shapes["d2t"] = (cfg.draft_vocab_size,)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                       p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
    return shapes


def config_json(cfg: DFlashConfig, aux_layers, dtype="bfloat16", num_target_layers=None) -> dict:
    """config.json of an exported DFlash draft; ``aux_layers`` the vLLM ids it was trained on."""
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "num_hidden_layers": cfg.num_hidden_layers,
        **decoder_keys(cfg),
        "block_size": cfg.block_size,
        "dflash_config": {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": dflash_target_layer_ids(aux_layers), "causal": False},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if num_target_layers is not None:
        config["num_target_layers"] = num_target_layers  # z-lab's key; vLLM reads the target's own config
    return config


def config_from_json(config: dict) -> tuple[DFlashConfig, list[int]]:
    """The ``DFlashConfig`` of a DFlash draft's config.json and the vLLM ids vLLM captures for it."""
    dflash = config["dflash_config"]
    aux = aux_layers_of_dflash(dflash["target_layer_ids"])
    hidden = config["hidden_size"]
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config["rope_theta"]}
    cfg = DFlashConfig(
        hidden_size=hidden, intermediate_size=config["intermediate_size"], num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"], head_dim=config["head_dim"], target_vocab_size=config["vocab_size"],
        draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"], target_hidden_size=config.get("target_hidden_size", hidden),
        mask_token_id=dflash["mask_token_id"], num_hidden_layers=config["num_hidden_layers"],
        block_size=config.get("block_size") or dflash.get("block_size"), num_aux_layers=len(aux),
        rms_norm_eps=config["rms_norm_eps"], rope_parameters=rope, max_position_embeddings=config["max_position_embeddings"])
    return cfg, aux


def vllm_tensors(state_dict, cfg: DFlashConfig, dtype="bfloat16") -> tuple[dict, torch.Tensor]:
    """``(tensors, mask_embedding)`` of a ``DFlashDraft`` state dict as vLLM loads them: float tensors in
    ``dtype``, d2t int64, t2d bool; ``model.safetensors``' tensors and ``mask_embedding.pt``'s [H]."""
    state = dict(state_dict)
    mask = state.pop("mask_embedding")
    shapes = tensor_shapes(cfg)
    if cfg.draft_vocab_size == cfg.target_vocab_size:
        if state["d2t"].any():
            raise ValueError("a draft vocabulary as large as the target's must be the identity (d2t all zero)")
        del state["d2t"]  # vLLM then has no draft_id_to_target_id and would refuse it (qwen3_dflash.py)
    if set(state) != set(shapes):
        raise ValueError(f"draft tensors {sorted(set(state) ^ set(shapes))} do not match vLLM's DFlash names")
    out = {}
    for name, t in state.items():
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, vLLM expects {shapes[name]}")
        out[name] = t.detach().to("cpu", getattr(torch, dtype) if t.is_floating_point() else t.dtype).contiguous()
    return out, mask.detach().to("cpu", getattr(torch, dtype)).contiguous()


def serve_line(target, k, draft_dir="THIS_DIR") -> str:
    spec = json.dumps({**speculative_config(METHOD, k, "."), "model": str(draft_dir)}, separators=(",", ":"))
    return f"vllm serve {target} --speculative-config '{spec}'"


def model_card(config: dict, info, card, train) -> str:
    """README.md: front matter, what the draft is, how it was made, how to serve it."""
    card = dict(card or {})
    target = card.get("target", info.target)
    license_ = card.get("license")
    k = config["block_size"] - 1
    lines = ["---", f"base_model: {json.dumps(str(target))}", "library_name: vllm", "tags:", "- dflash",
             "- speculative-decoding", "- eaglenest",
             f"license: {license_}" if license_ else "license: other  # set export.license: the target's license usually binds its draft",
             "---", "", f"# DFlash draft for {target}", "",
             f"A {config['num_hidden_layers']}-layer DFlash draft made by eaglenest: it fills {k} tokens in one forward.", "",
             "| | |", "|---|---|",
             f"| target | {target} ({info.num_hidden_layers} layers, hidden {info.hidden_size}) |",
             f"| target layers | vLLM ids {list(info.aux_layers)} (dflash_config.target_layer_ids "
             f"{config['dflash_config']['target_layer_ids']}) |",
             f"| block | {config['block_size']} slots: the last token, {k} masks (mask token {config['dflash_config']['mask_token_id']}) |",
             f"| draft vocabulary | {config['draft_vocab_size']} of {config['vocab_size']} tokens |",
             f"| dtype | {config['dtype']} |"]
    lines += [f"| {key} | {value} |" for key, value in card.items() if key not in ("target", "license") and value]
    if train:
        acc = ", ".join(f"{a:.3f}" for a in train.get("acc", []))
        lines += [f"| training | {train.get('steps')} steps, {train.get('tokens')} tokens, {train.get('seconds')} s |",
                  f"| top-1 accuracy per block slot | {acc} |"]
    return "\n".join(lines + ["", "Serve with vLLM:", "", "```", serve_line(target, k), "```", ""])


def write_dflash_draft(out_dir, cfg: DFlashConfig, info, state_dict, card=None, train=None, dtype="bfloat16") -> dict:
    """A DFlash draft directory: config.json, model.safetensors, mask_embedding.pt, README.md -> the config."""
    out_dir = Path(out_dir)
    tensors, mask = vllm_tensors(state_dict, cfg, dtype)
    config = config_json(cfg, info.aux_layers, dtype, info.num_hidden_layers)
    save_safetensors(tensors, out_dir / "model.safetensors", {"format": "pt"})
    torch.save({"mask_token_id": cfg.mask_token_id, "embedding": mask}, out_dir / MASK_EMBEDDING_FILE)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "README.md").write_text(model_card(config, info, card, train))
    say(f"export: {'trained' if train else 'untrained'} DFlash draft, block {cfg.block_size} -> {out_dir}")
    return config


def load_dflash_draft(out_dir, embed_weight):
    """``(DFlashDraft, aux_layers)`` of an exported directory, as vLLM loads it, with the target's
    embedding ``embed_weight`` installed."""
    from safetensors.torch import load_file

    from .dflash import DFlashDraft

    out_dir = Path(out_dir)
    cfg, aux = config_from_json(json.loads((out_dir / "config.json").read_text()))
    state = load_file(str(out_dir / "model.safetensors"))
    state.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
    state["mask_embedding"] = torch.load(out_dir / MASK_EMBEDDING_FILE, weights_only=True)["embedding"]
    model = DFlashDraft(cfg)
    model.embed_weight = embed_weight.detach().clone()
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return model.eval(), aux
