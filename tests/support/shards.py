"""Hidden-state shards as older eaglenest wrote them, for the readers that must still take them."""


def without_target_next(shard, out):
    """``shard`` as eaglenest wrote it before target_next existed (same tensors and metadata, less that one)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(shard), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys() if k != "target_next"}, f.metadata()
    save_file(tensors, str(out), meta)
    return out
