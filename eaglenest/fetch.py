"""What the jobs read from the Hugging Face hub, fetched before any of them (rule fetch_inputs).

Compute nodes often have no internet. The evaluation sets of ``validate.datasets`` are read by validate_draft,
the last job (and by write_questions), and the target's config and tokenizer by every job that loads the target.
Rule fetch_inputs runs where Snakemake runs (a localrule: the login node under the SLURM profile) before those
jobs, and puts each where they look:

- a hub evaluation set into the datasets library's cache, ``dataset.cache_dir`` (in the working directory every
  node mounts): read through the same loader validation uses, so the Arrow copy is the one it reads back;
- the target's config, tokenizer, chat template and code (``TARGET_FILES``) into the Hugging Face cache
  (``$HF_HOME``), for each hub name the target goes by (``server.model``, ``hidden.target``).

Where the hub does not answer (or HF_HUB_OFFLINE is set) nothing is downloaded: each is checked in its cache,
and what is missing is named, one line each, with the command that fetches it where the hub answers. Local
files and ``pkg:`` files need nothing. The model's weights and the training dataset are not fetched here: the
docs/clusters.md, "Compute nodes without internet", says how.
"""

from __future__ import annotations

import os
from pathlib import Path

from .data.datasets import is_local_dataset
from .errors import EaglenestError, PromptsError
from .gguf import MODELS_DIR
from .serving.settings import looks_like_local_path
from .settings import FetchSettings
from .util import say, write_atomic

HUB_PROBE_S = 3.0  # a hub that does not answer within this is offline here (no retries, no waiting)
# The target's files the jobs read besides its weights: config.json, generation_config.json, the tokenizer's
# files (tokenizer.json, tokenizer.model, tiktoken.model, merges.txt, vocab files), a chat template, and the
# code of a model that ships its own (trust_remote_code).
TARGET_FILES = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]
OFFLINE_VALUES = ("1", "true", "yes", "on")


class FetchError(EaglenestError, RuntimeError):
    """Something the jobs need is neither cached here nor reachable; one line per item, with the command."""


def hub_answers() -> bool:
    """Whether the Hugging Face hub answers from here: never with HF_HUB_OFFLINE set, else one HEAD request
    within HUB_PROBE_S (an offline machine costs one failed lookup, not the hub client's retries)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in OFFLINE_VALUES:
        return False
    import requests

    try:
        requests.head(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout=HUB_PROBE_S)
    except requests.RequestException:
        return False
    return True


def hub_evalsets(settings: FetchSettings) -> list[tuple[str, dict]]:
    """``(key, spec)`` of each evaluation set named by a hub name (a local file or pkg: file needs nothing),
    its defaults filled in as validation fills them."""
    from .validation.evalsets import SET_DEFAULTS

    return [(f"validate.datasets[{i}].path ({d['name']})", {**SET_DEFAULTS, **d}) for i, d in enumerate(settings.evalsets)
            if not is_local_dataset(d["path"])]


def hub_models(settings: FetchSettings) -> list[str]:
    """The target's hub names: not a local directory, nor the conversion of a GGUF file (models/<name>, which
    rule convert_target writes in the working directory, so it need not exist yet)."""
    return [m for m in settings.models if not looks_like_local_path(m) and Path(m).parent != Path(MODELS_DIR)]


def fetch_evalset(key: str, spec: dict, cache_dir, online: bool) -> str:
    """Read one hub evaluation set through validation's own loader, which leaves its Arrow copy in
    ``cache_dir``; offline, that read comes from the copy. FetchError naming the set where it cannot."""
    from .validation.evalsets import load_set

    where = Path(cache_dir or os.environ.get("HF_DATASETS_CACHE") or "~/.cache/huggingface/datasets").expanduser()
    try:
        rows = load_set(spec, cache_dir)
    except PromptsError as e:
        if online:
            raise FetchError(f"{key} {spec['path']}: could not be fetched from the hub: {e}") from None
        subset = f" of subset {spec['subset']}" if spec.get("subset") else ""
        raise FetchError(
            f"{key} {spec['path']}: not in the datasets cache {where.resolve()}, and the hub is out of reach here; "
            f"where it answers, run `snakemake fetch_inputs` (this config) and copy {cache_dir or where} here, or "
            f"`hf download {spec['path']} --repo-type dataset --local-dir <dir>` and set {key.split(' ')[0]} to the "
            f"{spec['split']} split's file{subset} in <dir>") from None
    return f"{len(rows)} prompts, cached in {where}"


def fetch_model(model: str, online: bool) -> str:
    """The target's ``TARGET_FILES`` in the Hugging Face cache: downloaded where the hub answers, else
    config.json and tokenizer_config.json looked up there. FetchError naming the model where it cannot."""
    import huggingface_hub as hub
    from huggingface_hub import constants

    if online:
        try:
            return hub.snapshot_download(model, allow_patterns=TARGET_FILES, etag_timeout=HUB_PROBE_S * 3)
        except Exception as e:  # noqa: BLE001 -- gated without a token, no such repo: the user's to fix
            raise FetchError(f"the target {model}: its config and tokenizer could not be fetched from the hub "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); check the name, "
                             f"and HF_TOKEN for a gated model") from None
    config = hub.try_to_load_from_cache(model, "config.json")
    tokenizer = hub.try_to_load_from_cache(model, "tokenizer_config.json")
    if isinstance(config, str) and tokenizer is not None:  # a repo without tokenizer_config.json is cached as such
        return str(Path(config).parent)
    raise FetchError(f"the target {model}: its config.json and tokenizer are not in the Hugging Face cache "
                     f"{constants.HF_HUB_CACHE}, and the hub is out of reach here; where it answers, into the cache "
                     f"the nodes share: `HF_HOME={constants.HF_HOME} hf download {model}` (the whole model: the "
                     f"servers load it too)")


def fetch_inputs(settings: FetchSettings, out, log=say) -> dict:
    """Fetch (or, offline, find) every hub input of ``settings``; write what and where to ``out`` (the rule's
    marker, JSON) and return it. FetchError with one line per input neither cached nor reachable.

    Offline, the hub clients are put in offline mode before they are imported, so they read their caches
    without trying the network: call it in a fresh process (a rule script) for that."""
    online = hub_answers()
    if online:
        hub = "answers"
    else:
        hub = "not used: HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE", "").lower() in OFFLINE_VALUES \
            else f"does not answer within {HUB_PROBE_S:g} s"
        os.environ["HF_HUB_OFFLINE"] = "1"  # read once, where huggingface_hub and datasets are imported
    log(f"fetch_inputs: the Hugging Face hub {hub}")
    fetched, missing = {}, []
    jobs = [(key, lambda s=spec, k=key: fetch_evalset(k, s, settings.cache_dir, online))
            for key, spec in hub_evalsets(settings)]
    jobs += [(f"the target {m}", lambda m=m: fetch_model(m, online)) for m in hub_models(settings)]
    for key, fetch in jobs:
        try:
            fetched[key] = fetch()
            log(f"fetch_inputs: {key}: {fetched[key]}")
        except FetchError as e:
            missing.append(str(e))
    if missing:
        raise FetchError("\n".join(missing))
    local = len(settings.evalsets) + len(settings.models) - len(jobs)
    record = {"hub": hub, "fetched": fetched, "local": local}
    write_atomic(out, record)
    log(f"fetch_inputs: {len(fetched)} input(s) from the hub {'fetched' if online else 'found in the caches'}, "
        f"{local} local (nothing to fetch) -> {out}")
    return record
