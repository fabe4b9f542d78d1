"""build_vocab: frequency ranking, deterministic ties, d2t/t2d round trip."""

import json

import pytest
import torch

from eaglenest.draft.vllm_format import draft_to_target_ids
from eaglenest.draft.vocab import build_vocab, load_vocab, maps_from_ids, select_vocab
from eaglenest.settings import DraftSettings


def write_traces(path, completions, truncated=()):
    with open(path, "w") as f:
        for i, completion in enumerate(completions):
            rec = {"id": str(i), "prompt_token_ids": [0, 0, 0], "completion_token_ids": completion, "truncated": i in truncated}
            f.write(json.dumps(rec) + "\n")
    return path


def test_top_tokens_ties_to_lower_id_ascending_draft_ids(tmp_path):
    # counts: 7 -> 3, 5 -> 2, 9 -> 2, 2 -> 1, 8 -> 1; prompt tokens (0) are not counted
    traces = write_traces(tmp_path / "t.jsonl", [[7, 5, 9], [7, 7, 9, 5], [2, 8]])
    stats = build_vocab([traces], tmp_path / "vocab.safetensors", 12, DraftSettings.defaults().replace(vocab_size=4))
    d2t, t2d = load_vocab(tmp_path / "vocab.safetensors")
    assert draft_to_target_ids(d2t).tolist() == [2, 5, 7, 9]  # 2 beats 8 on the tie: lower id
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and len(t2d) == 12
    assert (d2t >= 0).all() and t2d.nonzero().squeeze(1).tolist() == [2, 5, 7, 9]
    assert stats["completion_tokens"] == 9 and stats["draft_vocab_size"] == 4
    assert stats["coverage"] == pytest.approx(8 / 9)


def test_round_trip_and_cap_at_target_vocab(tmp_path):
    traces = write_traces(tmp_path / "t.jsonl", [[1, 1, 3], [4]])
    stats = build_vocab(traces, tmp_path / "v.safetensors", 6, DraftSettings.defaults().replace(vocab_size=32000))
    d2t, t2d = load_vocab(tmp_path / "v.safetensors")
    assert stats["draft_vocab_size"] == 6 and t2d.all() and not d2t.any()  # the whole vocab: identity
    ids = select_vocab(torch.tensor([5, 0, 5, 9, 0, 1]).numpy(), 3)
    d2t, t2d = maps_from_ids(ids, 6)
    assert draft_to_target_ids(d2t).tolist() == [0, 2, 3]
    for draft_id, target_id in enumerate(draft_to_target_ids(d2t).tolist()):
        assert t2d[target_id] and draft_id + d2t[draft_id] == target_id
    assert int(t2d.sum()) == len(d2t)


def test_use_truncated_and_bad_ids(tmp_path):
    traces = write_traces(tmp_path / "t.jsonl", [[1], [2, 2, 2]], truncated={1})
    build_vocab(traces, tmp_path / "v.safetensors", 5, DraftSettings.defaults().replace(vocab_size=1, use_truncated=False))
    assert draft_to_target_ids(load_vocab(tmp_path / "v.safetensors")[0]).tolist() == [1]
    build_vocab(traces, tmp_path / "v.safetensors", 5, DraftSettings.defaults().replace(vocab_size=1, use_truncated=True))
    assert draft_to_target_ids(load_vocab(tmp_path / "v.safetensors")[0]).tolist() == [2]
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        build_vocab(traces, tmp_path / "v.safetensors", 2)
