"""Export of a draft in vLLM's EAGLE-3 format and in the speculators format, from the same weights.

Each directory holds ``config.json`` + ``model.safetensors`` + a ``README.md`` model card with
Hugging Face front matter. The config keys, tensor names and shapes, and the ``d2t`` convention of
both formats are vLLM's facts, kept in ``vllm_format`` (validation reads the exports back through the
same module). Validation adds its figures to the card later (``validation.card``).
"""

import json
from pathlib import Path


from ..settings import ExportSettings
from ..util import is_local_path, save_safetensors, say
from .config import DraftConfig
from .dflash import KIND as DFLASH
from .dflash_format import write_dflash_draft
from .vllm_format import (draft_config_from_json, draft_config_json, flat_config, format_tensors, is_speculators,
                          method_of, serve_line, speculators_config_json, verifier_of, vllm_tensors)


def front_matter(config, card) -> str:
    """The Hugging Face model card metadata (YAML between ``---`` lines)."""
    target = card.get("target")
    tags = ["eagle3", "speculative-decoding", "eaglenest"] + (["speculators"] if is_speculators(config) else [])
    tags += ["p-eagle"] if draft_config_from_json(config).parallel_drafting else []
    lines = ["---"]
    if target:
        lines.append(f"base_model: {json.dumps(str(target))}")
    lines += ["library_name: vllm", "tags:"] + [f"- {t}" for t in tags]
    dataset = card.get("dataset")
    if dataset and not is_local_path(dataset):  # the hub wants dataset ids, not local paths
        lines += ["datasets:", f"- {json.dumps(str(dataset))}"]
    license_ = card.get("license")
    lines.append(f"license: {license_}" if license_ else
                 "license: other  # set export.license: the target's license usually binds its draft")
    return "\n".join(lines + ["---", ""])


# The card's title and default description by ``vllm_format.method_of`` the draft.
CARD_TITLES = {
    "eagle3": ("EAGLE-3", "A one-layer EAGLE-3 speculative-decoding draft made by eaglenest."),
    "peagle": ("P-EAGLE", "A one-layer P-EAGLE speculative-decoding draft made by eaglenest: it drafts all its "
                          "tokens in one forward pass (vLLM's parallel drafting)."),
}


def model_card(config, info, card, train=None, k=3) -> str:
    """README.md: front matter, what the draft is for, how it was made, how to serve it."""
    card = dict(card or {})
    target = card.get("target", info.target)
    flat = flat_config(config)
    fmt = "speculators" if is_speculators(config) else "vllm"
    method = method_of(config)
    name, about = CARD_TITLES[method]
    lines = [
        front_matter(config, {**card, "target": target}),
        f"# {name} draft for {target}" + (" (speculators format)" if fmt == "speculators" else ""),
        "",
        card.get("description", about),
        "",
        "| | |",
        "|---|---|",
        f"| target | {target} ({info.num_hidden_layers} layers, hidden {info.hidden_size}) |",
        f"| format | {fmt} |",
        f"| auxiliary layers (vLLM ids) | {flat['eagle_aux_hidden_state_layer_ids']} |",
        f"| draft vocabulary | {flat['draft_vocab_size']} of {flat['vocab_size']} tokens |",
        f"| draft size | hidden {flat['hidden_size']}, intermediate {flat['intermediate_size']}, "
        f"{flat['num_attention_heads']} heads / {flat['num_key_value_heads']} kv |",
        f"| dtype | {flat['dtype']} |",
    ]
    if method == "peagle":
        lines.append(f"| mask token (positions not yet drafted) | {draft_config_from_json(config).mask_token_id} |")
    for key, value in card.items():
        if key not in ("target", "description", "license"):
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
    lines += ["", "Serve with vLLM:", "", "```", serve_line(fmt, target, k, verifier=verifier_of(config), method=method), "```", ""]
    if fmt == "speculators":
        lines += [f"vLLM starts the verifier named in config.json (`{verifier_of(config)}`) with this draft "
                  "attached; publish it with the verifier's hub name there.", ""]
        if is_local_path(verifier_of(config)):
            lines += [f"`{verifier_of(config)}` is a local path: vLLM 0.33 and later refuse it in `vllm serve "
                      "THIS_DIR` (\"Speculators verifier must name a remote model repository\"), hence the "
                      "command above; export again with `export.verifier` set to the hub name before publishing.", ""]
    return "\n".join(lines)


def write_draft(out_dir, cfg: DraftConfig, info, state_dict, card, train, dtype, *, fmt="vllm", verifier=None, k=3):
    """One draft directory in ``fmt`` (``vllm`` or ``speculators``; the latter names ``verifier``)."""
    out_dir = Path(out_dir)
    tensors = vllm_tensors(state_dict, cfg, dtype)
    if fmt == "speculators":
        config = speculators_config_json(cfg, info.aux_layers, verifier=verifier or info.target, k=k,
                                         dtype=dtype, verifier_architectures=info.architectures)
    else:
        config = draft_config_json(cfg, info.aux_layers, dtype)
    save_safetensors(format_tensors(tensors, fmt), out_dir / "model.safetensors", {"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "README.md").write_text(model_card(config, info, card, train, k))
    say(f"export: {'trained' if train else 'untrained'} draft, {fmt} format -> {out_dir}")
    if fmt == "speculators" and is_local_path(verifier_of(config)):
        say(f"export: the speculators draft names the local verifier {verifier_of(config)!r}; vLLM 0.33 and later "
            "refuse a local path in `vllm serve <draft dir>`: set export.verifier to the target's hub name "
            "(e.g. meta-llama/Llama-3.1-8B-Instruct) before publishing")
    return config


def export_draft(checkpoint_path, out_dir=None, settings: ExportSettings | None = None, *, speculators_dir=None,
                 card=None, dtype="bfloat16") -> dict:
    """Export a ``train_draft`` checkpoint (which carries the draft config, the target facts and the
    vocabulary maps) to ``out_dir`` in vLLM's format and/or to ``speculators_dir`` in the speculators
    format (``settings.verifier``; ``settings.k`` speculative tokens; None: the schema's defaults);
    ``card`` adds rows and front matter (``target``, ``dataset``, ``license``) to the model cards.
    Returns the config written last."""
    from .checkpoint import load_checkpoint

    settings = settings or ExportSettings.defaults()
    verifier, k = settings.verifier, settings.k

    tensors, cfg, info, train = load_checkpoint(checkpoint_path)
    if cfg.kind == DFLASH:
        return export_dflash(tensors, cfg, info, train, out_dir, speculators_dir, card, dtype)
    config = None
    for fmt, path in (("vllm", out_dir), ("speculators", speculators_dir)):
        if path is not None:
            config = write_draft(path, cfg, info, tensors, card, train, dtype, fmt=fmt, verifier=verifier, k=k)
    if config is None:
        raise ValueError("export_draft: give out_dir, speculators_dir or both")
    return config


def export_dflash(tensors, cfg, info, train, out_dir, speculators_dir, card, dtype) -> dict:
    """A DFlash checkpoint's export: vLLM's format only (z-lab's, ``dflash_format``)."""
    if speculators_dir is not None:
        raise ValueError("export.format: a DFlash draft is exported in vLLM's format only; set export.format: vllm")
    if out_dir is None:
        raise ValueError("export_draft: a DFlash draft needs out_dir")
    return write_dflash_draft(out_dir, cfg, info, tensors, card, train, dtype)


def load_exported(out_dir):
    """``(config, tensors)`` of an exported draft directory."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    return json.loads((out_dir / "config.json").read_text()), load_file(str(out_dir / "model.safetensors"))
