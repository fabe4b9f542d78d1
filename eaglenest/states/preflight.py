"""What the workflow checks about the target before any job, without torch (Snakemake imports this
while it parses the Snakefile, for every run and dry-run): the target's config.json
(``target_config``), whether vLLM's extraction server leaves room for its prompt logits
(``preflight_logits_memory``), and the shards' size on disk (``bytes_per_token``, ``estimate_bytes``;
the format is ``hidden.py``'s)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ..errors import ConfigError
from ..gguf import is_gguf
from ..gpus import nvidia_smi
from ..settings import HiddenSettings


@functools.lru_cache(maxsize=4)
def _gguf_config(path: str) -> dict:
    """A GGUF file's config, read once a process (reading it takes seconds: benchmarks/RESULTS.md,
    "Figures moved out of code comments"): the plan, the checks and the extraction-memory check each
    ask for it before any job."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(Path(path).parent, gguf_file=Path(path).name).to_dict()


def target_config(model: str) -> dict | None:
    """The target's config.json: a local directory, else the Hugging Face cache ($HF_HOME /
    $HF_HUB_CACHE; nothing is downloaded), or a GGUF file's metadata; None when none has it."""
    if is_gguf(str(model)) and Path(model).is_file():
        return dict(_gguf_config(str(Path(model).resolve())))
    path = target_file(model, "config.json")
    return json.loads(path.read_text()) if path is not None else None


def target_file(model: str, name: str) -> Path | None:
    """A file of the target's checkpoint: in its local directory, else in the Hugging Face cache (nothing is
    downloaded); None where neither has it."""
    path = Path(model) / name
    if path.is_file():
        return path
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model, name)
    except ValueError:  # not a repo id either
        return None
    return Path(cached) if isinstance(cached, str) else None


def weights_bytes(model: str) -> int | None:
    """The target's weights on disk: total_size in its model.safetensors.index.json, else its one
    model.safetensors file (``target_file``); None where neither is here."""
    index = target_file(model, "model.safetensors.index.json")
    if index is not None:
        return (json.loads(index.read_text()).get("metadata") or {}).get("total_size")
    single = target_file(model, "model.safetensors")
    return single.stat().st_size if single is not None else None


# vLLM makes a request's prompt logits at once, beyond its start-up memory profile (states/extract.py, module docstring):
# model-dtype logits plus float32 log-probs, about 6 bytes per prompt token and vocabulary entry.
PROMPT_LOGIT_BYTES = 6


def target_vocab_size(model: str) -> int | None:
    """The target's vocabulary from its config.json (``target_config``); None when it is not here."""
    config = target_config(model)
    if config is None:
        return None
    # multimodal targets (Kimi-K2.5) keep the language model's keys under text_config
    return config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")


def gpu_memory_gib() -> float | None:
    """Memory of this machine's smallest NVIDIA GPU in GiB (nvidia-smi); None without one."""
    totals = [float(row[0]) / 1024 for row in nvidia_smi("--query-gpu=memory.total") if row and row[0]]
    return min(totals) if totals else None


def check_logits_memory(server: dict, hidden: HiddenSettings, vocab: int, gpu_gib: float) -> str:
    """Refuse (ConfigError) an extraction-server memory share that leaves no room, outside vLLM's
    share of a ``gpu_gib`` GPU, for the prompt logits of ``hidden.max_length`` tokens; else a one-line
    summary. The share is ``hidden.vllm.gpu_memory_utilization``, else ``server.gpu_memory_utilization``,
    else vLLM's default 0.9."""
    key = "hidden.vllm.gpu_memory_utilization" if hidden.gpu_memory_utilization else "server.gpu_memory_utilization"
    share = hidden.gpu_memory_utilization or server.get("gpu_memory_utilization") or 0.9
    need = hidden.max_length * vocab * PROMPT_LOGIT_BYTES / 2**30
    room = (1 - share) * gpu_gib
    figure = (f"the prompt logits of hidden.max_length={hidden.max_length} tokens x {vocab:,} vocabulary x "
              f"{PROMPT_LOGIT_BYTES} bytes = {need:.1f} GiB; {key}={share:g} leaves {room:.1f} GiB of a "
              f"{gpu_gib:.1f} GiB GPU outside vLLM's share")
    if need > room:
        most = int((1 - need / gpu_gib) * 100) / 100
        fix = (f"set hidden.vllm.gpu_memory_utilization to {most:.2f} or less" if most > 0 else
               "no share is small enough on this GPU")
        raise ConfigError(f"the extraction server would run out of GPU memory: {figure}. To fix it, {fix}, "
                          f"or lower hidden.max_length (hidden.vllm.gpu_memory_gib: the GPU's memory, if it is not "
                          f"{gpu_gib:.1f} GiB)")
    return f"extraction memory: {figure}"


def preflight_logits_memory(server: dict, hidden: HiddenSettings) -> str:
    """``check_logits_memory`` with the GPU's memory (hidden.vllm.gpu_memory_gib, else nvidia-smi here) and
    the target's vocabulary (``target_vocab_size``); a note saying why it was skipped when either is
    unknown."""
    gib, vocab = hidden.gpu_memory_gib or gpu_memory_gib(), target_vocab_size(server["model"])
    if gib and vocab:
        return check_logits_memory(server, hidden, vocab, gib)
    unknown = [what for what, known in (("the GPU's memory (set hidden.vllm.gpu_memory_gib; no nvidia-smi here)", gib),
                                         (f"the vocabulary of {server['model']} (no local config.json, not in "
                                          f"the Hugging Face cache)", vocab)) if not known]
    return f"extraction memory not checked: unknown {' and '.join(unknown)}"


def bytes_per_token(hidden_size, num_aux=3) -> int:
    """A shard's bytes per token: bf16 states of the aux layers and the last, the int64 token id, the
    int32 next token and the bool mask (8*H + 13 with three aux layers)."""
    return (num_aux + 1) * hidden_size * 2 + 8 + 4 + 1


# Where stream-mode training keeps its cache of extracted sequences, relative to the working directory (beside
# train_draft's resumable states); the disk check counts what it holds as the budget's own.
STREAM_CACHE_DIR = "draft/.train_state/stream_cache"


def states_file_bytes(n_tokens, num_layers, hidden_size) -> int:
    """The most one per-request file of the extraction server takes on disk: ``n_tokens`` x ``num_layers`` (the
    aux layers and the last) x ``hidden_size`` at up to 4 bytes, and its header. Stream mode's disk budget
    (hidden.stream.max_disk_gb) must hold at least the longest sequence's (checks.check_stream_disk)."""
    return n_tokens * num_layers * hidden_size * 4 + 4096


def estimate_bytes(num_tokens, num_seqs, hidden_size, num_aux=3) -> int:
    """Bytes on disk of one shard (bytes_per_token a token, int64 offsets, ~header)."""
    return num_tokens * bytes_per_token(hidden_size, num_aux) + (num_seqs + 1) * 8 + 4096
