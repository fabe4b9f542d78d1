"""The draft checkpoint in vLLM's EAGLE-3 format and in the speculators format: what export writes
and validation reads back, from the same code, so the two cannot drift (vLLM 0.32 to 0.34).

The layer-id convention, vLLM's releases and what it reads and writes as a server are
``eaglenest.vllm_facts``; this module holds what a draft directory carries.

What ``config.json`` carries and why:

- ``architectures: ["LlamaForCausalLMEagle3"]`` selects ``Eagle3LlamaForCausalLM`` (registry.py);
  ``model_type: llama`` makes transformers parse the rest as a ``LlamaConfig``.
- ``eagle_aux_hidden_state_layer_ids`` (top level) tells the target which states to capture
  (0.32/0.33: ``v1/worker/gpu_model_runner.py``, ``_get_eagle3_aux_layers_from_config``; 0.34, which
  removed that runner: ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``,
  ``get_eagle3_aux_layers_from_config``); without it vLLM uses its
  default (2, N//2, N-3), which for shallow targets collides.
- ``draft_vocab_size`` sizes ``lm_head``; when it differs from ``vocab_size`` vLLM builds
  ``draft_id_to_target_id`` and loads ``d2t`` into it; when they are equal it builds no such
  parameter and a ``d2t`` tensor would fail the load, so then ``d2t`` (all zeros) is left out.
  ``t2d`` is skipped by the loader; it is written for other tools.
- ``target_hidden_size`` (only when it differs from ``hidden_size``) sizes ``fc``'s input.
- ``norm_before_residual`` is written out: loaders disagree on its default (vLLM: absent = false).
- ``fc_norm`` and ``norm_output`` (``llama_eagle3.py``, ``LlamaModel``; absent = false) are written
  out, true for an EAGLE-3.1 draft: ``fc_norm`` builds one RMSNorm per aux layer (tensors
  ``fc_norm.{i}.weight`` [H_t]) applied to that layer's chunk of fc's input; ``norm_output`` feeds
  the next draft step the output after ``norm`` instead of the pre-norm sum.
- ``norm_before_fc`` (absent = false) is written out too: one RMSNorm (``input_norm.weight``
  [n_aux·H_t]) over fc's whole input, before fc_norm; speculators' trainer turns it on for EAGLE-3.
- no ``embed_tokens.weight``: vLLM then shares the target's embedding with the draft.
- a P-EAGLE draft (``parallel_drafting``) adds ``mask_token_id``, the token its masked positions read
  (``v1/spec_decode/llm_base_proposer.py``, ``_init_parallel_drafting_params``, takes the first of
  ``dflash_config.mask_token_id``, ``mask_token_id``, ``dspark_noise_token_id``, ``pard_token``,
  ``ptd_token_id``), and the tensor ``mask_hidden`` [1, n_aux·H_t] (``Eagle3LlamaForCausalLM.load_weights``
  copies it into a buffer of that shape, and refuses to start without it under parallel drafting; the
  proposer passes it through ``combine_hidden_states`` once). vLLM switches parallel drafting on from the
  speculative config (``"parallel_drafting": true``, ``vllm_facts.speculative_config("peagle", ...)``), not
  from config.json: the key ``parallel_drafting`` there is ours, read back by ``draft_config_from_json``.

The speculators format (vllm-project/speculators; NVIDIA ModelOpt's converter emits it too) holds the
same weights. vLLM 0.32 reads it in ``transformers_utils/configs/speculators/`` and
``transformers_utils/config.py`` (``maybe_override_with_speculators``):

- a ``config.json`` with ``speculators_config`` is a speculators model: ``vllm serve DIR`` serves the
  verifier ``speculators_config.verifier.name_or_path`` (resolved like any ``--model``: a local path,
  relative to the server's working directory, or a hub name) with DIR as its ``eagle3`` draft and
  ``proposal_methods[0].speculative_tokens`` as ``num_speculative_tokens``; required:
  ``speculators_model_type``, ``speculators_config.proposal_methods[0].speculative_tokens``,
  ``speculators_config.verifier.name_or_path`` and a ``transformer_layer_config`` dict;
- no top-level ``model_type``: vLLM then takes the config as ``speculators``, starts the draft's
  config from ``transformer_layer_config`` (a one-layer Llama config, ``vocab_size`` the target's)
  and adds ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` and
  ``norm_before_residual``, ``norm_before_fc``, ``fc_norm`` and ``norm_output`` from the top level,
  where ``norm_before_residual`` defaults to **True** (``algos.py``, ``update_eagle3``): each written
  out (so an EAGLE-3.1 draft is served as such in this format too);
- tensors: the decoder layer is ``layers.0.*`` (speculators' own name; vLLM's loader takes both that
  and ``midlayer.*``), everything else as above;
- a P-EAGLE draft is ``speculators_model_type: peagle`` with a top-level ``mask_token_id``: vLLM
  (``algos.py``, ``update_peagle``) maps it to ``PeagleLlamaForCausalLM`` (its ``Eagle3LlamaForCausalLM``)
  with ``pard_token`` = the mask token, and ``vllm serve DIR`` then drafts with ``method: eagle3`` and
  ``parallel_drafting: true`` (``base.py``, ``extract_vllm_speculative_config``). ``update_peagle`` reads
  ``norm_before_residual`` (absent: **false** there) and ``norm_before_fc``, but not ``fc_norm`` or
  ``norm_output``: such a draft has neither.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..util import is_local_path
from ..vllm_facts import (LOCAL_VERIFIER_REFUSED_FROM, NUM_AUX_LAYERS, default_aux_layers, speculative_config,
                          version_at_least)
from .config import DraftConfig

# ----------------------------------------------------------------------------- vocabulary maps


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id: ``d2t`` holds offsets, ``target_id = draft_id + d2t[draft_id]``."""
    return torch.arange(len(d2t), device=d2t.device) + d2t


def d2t_from_target_ids(target_ids: torch.Tensor) -> torch.Tensor:
    """``d2t`` offsets of the draft vocabulary ``target_ids`` (draft id = position in the list)."""
    return target_ids - torch.arange(len(target_ids), dtype=target_ids.dtype, device=target_ids.device)


# ----------------------------------------------------------------------------- the draft checkpoint

ARCHITECTURE = "LlamaForCausalLMEagle3"
# The draft's switches vLLM 0.32's llama_eagle3.py reads from config.json (DraftConfig fields of these names):
# written out in both formats, since their defaults differ between loaders.
SWITCHES = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

# A P-EAGLE draft's config.json keys (DraftConfig fields of these names): vLLM reads mask_token_id;
# parallel_drafting is ours (vLLM takes it from the speculative config).
PARALLEL_KEYS = ("parallel_drafting", "mask_token_id")
# The keys vLLM's proposer takes a parallel draft's mask token from (after dflash_config's), in its order.
MASK_TOKEN_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")

# What vLLM assumes for a config.json key that is absent (llama_eagle3.py, LlamaConfig defaults).
CONFIG_DEFAULTS = {
    "norm_before_residual": False,
    "norm_before_fc": False,
    "fc_norm": False,
    "norm_output": False,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
}


def tensor_shapes(cfg) -> dict:
    """Name -> shape of every tensor vLLM's EAGLE-3 loader takes (d2t/t2d: see ``vllm_tensors``);
    ``cfg`` a ``model.DraftConfig``. Module names in model.py are these names."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    fc_norm = {f"fc_norm.{i}.weight": (cfg.target_hidden_size,) for i in range(cfg.num_aux_layers)} if cfg.fc_norm else {}
    input_norm = {"input_norm.weight": (cfg.num_aux_layers * cfg.target_hidden_size,)} if cfg.norm_before_fc else {}
    mask = {"mask_hidden": (1, cfg.num_aux_layers * cfg.target_hidden_size)} if cfg.parallel_drafting else {}
    return {
        **mask,
        **input_norm,
        **fc_norm,
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
        "t2d": (cfg.target_vocab_size,),
    }


def decoder_keys(cfg) -> dict:
    """The config.json keys of a draft's decoder layers and vocabularies, the same in every draft kind's
    config.json (``cfg`` a ``model.DraftConfig`` or a ``dflash.DFlashConfig``)."""
    return {
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
        "vocab_size": cfg.target_vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
    }


def draft_config_json(cfg, aux_layer_ids, dtype="bfloat16") -> dict:
    """config.json of an exported draft (``cfg`` a ``model.DraftConfig``)."""
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **decoder_keys(cfg),
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        **{key: getattr(cfg, key) for key in SWITCHES},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": dtype,
        "torch_dtype": dtype,  # the pre-transformers-5 name of "dtype"
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    if cfg.parallel_drafting:
        config.update({key: getattr(cfg, key) for key in PARALLEL_KEYS})
    return config


def mask_token_of(config: dict) -> int | None:
    """The mask token vLLM's proposer would take from a flat config.json (``MASK_TOKEN_KEYS``); None: none."""
    return next((config[key] for key in MASK_TOKEN_KEYS if config.get(key) is not None), None)


def config_value(config: dict, key: str):
    """A config.json value as vLLM reads it: ``CONFIG_DEFAULTS[key]`` when the key is absent."""
    value = config.get(key)
    return CONFIG_DEFAULTS.get(key) if value is None else value


def drafts_in_parallel(flat: dict) -> bool:
    """Whether a flat config.json (``flat_config``) is a P-EAGLE draft's: our ``parallel_drafting`` key, else,
    without it, a mask token vLLM would take."""
    return bool(flat.get("parallel_drafting", mask_token_of(flat) is not None))


def draft_config_from_json(config: dict):
    """The ``model.DraftConfig`` vLLM builds from a draft's config.json, its defaults where keys are absent."""
    config = flat_config(config)
    hidden = config["hidden_size"]
    ids = config.get("eagle_aux_hidden_state_layer_ids") or []
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config_value(config, "rope_theta")}
    mask_token_id = mask_token_of(config)
    parallel = drafts_in_parallel(config)
    return DraftConfig(
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim") or hidden // config["num_attention_heads"],
        target_vocab_size=config["vocab_size"],
        draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
        target_hidden_size=config.get("target_hidden_size", hidden),
        num_aux_layers=len(ids) or NUM_AUX_LAYERS,
        rms_norm_eps=config["rms_norm_eps"],
        rope_parameters=rope,
        max_position_embeddings=config_value(config, "max_position_embeddings"),
        **{key: bool(config_value(config, key)) for key in SWITCHES},
        parallel_drafting=parallel,
        mask_token_id=mask_token_id if parallel else None,
    )


def served_aux_layers(config: dict, num_layers: int) -> list[int]:
    """The ids vLLM captures for a draft's config.json on a ``num_layers`` target: the config's
    ``eagle_aux_hidden_state_layer_ids`` (sorted, distinct, as vLLM takes them), else the default
    (vLLM's own where it has three distinct ids; where it collides vLLM could not serve the draft)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    return sorted(set(ids)) if ids else list(default_aux_layers(num_layers))


def vllm_tensors(state_dict, cfg, dtype="bfloat16") -> dict:
    """The draft's state dict as vLLM loads it: float tensors in ``dtype``, d2t int64, t2d bool."""
    shapes = tensor_shapes(cfg)
    if set(state_dict) != set(shapes):
        raise ValueError(f"draft tensors {sorted(set(state_dict) ^ set(shapes))} do not match vLLM's EAGLE-3 names")
    out = {}
    for name, t in state_dict.items():
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, vLLM expects {shapes[name]}")
        out[name] = t.detach().to("cpu", getattr(torch, dtype) if t.is_floating_point() else t.dtype).contiguous()
    if cfg.draft_vocab_size == cfg.target_vocab_size:
        if out["d2t"].any():
            raise ValueError("a draft vocabulary as large as the target's must be the identity (d2t all zero)")
        del out["d2t"]  # vLLM has no draft_id_to_target_id then (llama_eagle3.py) and would refuse it
    return out


def state_dict_from_vllm(tensors: dict, cfg) -> dict:
    """The exported tensors as an ``Eagle3Draft`` state dict: what vLLM loads, plus the vocabulary
    maps it leaves implicit (no ``d2t`` when the vocabularies match; ``t2d`` all true then)."""
    state = _rename_prefix(tensors, LAYER_PREFIX["speculators"], LAYER_PREFIX["vllm"])  # either format's names
    state.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
    state.setdefault("t2d", torch.ones(cfg.target_vocab_size, dtype=torch.bool))
    return state


# ----------------------------------------------------------------------------- the speculators format

FORMATS = ("vllm", "speculators")  # export.format "both" writes every one of them
# speculators_model_type (and speculators_config.algorithm) by parallel_drafting, and its architectures
SPECULATORS_MODEL_TYPES = {False: "eagle3", True: "peagle"}
SPECULATORS_ARCHITECTURES = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator"}
LAYER_PREFIX = {"vllm": "midlayer.", "speculators": "layers.0."}
# What vLLM assumes for a speculators config.json key that is absent (algos.py, update_eagle3); and the
# keys update_peagle reads, with its defaults (it drops fc_norm and norm_output: false there).
SPECULATORS_DEFAULTS = {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
PEAGLE_SPECULATORS_DEFAULTS = {"norm_before_residual": False, "norm_before_fc": False}


def is_speculators(config: dict) -> bool:
    """vLLM's test (transformers_utils/config.py): a ``speculators_config`` marks the format."""
    return config.get("speculators_config") is not None


def speculators_config_json(cfg, aux_layer_ids, *, verifier: str, k: int, dtype="bfloat16",
                            verifier_architectures=None) -> dict:
    """config.json of a draft in the speculators format (``cfg`` a ``model.DraftConfig``): the same
    draft as ``draft_config_json``, its layer config nested, the verifier and ``k`` named, every key
    whose default differs between the formats written out."""
    layer = {key: v for key, v in draft_config_json(cfg, aux_layer_ids, dtype).items()
             if key not in ("architectures", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                            "target_hidden_size", *SWITCHES, *PARALLEL_KEYS)}
    verifier_cfg = {"name_or_path": str(verifier)}
    if verifier_architectures:
        verifier_cfg["architectures"] = list(verifier_architectures)
    model_type = SPECULATORS_MODEL_TYPES[cfg.parallel_drafting]
    if cfg.parallel_drafting and (cfg.fc_norm or cfg.norm_output):
        raise ValueError("vLLM's speculators loader drops fc_norm and norm_output of a P-EAGLE draft (algos.py, "
                         "update_peagle): export this draft in vLLM's format only (export.format: vllm)")
    return {
        "architectures": [SPECULATORS_ARCHITECTURES[model_type]],
        "speculators_model_type": model_type,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k)}],
            "default_proposal_method": "greedy",
            "verifier": verifier_cfg,
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        **{key: getattr(cfg, key) for key in SWITCHES},
        **({"mask_token_id": cfg.mask_token_id} if cfg.parallel_drafting else {}),
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def flat_config(config: dict) -> dict:
    """The draft's config as vLLM's EAGLE-3 model sees it, from a config.json of either format: a
    speculators config is flattened the way vLLM does it (its defaults where keys are absent)."""
    if not is_speculators(config):
        return dict(config)
    flat = dict(config.get("transformer_layer_config") or {})
    flat["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = config["target_hidden_size"]
    peagle = config.get("speculators_model_type") == SPECULATORS_MODEL_TYPES[True]
    for key, default in (PEAGLE_SPECULATORS_DEFAULTS if peagle else SPECULATORS_DEFAULTS).items():
        flat[key] = config.get(key, default)
    if peagle:  # vLLM hands the mask token on as pard_token; parallel drafting comes with the model type
        flat.update(pard_token=config["mask_token_id"], parallel_drafting=True)
    if config.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    return flat


def format_tensors(tensors: dict, fmt: str) -> dict:
    """``vllm_tensors``' output under the tensor names of ``fmt`` (the decoder layer's prefix differs)."""
    return _rename_prefix(tensors, LAYER_PREFIX["vllm"], LAYER_PREFIX[fmt])


def _rename_prefix(tensors: dict, old: str, new: str) -> dict:
    return {new + name[len(old):] if name.startswith(old) else name: t for name, t in tensors.items()}


def verifier_of(config: dict) -> str | None:
    """The verifier a speculators draft names (None for the vLLM format)."""
    return (config.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")


def speculative_tokens_of(config: dict) -> int | None:
    """``num_speculative_tokens`` that ``vllm serve DIR`` takes from a speculators draft."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return methods[0].get("speculative_tokens")


def verifier_resolves_here(name) -> bool:
    """Whether vLLM can start the verifier ``name`` here without the hub: a directory (relative to
    this process's working directory, as the server's) or a hub name already in the local cache."""
    if Path(name).is_dir():
        return True
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(str(name), "config.json"), str)
    except Exception:  # not a valid repo id: nothing cached under it
        return False


def how_to_serve(fmt: str, draft_dir, k: int, target, version=None) -> tuple[str, dict | None, str]:
    """``(--model, --speculative-config, how)`` that serve a draft of format ``fmt`` with ``k`` tokens
    on vLLM ``version`` (the release that will serve it; None: unknown).

    vLLM's format: the target with the speculative config of the draft's kind (``method_of``). The
    speculators format: the draft directory as the model, the way its users start it (vLLM starts the verifier its config.json
    names; a speculative config only where ``k`` differs from the file's). The target with the draft
    in the speculative config instead, which every release takes: where the verifier does not resolve
    here (a hub name with no hub), and where it is a local path on a release that refuses one
    (``LOCAL_VERIFIER_REFUSED_FROM``) or on an unknown release."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    fallback = str(target), speculative_config(method_of(config), k, draft_dir)
    if fmt == "vllm":
        return (*fallback, "--speculative-config")
    verifier = verifier_of(config)
    if not (verifier and verifier_resolves_here(verifier)):
        return (*fallback, f"--speculative-config (the verifier {verifier!r} does not resolve on this machine)")
    if is_local_path(verifier) and version_at_least(version, LOCAL_VERIFIER_REFUSED_FROM) is not False:
        release = f"vLLM {version}" if version else "vLLM from 0.33 (the release here is unknown)"
        return (*fallback, f"--speculative-config ({release} refuses the local verifier {verifier!r} in "
                           "`vllm serve <draft dir>`: publish with export.verifier set to its hub name)")
    spec = None if speculative_tokens_of(config) == k else {"num_speculative_tokens": k}
    return str(Path(draft_dir).resolve()), spec, f"vllm serve <draft dir> (verifier {verifier})"


def method_of(config: dict) -> str:
    """The ``vllm_facts.speculative_config`` method that serves the draft of this config.json (either
    format): ``dflash`` for a DFlash draft (its ``dflash_config``, whose mask token would otherwise read
    as a parallel EAGLE's), ``peagle`` for a parallel-drafting one, else ``eagle3``."""
    if "dflash_config" in config:
        return "dflash"
    return SPECULATORS_MODEL_TYPES[drafts_in_parallel(flat_config(config))]


def kind_of(config: dict) -> str | None:
    """The ``draft.kind`` that made the draft of this config.json (either format): eagle3, eagle3.1, peagle
    or dflash (None: switches no kind names)."""
    return "dflash" if "dflash_config" in config else draft_config_from_json(config).kind


def serve_line(fmt: str, target, k: int, draft_dir="THIS_DIR", verifier=None, method="eagle3") -> str:
    """How a user serves a draft of format ``fmt`` (``method``: ``method_of`` its config.json): the
    speculative config for vLLM's format; the draft directory alone for the speculators format (vLLM
    starts the verifier its config.json names), but where that verifier is a local path, which vLLM
    0.33 and later refuse there."""
    if fmt == "speculators" and not (verifier and is_local_path(verifier)):
        return f"vllm serve {draft_dir}"
    spec = json.dumps({**speculative_config(method, k, "."), "model": str(draft_dir)}, separators=(",", ":"))
    return f"vllm serve {target} --speculative-config '{spec}'"


