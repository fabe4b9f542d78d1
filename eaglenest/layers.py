"""The EAGLE-3 auxiliary-layer convention, in one place.

vLLM records, for layer id ``i``, the hidden state *entering* decoder layer ``i`` (the residual
stream after ``i`` layers; vLLM 0.32 ``model_executor/models/llama.py`` records it as id ``idx + 1``
after layer ``idx`` runs, and id 0 is the embedding output). In transformers terms vLLM id ``i`` is
``output_hidden_states[i]`` (index 0 = embeddings). SpecForge counts layer *outputs*, so its ids are
vLLM's minus one; an off-by-one here trains a draft on features vLLM never feeds it.

vLLM sorts and de-duplicates the ids (``interfaces.py``: ``tuple(sorted(set(layers)))``) and
concatenates the states in that order before the draft's ``fc``; ids here are therefore always
returned sorted and distinct, and that order is the order of the ``fc`` input blocks.
"""

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


def check_aux_layers(aux_layers, num_layers: int) -> tuple[int, ...]:
    """Validate user-given vLLM ids against the target's depth; return them sorted.

    Id N (after the last layer) is refused: transformers' ``output_hidden_states[N]`` is the
    post-norm state while vLLM's id N would be pre-norm, so the two conventions disagree there.
    """
    ids = tuple(sorted(int(i) for i in aux_layers))
    if len(ids) != NUM_AUX_LAYERS or len(set(ids)) != len(ids):
        raise ValueError(f"aux_layers must be {NUM_AUX_LAYERS} distinct vLLM layer ids, got {list(aux_layers)}")
    if ids[0] < 0 or ids[-1] >= num_layers:
        raise ValueError(f"aux_layers {list(ids)} out of range for a {num_layers}-layer target: ids go from 0 to {num_layers - 1}")
    return ids
