"""The checks against the target's config.json (aux layer ids, vocabulary, attention heads, context) and the
lengths the servers hold; the config.json is found here or fetched, one small file, where the hub answers."""

from __future__ import annotations

import os
from pathlib import Path

from ..data.prompts import same_prompts
from ..plan import RunSettings
from ..states.preflight import target_config
from ..util import is_local_path
from ..vllm_facts import NO_AUX_ID_0_MODEL_TYPES, check_aux_layers, default_aux_layers
from .review import Review


def find_target_config(model: str, workdir: Path) -> dict | None:
    """The target's config.json, a directory relative to ``workdir`` or a hub name in the HF cache; a hub name
    not in the cache is fetched into it where the hub answers (``fetch_config``)."""
    local = workdir / model
    if (local / "config.json").is_file():
        return target_config(str(local))
    cfg = target_config(model)
    if cfg is None and "/" in model and not is_local_path(model, workdir) and fetch_config(model):
        cfg = target_config(model)
    return cfg


HUB_PROBE_S = 3.0  # a hub that does not answer within this is offline for the plan (no retries, no waiting)


def fetch_config(model: str) -> bool:
    """Download a hub target's config.json (one small file) into the Hugging Face cache, so the checks run
    before any job: only where HF_HUB_OFFLINE is unset and the hub answers within HUB_PROBE_S (an offline
    login node costs one failed lookup, not the hub client's minute of retries). False where it could not."""
    import requests

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    from huggingface_hub import constants, hf_hub_download

    try:
        requests.head(constants.ENDPOINT, timeout=HUB_PROBE_S)
        hf_hub_download(model, "config.json", etag_timeout=HUB_PROBE_S)
    except Exception:  # offline, gated without a token, no such repo: the checks that need it are skipped, said so
        return False
    return True


def _text_key(cfg: dict, key: str):
    """A key of the language model: a multimodal wrapper (Kimi-K2.5) keeps it under text_config."""
    text = cfg.get("text_config") or {}
    return text.get(key) if text.get(key) is not None else cfg.get(key)


def check_aux_ids(run: RunSettings, model: str, cfg: dict) -> str | None:
    layers = _text_key(cfg, "num_hidden_layers")
    if not layers:
        return None
    ids = run.draft.aux_layers
    types = {cfg.get("model_type"), (cfg.get("text_config") or {}).get("model_type")}
    model_type = next((t for t in types if t in NO_AUX_ID_0_MODEL_TYPES), _text_key(cfg, "model_type"))
    try:
        default = list(default_aux_layers(layers))
    except ValueError:
        default = None
    try:
        if ids is None:
            if default is None:
                return (f"draft.aux_layers null: {model} has {layers} layers (num_hidden_layers in its config.json), "
                        "too few for vLLM's default (2, N//2, N-3); set draft.aux_layers to 3 distinct ids")
            return None
        check_aux_layers(ids, layers, cfg.get("architectures") or (), model_type)
    except ValueError as e:
        hint = f", e.g. {default} (vLLM's default), or null for that default" if default else ""
        return (f"draft.aux_layers: {e} ({model}'s config.json: num_hidden_layers {layers}); set draft.aux_layers "
                f"to 3 distinct ids from 1 to {layers - 1}{hint}")
    return None


def check_vocab(run: RunSettings, model: str, cfg: dict) -> str | None:
    vocab, draft = _text_key(cfg, "vocab_size"), run.draft.vocab_size
    if vocab and draft > vocab:
        return (f"draft.vocab_size {draft:,} is larger than the vocabulary of {model} ({vocab:,}, vocab_size in its "
                f"config.json), which would be silently clipped; set draft.vocab_size to {vocab} or less")
    return None


def check_heads(run: RunSettings, model: str, cfg: dict) -> str | None:
    heads, tp = _text_key(cfg, "num_attention_heads"), run.server.tensor_parallel_size
    if heads and heads % tp:
        fits = [n for n in range(1, min(heads, 16) + 1) if heads % n == 0]
        return (f"server.tensor_parallel_size {tp} does not divide the {heads} attention heads of {model} "
                f"(num_attention_heads in its config.json); set it to a divisor of {heads}, e.g. one of {fits}")
    return None


def check_context(run: RunSettings, model: str, cfg: dict) -> str | None:
    """server.max_model_len within the target's context (max_position_embeddings): vLLM refuses more."""
    context, limit = _text_key(cfg, "max_position_embeddings"), run.server.max_model_len
    if context and limit and limit > context:
        return (f"server.max_model_len {limit:,} is above the {context:,} tokens {model} holds "
                f"(max_position_embeddings in its config.json), which vLLM refuses; set it to {context} or less")
    return None


def check_lengths(run: RunSettings, cfg: dict | None = None) -> list[str]:
    """Answers and hidden-state sequences within server.max_model_len (null: the target's own context,
    max_position_embeddings in ``cfg``, as vLLM takes it). The longest prompt is not known before the
    traces tokenize it, so max_tokens alone must leave room for one."""
    limit = run.server.max_model_len
    what = f"server.max_model_len {limit:,}" if limit else None
    if not limit:
        limit = _text_key(cfg or {}, "max_position_embeddings")
        what = f"the target's context of {limit:,} tokens (server.max_model_len null: its max_position_embeddings)" \
            if limit else None
    errors = []
    if not limit:
        return errors
    max_tokens, max_length = run.generation.max_tokens, run.hidden.max_length
    if max_tokens >= limit:
        errors.append(f"generation.max_tokens {max_tokens:,} leaves no room for a prompt within {what} "
                      f"(prompt + answer); set generation.max_tokens below {limit}, or raise server.max_model_len")
    if max_length > limit:
        errors.append(f"hidden.max_length {max_length:,} is above {what}, the longest sequence the servers hold; "
                      f"set hidden.max_length to {limit} or less")
    return errors


def check_longest_prompt(run: RunSettings, model: str, cfg: dict | None, workdir: Path) -> str | None:
    """Once prepare_prompts has run for this config: its longest prompt (data/prompts/stats.json), in the target's
    chat template, plus generation.max_tokens within server.max_model_len (null: the target's context); vLLM
    refuses a longer request (HTTP 400, counted as an error). Needs the target's tokenizer here; else skipped."""
    import json

    stats = workdir / "data" / "prompts" / "stats.json"
    limit = run.server.max_model_len or _text_key(cfg or {}, "max_position_embeddings")
    if not limit or not stats.is_file():
        return None
    made = json.loads(stats.read_text())
    longest = made.get("longest_prompt")
    if not longest or not same_prompts(made, run.prompts):
        return None
    n = _prompt_tokens(longest["messages"], model, run.generation.chat_template_kwargs, workdir, stats)
    if n is None:
        return None  # no tokenizer here: nothing to count with
    max_tokens = run.generation.max_tokens
    if n + max_tokens <= limit:
        return None
    return (f"the longest prompt ({longest['id']} in {stats.parent}, {n:,} tokens in the chat template) plus "
            f"generation.max_tokens {max_tokens:,} is {n + max_tokens:,} tokens, above the {limit:,} vLLM holds "
            f"(server.max_model_len, else the target's context): vLLM would refuse it; raise server.max_model_len, "
            f"lower generation.max_tokens, or lower dataset.max_prompt_chars")


def _prompt_tokens(messages, model: str, template_kwargs, workdir: Path, stats: Path) -> int | None:
    """Tokens of ``messages`` in the target's chat template, or None without its tokenizer here. Kept beside
    stats.json (longest_prompt.tokens.json, keyed by what decides it), so only the first plan after
    prepare_prompts pays for loading a tokenizer (seconds on every later start otherwise)."""
    import hashlib
    import json

    from ..util import write_atomic

    key = hashlib.sha256(json.dumps([stats.read_text(), model, template_kwargs], default=str).encode()).hexdigest()
    cache = stats.with_name("longest_prompt.tokens.json")
    try:
        kept = json.loads(cache.read_text())
        if kept.get("key") == key:
            return kept["tokens"]
    except (OSError, ValueError, AttributeError):
        pass
    try:
        from transformers import AutoTokenizer

        from ..states.target import chat_prompt_ids

        local = workdir / model
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.is_dir() else model, local_files_only=True)
        n = len(chat_prompt_ids(tokenizer, messages, template_kwargs))
    except (OSError, ValueError):
        return None
    try:
        write_atomic(cache, {"key": key, "tokens": n})
    except OSError:
        pass  # a read-only working directory: counted again next time
    return n


def check_target(run: RunSettings, workdir: Path, review: Review) -> dict | None:
    """The checks against the target's config.json (returned, None where it is not here) and the lengths."""
    model = run.hidden.target
    cfg = find_target_config(model, workdir)
    if cfg is None:
        review.skipped.append(f"aux layer ids, draft vocabulary and tensor_parallel_size not checked: no config.json for "
                              f"{model} here (a local directory or the Hugging Face cache) and the hub did not give it "
                              f"(offline, or gated without HF_TOKEN); fetch it first where the hub answers, e.g. "
                              f"`hf download {model} config.json`")
    else:
        review.add(check_aux_ids(run, model, cfg), check_vocab(run, model, cfg), check_heads(run, model, cfg),
                   check_context(run, model, cfg))
    if run.server.max_model_len or _text_key(cfg or {}, "max_position_embeddings"):
        review.add(*check_lengths(run, cfg))
    else:
        review.skipped.append("generation.max_tokens and hidden.max_length not checked: server.max_model_len is null "
                              "and the target's max_position_embeddings is not known here")
    review.add(check_longest_prompt(run, model, cfg, workdir))
    return cfg
