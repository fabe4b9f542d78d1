"""The one place that touches vLLM internals: the hidden-state connector of the extraction server.

vLLM 0.32 extracts hidden states with the ``extract_hidden_states`` speculative method plus a KV
connector that writes each finished request's states to ``<shared_storage_path>/<req id>.safetensors``
(``hidden_states [T, layers, H]``, ``token_ids [T]``), holding an exclusive ``flock`` on
``<file>.lock`` until the write is done. Upstream's ``ExampleHiddenStatesConnector`` copies the
states out with ``pin_memory=True`` on a CUDA stream with CUDA events, which a CPU build of vLLM
lacks: its engine dies at the first finished request.

``EaglenestHiddenStatesConnector`` is upstream's class with one method replaced where the KV cache
is not on a GPU: ``_submit_async_write`` copies the rows out and writes the file synchronously,
then releases the lock. On a GPU it calls upstream's method unchanged. vLLM loads it by name
through ``kv_connector_module_path`` (``kv_transfer_config`` below), so nothing of vLLM is patched.

What it relies on (``tests/test_vllm_connector.py`` checks each against the installed vLLM and
fails loudly when an upgrade changes them): the upstream class and its module-level
``extract_from_kv_cache``; ``PendingSave.{req_id, filename, token_ids, block_ids}``; the instance
attributes ``_is_tp_rank_zero``, ``_kv_cache``, ``_block_size``, ``_lock_fds``, ``use_lock``,
``_req_copy_events`` (``get_finished`` reports a request done once its event's ``query()`` is
true) and ``_req_futures``.

The server's command-line flags for extraction are vLLM format facts: ``vllm_format.py``
(``extraction_server_args``) names this module's connector there.

``allow_custom_save_path`` is never enabled: with it, any API client could make the server write
files anywhere it can. The storage directory is created mode 0700 by ``storage_dir``.
"""

from __future__ import annotations

import os
from pathlib import Path

CONNECTOR = "EaglenestHiddenStatesConnector"
MODULE = __name__  # "eaglenest.serving.connector": what kv_connector_module_path names
UPSTREAM = "ExampleHiddenStatesConnector"
UPSTREAM_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def storage_dir(path) -> Path:
    """The directory the server writes per-request files into, created (or tightened to) mode 0700."""
    path = Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def read_states(path) -> dict:
    """``{"hidden_states", "token_ids"}`` of one per-request file, once the server's write is done.

    Waits on the ``.lock`` beside it (a shared flock: the kernel wakes us when the writer's
    exclusive lock goes, also when the writer dies). Raises FileNotFoundError when there is no
    complete file (the server died before writing it)."""
    import fcntl

    from safetensors.torch import load_file

    lock = str(path) + ".lock"
    try:
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)
            return load_file(str(path), device="cpu")
    except FileNotFoundError:
        if os.path.exists(lock):
            raise
        return load_file(str(path), device="cpu")  # no lock (use_synchronization_lock off): read as is


def remove_states(path) -> None:
    for p in (str(path), str(path) + ".lock", str(path) + ".tmp"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


class _Done:
    """Stands in for upstream's CUDA event: the copy finished before ``_submit_async_write`` returned."""

    @staticmethod
    def query() -> bool:
        return True


def _connector_class():
    import importlib

    upstream_module = importlib.import_module(UPSTREAM_MODULE)
    Upstream = getattr(upstream_module, UPSTREAM)
    extract_from_kv_cache = upstream_module.extract_from_kv_cache

    class EaglenestHiddenStatesConnector(Upstream):
        """Upstream's connector; without a GPU, the states are copied and written synchronously."""

        def _submit_async_write(self, pending) -> None:
            if self._kv_cache is None or self._kv_cache.is_cuda:
                return super()._submit_async_write(pending)
            if not self._is_tp_rank_zero:
                return
            import fcntl

            import torch
            from safetensors.torch import save_file

            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (torch.arange(self._block_size).reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
            # [T, layers, H]: a copy, so the blocks may be freed and reused once this returns
            states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                tmp = pending.filename + ".tmp"
                save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
                os.replace(tmp, pending.filename)  # a reader never sees half a file
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)  # releases the lock: the client reads now
            self._req_copy_events[pending.req_id] = _Done()

    EaglenestHiddenStatesConnector.__module__ = __name__
    EaglenestHiddenStatesConnector.__qualname__ = CONNECTOR
    return EaglenestHiddenStatesConnector


def __getattr__(name):
    # Built on first use, so importing this module (the client does) does not import vLLM.
    if name == CONNECTOR:
        cls = _connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
