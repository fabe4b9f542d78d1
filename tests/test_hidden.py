"""extract_hidden: the vLLM layer-id convention, the loss mask, truncation, the shard format, disk refusal."""

import json

import pytest
import torch

from eaglenest.vllm_facts import default_aux_layers
from eaglenest.states import hidden, shards
from eaglenest.states.hidden import extract_hidden
from eaglenest.states.shards import DiskSpaceError, HiddenShards
from eaglenest.states.target import load_target_head, save_target_head
from eaglenest.settings import HiddenSettings
from tests.support.shards import without_target_next
from tests.support.tiny_target import HIDDEN, LAYERS, VOCAB, fake_traces, tiny_target

def read_records(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"))


@pytest.mark.parametrize("aux_layers", [None, (0, 2, 3)])
def test_aux_layers_are_transformers_hidden_states_at_vllm_ids(target, tmp_path, aux_layers):
    from transformers import AutoModelForCausalLM

    traces = fake_traces(tmp_path / "shard_0.jsonl")
    out = tmp_path / "hidden" / "shard_0.safetensors"
    stats = extract_hidden([traces], out, HiddenSettings.defaults().replace(target=target, aux_layers=aux_layers, dtype="float32", batch_tokens=64),
                           progress=False)
    ids_expected = list(aux_layers or default_aux_layers(LAYERS))
    assert stats["aux_layers"] == ids_expected
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    shards = HiddenShards(out)
    assert shards.aux_layers == ids_expected and len(shards) == stats["sequences"] == 12
    for k in range(len(shards)):
        seq = shards[k]
        with torch.no_grad():
            ref = model(seq["input_ids"][None], output_hidden_states=True)
        aux = seq["aux_hidden"].float().view(len(seq["input_ids"]), 3, HIDDEN)
        for block, vllm_id in enumerate(ids_expected):
            got = aux[:, block]
            # vLLM id i == transformers output_hidden_states[i] (index 0 = embeddings), bf16-rounded
            torch.testing.assert_close(got, ref.hidden_states[vllm_id][0], atol=2e-2, rtol=1e-2)
            for other in {vllm_id - 1, vllm_id + 1} & set(range(LAYERS + 1)):
                assert not torch.allclose(got, ref.hidden_states[other][0], atol=2e-2, rtol=1e-2)
        # last_hidden is post-norm: lm_head(last_hidden) are the target's logits
        torch.testing.assert_close(seq["last_hidden"].float(), ref.hidden_states[-1][0], atol=2e-2, rtol=1e-2)
        logits = seq["last_hidden"].float() @ model.lm_head.weight.T
        assert (logits.argmax(-1) == ref.logits[0].argmax(-1)).float().mean() > 0.95
        # target_next: the target's own greedy choice from each position (un-rounded states)
        assert seq["target_next"].dtype == torch.int32
        assert torch.equal(seq["target_next"].long(), ref.logits[0].argmax(-1))


def test_loss_mask_truncation_and_order(target, tmp_path):
    traces = fake_traces(tmp_path / "t.jsonl", n=16)
    records = read_records(traces)
    out = tmp_path / "shard.safetensors"
    max_length = 20
    stats = extract_hidden(traces, out, HiddenSettings.defaults().replace(target=target, max_length=max_length, use_truncated=False), progress=False)
    kept = [r for r in records if not r["truncated"] and len(r["prompt_token_ids"]) < max_length]
    assert stats["skipped_truncated"] == sum(r["truncated"] for r in records) == 4
    shards = HiddenShards(out)
    assert len(shards) == len(kept)
    for k, rec in enumerate(kept):  # the shard keeps the trace order
        seq = shards[k]
        tokens = (rec["prompt_token_ids"] + rec["completion_token_ids"])[:max_length]
        assert seq["input_ids"].tolist() == tokens  # exactly the trace's ids, cut at max_length
        n_prompt = len(rec["prompt_token_ids"])
        assert seq["loss_mask"].tolist() == [i >= n_prompt for i in range(len(tokens))]
    assert stats["cut_at_max_length"] == sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) > max_length for r in kept)
    assert stats["tokens"] == sum(shards.length(k) for k in range(len(shards)))
    assert stats["loss_tokens"] == sum(int(shards[k]["loss_mask"].sum()) for k in range(len(shards)))


def test_shard_is_plain_safetensors_of_the_estimated_size(target, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "shard.safetensors"
    stats = extract_hidden(fake_traces(tmp_path / "t.jsonl"), out, HiddenSettings.defaults().replace(target=target), progress=False)
    tensors = load_file(str(out))  # full validation by the reference reader
    T = stats["tokens"]
    assert tensors["aux_hidden"].shape == (T, 3 * HIDDEN) and tensors["aux_hidden"].dtype == torch.bfloat16
    assert tensors["last_hidden"].shape == (T, HIDDEN) and tensors["input_ids"].dtype == torch.int64
    assert tensors["loss_mask"].dtype == torch.bool and tensors["seq_offsets"][-1] == T
    assert tensors["target_next"].shape == (T,) and tensors["target_next"].dtype == torch.int32
    assert int(tensors["target_next"].min()) >= 0 and int(tensors["target_next"].max()) < VOCAB
    assert 0 <= hidden.estimate_bytes(T, stats["sequences"], HIDDEN) - stats["bytes"] <= 4096
    assert not list(tmp_path.glob("*.partial"))


def test_a_shard_from_before_target_next_is_read_without_it(target, tmp_path):
    new = tmp_path / "new.safetensors"
    extract_hidden(fake_traces(tmp_path / "t.jsonl"), new, HiddenSettings.defaults().replace(target=target), progress=False)
    old = without_target_next(new, tmp_path / "old.safetensors")
    assert HiddenShards(new).without_target_next == [] and "target_next" in HiddenShards(new)[0]
    both = HiddenShards([new, old])
    assert both.without_target_next == [old]
    assert sorted(both[0]) == sorted(both[len(both) - 1]) == ["aux_hidden", "input_ids", "last_hidden", "loss_mask"]


def test_refuses_when_disk_is_short(target, tmp_path, monkeypatch):
    traces = fake_traces(tmp_path / "t.jsonl")
    usage = type("Usage", (), {"free": 1000, "total": 10**9, "used": 0})
    monkeypatch.setattr(shards.shutil, "disk_usage", lambda path: usage)
    monkeypatch.setattr(hidden, "load_target", lambda *a, **k: pytest.fail("loaded the target before checking the disk"))
    out = tmp_path / "hidden" / "shard_0.safetensors"
    with pytest.raises(DiskSpaceError) as err:
        extract_hidden(traces, out, HiddenSettings.defaults().replace(target=target), progress=False)
    message = str(err.value)
    assert str(out) in message and "1,000 bytes" in message and "needs" in message
    assert not out.exists()


def test_target_head_saved_once_from_the_checkpoint(target, tmp_path):
    from transformers import AutoModelForCausalLM

    head_path = tmp_path / "target_head.safetensors"
    info = save_target_head(head_path, HiddenSettings.defaults().replace(target=target, aux_layers=[0, 1, 3])).to_dict()
    tensors, facts = load_target_head(head_path)
    saved = facts.to_dict()
    assert saved == json.loads(json.dumps(info)) and saved["aux_layers"] == [0, 1, 3]
    assert saved["hidden_size"] == HIDDEN and saved["vocab_size"] == VOCAB and saved["num_hidden_layers"] == LAYERS
    assert saved["last_hidden"] == "post_norm" and saved["rope_parameters"]["rope_theta"] == 5000.0
    model = AutoModelForCausalLM.from_pretrained(target)
    assert torch.equal(tensors["embed_tokens.weight"], model.model.embed_tokens.weight)
    assert torch.equal(tensors["lm_head.weight"], model.lm_head.weight)
    assert torch.equal(tensors["norm.weight"], model.model.norm.weight)


def test_target_head_of_a_loaded_tied_target_is_saved(target, tmp_path):
    """A loaded target whose lm_head is its embedding (tie_word_embeddings, SmolLM2's case) on the CPU:
    both tensors saved (safetensors refuses one storage under two names)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)
    model.lm_head.weight = model.model.embed_tokens.weight
    head_path = tmp_path / "target_head.safetensors"
    save_target_head(head_path, HiddenSettings.defaults().replace(target=target, aux_layers=[0, 1, 3]), model=model)
    tensors, _ = load_target_head(head_path)
    assert torch.equal(tensors["lm_head.weight"], model.model.embed_tokens.weight)
    assert torch.equal(tensors["embed_tokens.weight"], model.model.embed_tokens.weight)


def test_target_head_of_a_hub_name_reads_only_the_head_files(target, tmp_path, monkeypatch):
    """A hub name (here an offline Hugging Face cache laid out as the hub client writes it) gives the
    head from the index and the one shard that holds it, never the whole target."""
    import shutil

    from eaglenest.states import target as target_mod

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(target, snapshot)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: pytest.fail("loaded the whole target"))
    head_path = tmp_path / "target_head.safetensors"
    save_target_head(head_path, HiddenSettings.defaults().replace(target="org/tiny", aux_layers=[0, 1, 3]))
    tensors, saved = load_target_head(head_path)
    reference, _ = load_target_head(_saved_head(target, tmp_path / "ref.safetensors"))
    assert saved.target == "org/tiny"
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight"):
        assert torch.equal(tensors[name], reference[name])


def _saved_head(target, path):
    save_target_head(path, HiddenSettings.defaults().replace(target=target, aux_layers=[0, 1, 3]))
    return path


def test_both_state_sources_meet_the_protocol():
    """Training reads shards and streamed states through source.StateSource only."""
    from eaglenest.states.source import StateSource
    from eaglenest.states.stream import StreamedStates

    methods = [n for n, v in vars(StateSource).items() if callable(v) and (not n.startswith("_") or n in ("__len__", "__getitem__"))]
    assert {"length", "fingerprint_facts", "follow", "close", "__len__", "__getitem__"} <= set(methods)
    for cls in (HiddenShards, StreamedStates):
        assert all(callable(getattr(cls, n, None)) for n in methods), cls


def _kimi_like_checkpoint(root, *, lm_head=True):
    """A Kimi-K2.5-shaped checkpoint in miniature: the kimi_k25 wrapper config (a DeepSeek-V3 text config and a
    vision tower), the language model under ``language_model.``, decoys that end the same way (the MTP layer's
    embedding, a vision norm), in two shards with an index."""
    from safetensors.torch import save_file

    vocab, hidden = 96, 16
    (root).mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({
        "model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {"model_type": "deepseek_v3", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 32,
                        "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 2,
                        "tie_word_embeddings": False}}))
    g = torch.Generator().manual_seed(0)
    tensors = {
        "language_model.model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
        "language_model.model.norm.weight": torch.randn(hidden, generator=g),
        "language_model.model.layers.6.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
        "language_model.model.layers.6.shared_head.norm.weight": torch.randn(hidden, generator=g),
        "language_model.model.layers.0.input_layernorm.weight": torch.randn(hidden, generator=g),
        "vision_tower.encoder.norm.weight": torch.randn(hidden, generator=g),
        "mm_projector.norm.weight": torch.randn(hidden, generator=g),
    }
    if lm_head:
        tensors["language_model.lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(root / file))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    return tensors


def test_a_multimodal_wrappers_head_is_read_by_name_without_building_the_model(tmp_path, monkeypatch):
    """Kimi-K2.5: transformers has no causal-LM class for its config, and the target is 1T parameters. The head
    comes from the checkpoint by the language model's names (not the MTP layer's or the vision tower's), the
    facts from the text config, and nothing loads the model."""
    from eaglenest.states import target as target_mod

    tensors = _kimi_like_checkpoint(tmp_path / "kimi")
    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: pytest.fail("loaded the whole target"))
    info = save_target_head(tmp_path / "head.safetensors", HiddenSettings.defaults().replace(target=str(tmp_path / "kimi"))).to_dict()
    head, saved = load_target_head(tmp_path / "head.safetensors")
    assert torch.equal(head["embed_tokens.weight"], tensors["language_model.model.embed_tokens.weight"])
    assert torch.equal(head["norm.weight"], tensors["language_model.model.norm.weight"])
    assert torch.equal(head["lm_head.weight"], tensors["language_model.lm_head.weight"])
    assert saved.hidden_size == 16 and saved.vocab_size == 96 and saved.num_hidden_layers == 6
    assert saved.model_type == "deepseek_v3" and 0 not in info["aux_layers"]


def test_a_head_that_is_not_found_is_refused_rather_than_loading_the_whole_target(tmp_path, monkeypatch):
    from eaglenest.states import target as target_mod

    _kimi_like_checkpoint(tmp_path / "kimi", lm_head=False)  # untied, and no lm_head tensor
    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: pytest.fail("loaded the whole target"))
    with pytest.raises(ValueError) as err:
        save_target_head(tmp_path / "head.safetensors", HiddenSettings.defaults().replace(target=str(tmp_path / "kimi")))
    assert "lm_head" in str(err.value) and "hidden.backend transformers" in str(err.value)
    assert not (tmp_path / "head.safetensors").exists()
