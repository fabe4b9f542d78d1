"""The target in transformers: loading it, its facts, its head, its auxiliary states, greedy decoding.

Used by hidden-state extraction (``hidden.extract_hidden``) and by the offline prediction
(``predict``). Layer ids are vLLM's (see ``vllm_format``): id ``i`` is the state entering decoder
layer ``i``, transformers' ``output_hidden_states[i]``.

``save_target_head`` writes what training needs of the target's head once, beside the shards:
``target_head.safetensors`` (``embed_tokens.weight``, ``lm_head.weight``, ``norm.weight``) and
``target_head.json`` (``TargetFacts``: sizes, rms eps, rope, layer count, aux layer ids), which
``TargetFacts.write`` writes and ``TargetFacts.read`` reads (the one pair that touches that file).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..settings import HiddenSettings
from ..vllm_facts import choose_aux_layers

HEAD_FORMAT = "eaglenest.target_head/1"


@dataclass(frozen=True)
class TargetFacts:
    """The target's facts that extraction, training and export need (``target_info``), kept beside the
    head as ``target_head.json``."""

    architectures: list[str]
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int
    aux_layers: list[int]  # vLLM layer ids (vllm_format): the state entering layer i
    last_hidden: str  # "post_norm": the shards' last_hidden is after the final norm
    target: str  # the target as transformers loaded it

    @staticmethod
    def json_path(head_path) -> Path:
        return Path(head_path).with_suffix(".json")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def write(self, head_path) -> None:
        """Write the facts beside ``head_path`` (target_head.safetensors -> target_head.json)."""
        self.json_path(head_path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def of(cls, config, aux_layers, target) -> "TargetFacts":
        """The facts of a transformers config (``target_info``) and the target's name or path."""
        return cls(**target_info(config, aux_layers), target=str(target))

    @classmethod
    def from_dict(cls, facts: dict, where: str, fix: str) -> "TargetFacts":
        """``to_dict``'s keys back, or an error naming ``where`` they came from and ``fix``."""
        names = {f.name for f in dataclasses.fields(cls)}
        if set(facts) != names:
            raise ValueError(f"{where} does not hold the target's facts this version writes (missing "
                             f"{sorted(names - set(facts))}, unknown {sorted(set(facts) - names)}): {fix}")
        return cls(**facts)

    @classmethod
    def read(cls, head_path) -> "TargetFacts":
        """The facts ``write`` left beside ``head_path``."""
        path = cls.json_path(head_path)
        return cls.from_dict(json.loads(path.read_text()), str(path), f"delete it and {Path(head_path).name}, and rerun "
                             "(rule save_target_head writes both again)")


def resolve_device(device="auto"):
    """'auto' -> 'cuda' when a GPU is present, else 'cpu'."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _torch_dtype(dtype, config=None):
    if dtype == "auto":
        return getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, dtype)


def load_target(target, *, device="auto", dtype="bfloat16"):
    """The target as a transformers CausalLM in eval mode; over several GPUs with device_map="auto"
    (which needs the ``accelerate`` package), else whole on one device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target)
    device = resolve_device(device)
    torch_dtype = _torch_dtype(dtype, config)
    if device == "cuda" and torch.cuda.device_count() > 1:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype, device_map="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype).to(device)
    return model.eval()


def decoder_of(model):
    """The model's decoder stack (``.layers``, ``.norm``): runs without the lm_head."""
    decoder = model.get_decoder()
    if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise ValueError(
            f"{type(model).__name__}: its decoder ({type(decoder).__name__}) has no .layers/.norm; "
            "eaglenest knows Llama-style decoders only"
        )
    return decoder


def target_info(config, aux_layers=None) -> dict:
    """The facts about the target that training and export need (from its transformers config)."""
    text = config.get_text_config()
    num_layers = text.num_hidden_layers
    aux = choose_aux_layers(num_layers, aux_layers, getattr(config, "architectures", None) or (), text.model_type)
    heads = text.num_attention_heads
    return {
        "architectures": list(getattr(config, "architectures", None) or []),
        "model_type": text.model_type,
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "vocab_size": text.vocab_size,
        "rms_norm_eps": text.rms_norm_eps,
        "rope_parameters": dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        "max_position_embeddings": text.max_position_embeddings,
        "aux_layers": list(aux),
        "last_hidden": "post_norm",
    }


# ----------------------------------------------------------------------------- the head


def _checkpoint_files(target):
    """``name -> local Path or None`` for one file of the target's checkpoint: from its directory, or
    for a hub name only the files asked for (the index and the shards that hold the head: a few GB
    of a 1T-parameter target, not all of it), through the Hugging Face cache."""
    root = Path(target).expanduser()
    if root.is_dir():
        return lambda name: (root / name) if (root / name).is_file() else None

    def from_hub(name):
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

        try:
            return Path(hf_hub_download(str(target), name))
        except (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError):
            return None

    return from_hub


# Tensors of a multimodal wrapper's other towers, never the language model's head.
NOT_TEXT = ("vision", "visual", "mm_projector", "multi_modal", "audio", "image")


def head_tensor_names(names, tied: bool) -> dict | None:
    """``{embed_tokens.weight, lm_head.weight, norm.weight: checkpoint name}`` among a checkpoint's tensor
    ``names``, or None where one is missing. The language model's own, whatever wraps it (``model.``,
    ``language_model.model.`` in a multimodal wrapper such as Kimi-K2.5): the shortest name with that
    ending, outside other towers and decoder layers (DeepSeek-V3's MTP layer has its own embedding and
    norm). ``tied``: the text config's tie_word_embeddings; then a missing lm_head is the embedding."""
    def pick(ending, in_layers=False):
        found = [n for n in names if (n == ending or n.endswith("." + ending))
                 and not any(t in n for t in NOT_TEXT) and (in_layers or ".layers." not in n)]
        return min(found, key=len) if found else None

    out = {"embed_tokens.weight": pick("embed_tokens.weight"), "norm.weight": pick("norm.weight"),
           "lm_head.weight": pick("lm_head.weight")}
    if out["lm_head.weight"] is None and tied:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out if all(out.values()) else None


def _head_weights_from_checkpoint(target, config):
    """The three head tensors read straight from the target's safetensors checkpoint, or None.

    Found by name in the checkpoint's index (``head_tensor_names``) and checked against the text
    config's sizes; nothing else of the target is read or built, so this costs seconds even for a
    1T-parameter target, and needs no model class for its config (transformers 5.19 has none that
    AutoModelForCausalLM takes for Kimi-K2.5's).
    """
    from safetensors import safe_open

    fetch = _checkpoint_files(target)
    index = fetch("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (single := fetch("model.safetensors")) is not None:
        with safe_open(str(single), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        return None
    text = config.get_text_config()
    tied = bool(getattr(text, "tie_word_embeddings", False))  # the language model's own flag, not a wrapper's default
    names = head_tensor_names(list(weight_map), tied)
    if names is None:
        return None
    shapes = {"embed_tokens.weight": (text.vocab_size, text.hidden_size), "lm_head.weight": (text.vocab_size, text.hidden_size),
              "norm.weight": (text.hidden_size,)}
    weights = {}
    for key, name in names.items():
        with safe_open(str(fetch(weight_map[name])), framework="pt") as f:
            weights[key] = f.get_tensor(name)
        if tuple(weights[key].shape) != shapes[key]:
            return None  # not the tensor we took it for (or a packed/quantized one): load the model instead
    return weights


def save_target_head(head_path, settings: HiddenSettings | None = None, *, model=None) -> TargetFacts:
    """Save embed_tokens / lm_head / final-norm weights and the target's facts, once per target.

    ``settings``: the target (``settings.target``) and its aux layers (None: the schema's defaults).
    Writes ``head_path`` (safetensors) and its ``TargetFacts`` beside it; returns the facts.
    The weights come from ``model`` when given, else straight from the target's safetensors files,
    else (unusual tensor names) from loading the whole target on CPU, with hidden.backend transformers
    (which loads it anyway); otherwise that is refused with the names it lacks.
    """
    from transformers import AutoConfig

    settings = settings or HiddenSettings.defaults()
    target, allow_load = settings.target, settings.backend == "transformers"
    config = model.config if model is not None else AutoConfig.from_pretrained(target)
    facts = TargetFacts.of(config, settings.aux_layers, target)
    weights = None if model is not None else _head_weights_from_checkpoint(target, config)
    if weights is None and model is None and not allow_load:
        raise ValueError(f"{target}: no safetensors checkpoint with the language model's embed_tokens, norm and lm_head "
                         f"tensors of the text config's sizes (vocabulary {facts.vocab_size}, hidden {facts.hidden_size}) "
                         "was found, and hidden.backend vllm does not load the whole target into transformers; "
                         "check the checkpoint's model.safetensors.index.json, or use hidden.backend transformers")
    if weights is None:
        model = model if model is not None else load_target(target, device="cpu", dtype="auto")
        weights = {
            "embed_tokens.weight": model.get_input_embeddings().weight,
            "lm_head.weight": model.get_output_embeddings().weight,
            "norm.weight": decoder_of(model).norm.weight,
        }
    weights = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    if weights["lm_head.weight"].data_ptr() == weights["embed_tokens.weight"].data_ptr():
        # a tied target's head is its embedding: safetensors refuses two names for one storage (on CUDA the
        # copy to the CPU made two already)
        weights["lm_head.weight"] = weights["lm_head.weight"].clone()
    from ..util import save_safetensors

    save_safetensors(weights, head_path, {"format": HEAD_FORMAT})
    facts.write(head_path)
    return facts


def load_target_head(head_path, device="cpu") -> tuple[dict, TargetFacts]:
    """``(tensors, facts)`` saved by ``save_target_head``."""
    from safetensors.torch import load_file

    return load_file(str(head_path), device=str(device)), TargetFacts.read(head_path)


# ----------------------------------------------------------------------------- running it


class AuxCapture:
    """Forward hooks that record the residual stream at the given vLLM ids (see vllm_format)."""

    def __init__(self, decoder, aux_layers):
        self.states, self.handles = {}, []
        layers = decoder.layers
        for i in aux_layers:
            if i == 0:  # the state entering layer 0: the embeddings
                self.handles.append(layers[0].register_forward_pre_hook(self._pre_hook(0), with_kwargs=True))
            else:  # id i = the output of layer i-1
                self.handles.append(layers[i - 1].register_forward_hook(self._hook(i)))

    def _pre_hook(self, i):
        def hook(module, args, kwargs):
            self.states[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _hook(self, i):
        def hook(module, args, output):
            self.states[i] = output[0] if isinstance(output, tuple) else output

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def greedy_next(last, head, max_elements=2**27):
    """The target's greedy choice from each post-norm last state ``last`` [N, H]: the argmax of
    ``last @ head.T`` (int64 [N], on ``head``'s device), the logits made ``max_elements // vocab``
    rows at a time so that they stay bounded whatever the vocabulary."""
    last = last.to(head.device, head.dtype)
    rows = max(1, max_elements // head.shape[0])
    if len(last) == 0:
        return torch.zeros(0, dtype=torch.int64, device=head.device)
    return torch.cat([(last[s : s + rows] @ head.T).argmax(-1) for s in range(0, len(last), rows)])


@torch.no_grad()
def target_states(model, tokens, aux_layers, extra: int = 0):
    """The target over one sequence: its aux states at vLLM ids ``aux_layers`` [T, 3*H], its greedy
    choice at every position [T] (the token it would put next), and its greedy continuation of
    ``extra`` tokens past the end (eos or not: what vLLM's verifier sees after a drafted eos)."""
    decoder = decoder_of(model)
    dev = model.get_input_embeddings().weight.device
    head = model.get_output_embeddings().weight
    capture = AuxCapture(decoder, aux_layers)
    try:
        out = decoder(input_ids=torch.tensor([tokens], device=dev), use_cache=extra > 1)
        aux = torch.cat([capture.states[i][0] for i in aux_layers], dim=-1)
    finally:
        capture.remove()
    argmax = greedy_next(out.last_hidden_state[0], head)
    tail = [int(argmax[-1])] if extra else []
    past = out.past_key_values
    while len(tail) < extra:
        out = decoder(input_ids=torch.tensor([[tail[-1]]], device=dev), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tail.append(int((out.last_hidden_state[0, -1] @ head.T).argmax()))
    return aux, argmax.cpu(), tail


def greedy_sequences(model, tokenizer, prompts, max_tokens, chat_template_kwargs=None):
    """``(prompt_ids, completion_ids)`` of the target's greedy answer to each prompt (transformers,
    one prompt at a time: no padding that could change the numbers). Stops at eos, as vLLM does."""
    dev = model.get_input_embeddings().weight.device
    eos = model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else (eos or [])) | ({tokenizer.eos_token_id} - {None})
    out = []
    for p in prompts:
        ids = chat_prompt_ids(tokenizer, p["messages"], chat_template_kwargs)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids], device=dev), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                                 do_sample=False, max_new_tokens=max_tokens, eos_token_id=sorted(eos),
                                 pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sorted(eos)[0])
        completion = gen[0, len(ids):].tolist()
        for i, t in enumerate(completion):
            if t in eos:
                completion = completion[: i + 1]
                break
        out.append((ids, completion))
    return out


def chat_prompt_ids(tokenizer, messages, chat_template_kwargs=None) -> list[int]:
    """The prompt tokens of a chat, as vLLM's chat endpoint makes them (generation prompt added)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **(chat_template_kwargs or {}))
    return list(ids)


