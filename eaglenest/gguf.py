"""A target that arrives as one GGUF file (quantized, llama.cpp's format), converted once to the Hugging Face
directory vLLM and transformers load: config.json, the tokenizer with its chat template, and the weights
dequantized into safetensors.

transformers reads GGUF (with the ``gguf`` package): the config, the tokenizer and the tensors, q/k
permuted back to its own layout. Its GGUF-loaded model cannot be saved, so the tensors are taken from
its loader and written here. A tied lm_head is not a tensor of the file; config.json keeps
``tie_word_embeddings``, as the original checkpoint has it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError
from .util import say

SUFFIX = ".gguf"
MODELS_DIR = "models"  # converted targets, under the working directory


def is_gguf(model) -> bool:
    """Whether ``model`` (server.model) names a GGUF file rather than a directory or a hub name."""
    return isinstance(model, str) and model.lower().endswith(SUFFIX)


def converted_dir(gguf_path: str) -> str:
    """Where the conversion of ``gguf_path`` goes: ``models/<file name without .gguf>``."""
    return str(Path(MODELS_DIR) / Path(gguf_path).name[: -len(SUFFIX)])


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16") -> dict:
    """Write the Hugging Face directory of the GGUF file at ``gguf_path`` into ``out_dir``; return its facts."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src, out = Path(gguf_path), Path(out_dir)
    if not src.is_file():
        raise ConfigError(f"server.model: the GGUF file {src} does not exist")
    try:
        config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    except Exception as e:  # noqa: BLE001 -- the gguf reader's errors are many; the file is the user's to check
        raise ConfigError(f"server.model: transformers cannot read {src} as a GGUF model: {e}") from e
    with torch.device("meta"):  # the layout the loader maps GGUF names and shapes onto; no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    say(f"gguf: {src.name}: {config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"vocabulary {config.vocab_size}; dequantizing to {dtype}")
    tensors = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=skeleton)["tensors"]
    missing = sorted(set(skeleton.state_dict()) - set(tensors) - _tied(config))
    if missing:
        raise ConfigError(f"server.model: {src} lacks tensors the {config.model_type} model needs: "
                          f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    torch_dtype = getattr(torch, dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch_dtype).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config.dtype = torch_dtype
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"model_type": config.model_type, "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "tied": bool(getattr(config, "tie_word_embeddings", False)),
            "tensors": len(tensors), "chat_template": bool(tokenizer.chat_template)}


def _tied(config) -> set:
    return {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
