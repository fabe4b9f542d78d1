"""vllm_format: the facts about vLLM's formats and interfaces, each checked against what vLLM itself
parses or does (its /metrics text, its SpeculativeConfig, its config defaults). Fast: no server."""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eaglenest.draft.config import KINDS, DraftConfig
from eaglenest.draft.vllm_format import (CONFIG_DEFAULTS, SWITCHES, draft_config_from_json, draft_config_json, method_of,
                                         served_aux_layers)
from eaglenest.vllm_facts import (check_aux_layers, default_aux_layers, reasoning_of, served_dtype, spec_counters,
                                 speculative_config)
from tests.support.config import TOY_TARGET
from tests.support.vllm_metrics import METRICS_BEFORE


def test_spec_counters_refuse_text_that_is_not_prometheus():
    with pytest.raises(ValueError):
        spec_counters("not a metric line at all {\n")


def test_spec_counters_sum_engines_and_keep_positions():
    c = spec_counters(METRICS_BEFORE)
    assert c == {"drafts": 15.0, "draft_tokens": 45.0, "accepted": 15.0, "accepted_per_pos": {0: 9.0, 1: 5.0, 2: 1.0}}
    assert spec_counters("# no speculation here\nvllm:num_requests_running 0\n")["drafts"] == 0.0


def test_speculative_configs_are_what_vllm_parses(tmp_path):
    from vllm.config.speculative import SpeculativeConfig

    assert speculative_config("baseline", 3) is None
    e = speculative_config("eagle3", 3, tmp_path / "d")
    assert e == {"method": "eagle3", "model": str((tmp_path / "d").resolve()), "num_speculative_tokens": 3}
    n = speculative_config("ngram", 3, ngram={"prompt_lookup_max": 4, "prompt_lookup_min": 2})
    p = speculative_config("peagle", 3, tmp_path / "d")  # P-EAGLE: vLLM's eagle3 with parallel drafting
    assert p == {**e, "parallel_drafting": True}
    fields = SpeculativeConfig.__dataclass_fields__ if hasattr(SpeculativeConfig, "__dataclass_fields__") else SpeculativeConfig.model_fields
    assert set(n) <= set(fields) and set(e) <= set(fields) and set(p) <= set(fields)


def test_default_aux_layers():
    assert default_aux_layers(32) == (2, 16, 29)  # vLLM's (2, N//2, N-3)
    assert default_aux_layers(61) == (2, 30, 58)
    assert default_aux_layers(4) == (1, 2, 3)  # vLLM's would be (2, 2, 1): collides
    assert check_aux_layers([3, 0, 2], 4) == (0, 2, 3)
    with pytest.raises(ValueError, match="out of range"):
        check_aux_layers([1, 2, 4], 4)  # id N is post-norm in transformers: refused
    with pytest.raises(ValueError, match="distinct"):
        check_aux_layers([1, 1, 2], 4)
    # an exported config.json's ids win (sorted and distinct, as vLLM takes them); absent: the default
    assert served_aux_layers({"eagle_aux_hidden_state_layer_ids": [9, 1, 5]}, 32) == [1, 5, 9]
    assert served_aux_layers({}, 32) == [2, 16, 29]


DRAFT = DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    target_vocab_size=100, draft_vocab_size=40, target_hidden_size=64, max_position_embeddings=256,
                    norm_before_residual=True, rope_parameters={"rope_type": "default", "rope_theta": 5e5})


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_config_json_reads_back_as_written(kind):
    """Export writes config.json and validation reads it back through the same module: nothing is lost."""
    parallel = KINDS[kind]["parallel_drafting"]
    draft = dataclasses.replace(DRAFT, **KINDS[kind], mask_token_id=99 if parallel else None)
    config = draft_config_json(draft, [1, 2, 3], "bfloat16")
    assert draft_config_from_json(config) == draft and draft_config_from_json(config).kind == kind
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["norm_before_residual"] is True
    assert config["fc_norm"] is config["norm_output"] is (kind == "eagle3.1")
    assert config.get("mask_token_id") == (99 if parallel else None)  # the key vLLM's proposer reads
    assert method_of(config) == ("peagle" if parallel else "eagle3")


def test_a_parallel_draft_of_another_tool_is_known_by_its_mask_token():
    """A config.json without our parallel_drafting key is a P-EAGLE draft where it names a mask token
    under any key vLLM's proposer reads (speculators' loader writes pard_token)."""
    plain = draft_config_json(DRAFT, [1, 2, 3])
    assert draft_config_from_json(plain).parallel_drafting is False and method_of(plain) == "eagle3"
    for key in ("mask_token_id", "pard_token", "ptd_token_id"):
        read = draft_config_from_json({**plain, key: 5})
        assert (read.parallel_drafting, read.mask_token_id, read.kind) == (True, 5, "peagle"), key


def test_absent_keys_read_as_vllm_defaults_them():
    """Keys vLLM's loader defaults when absent are read with vLLM's values, not ours."""
    from transformers import LlamaConfig

    config = draft_config_json(DRAFT, [1, 2, 3])
    for key in ("norm_before_residual", "fc_norm", "norm_output", "max_position_embeddings", "rope_parameters", "rope_theta"):
        config.pop(key)
    read = draft_config_from_json(config)
    assert read.norm_before_residual is False  # llama_eagle3.py: getattr(config, "norm_before_residual", False)
    assert read.fc_norm is False and read.norm_output is False  # getattr(self.config, "fc_norm", False), likewise
    llama = LlamaConfig()  # what transformers gives vLLM for the other absent keys
    assert read.max_position_embeddings == llama.max_position_embeddings == CONFIG_DEFAULTS["max_position_embeddings"]
    assert read.rope_parameters["rope_theta"] == llama.rope_parameters["rope_theta"] == CONFIG_DEFAULTS["rope_theta"]


def test_reasoning_field_under_either_name():
    assert reasoning_of({"reasoning": "a", "reasoning_content": "b"}) == "a"
    assert reasoning_of({"reasoning_content": "b"}) == "b"
    assert reasoning_of({"reasoning": None, "content": "c"}) is None


def test_served_dtype_is_read_from_the_last_start(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("=== start 1\nInitializing engine (v0.32) with config: model='m', dtype=torch.float32, seed=0\n"
                   "=== start 2\nInitializing engine (v0.32) with config: model='m', dtype=torch.bfloat16, seed=0\n")
    assert served_dtype(log) == "bfloat16"
    assert served_dtype(tmp_path / "absent.log") is None


# ----------------------------------------------------------------------------- EAGLE-3.1 in vLLM's own model


class _CachedCausalAttention(torch.nn.Module):
    """Causal attention over a growing KV list, for one sequence: what vLLM's attention kernel computes
    from its KV cache when it drafts the chain at the last position (the kernel itself needs the
    engine's forward context and metadata, which this test does without)."""

    def __init__(self, n_head, n_kv, head_dim):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = n_head, n_kv, head_dim
        self.k = self.v = None

    def forward(self, q, k, v):  # [S, heads·hd] each, as vLLM's Attention takes them
        S = q.shape[0]
        q, k, v = (x.view(S, n, self.head_dim).transpose(0, 1) for x, n in ((q, self.n_head), (k, self.n_kv), (v, self.n_kv)))
        seen = 0 if self.k is None else self.k.shape[1]
        self.k = k if self.k is None else torch.cat([self.k, k], 1)
        self.v = v if self.v is None else torch.cat([self.v, v], 1)
        mask = torch.arange(seen + S)[None] <= (seen + torch.arange(S))[:, None]
        out = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=self.n_head != self.n_kv)
        return out.transpose(0, 1).reshape(S, -1)


@pytest.fixture(scope="module")
def vllm_process():
    """vLLM's single-process distributed state (gloo), which its linear layers ask for; torn down after."""
    from vllm.distributed import parallel_state

    yield parallel_state
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def _vllm_draft(draft_dir, parallel_state, k=2):
    """The exported draft in vLLM's own ``Eagle3LlamaForCausalLM``, in this process (no server, no engine):
    config.json parsed by vLLM as the toy target's speculative config for the draft's kind (eagle3, with
    parallel drafting for P-EAGLE: ``vllm_facts.speculative_config``), the tensors through the model's
    ``load_weights`` and vLLM's ``process_weights_after_loading``. Returns ``(model, vllm_config)``."""
    import json
    import socket

    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    method = method_of(json.loads((Path(draft_dir) / "config.json").read_text()))
    args = EngineArgs(model=str(TOY_TARGET), dtype="float32", skip_tokenizer_init=True, max_model_len=256, enforce_eager=True,
                      speculative_config=speculative_config(method, k, draft_dir))
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        if not parallel_state.model_parallel_is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
            parallel_state.initialize_model_parallel(1, 1)
        model = Eagle3LlamaForCausalLM(vllm_config=vllm_config)
        model.load_weights(load_file(str(Path(draft_dir) / "model.safetensors")).items())
        process_weights_after_loading(model, vllm_config.speculative_config.draft_model_config, torch.device("cpu"))
    attn = model.model.layers[0].self_attn
    attn.attn = _CachedCausalAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim)
    return model.eval(), vllm_config


# speculators' trainer's EAGLE-3 default (one input_norm over fc's whole input, the normed output fed forward);
# the parallel kind (P-EAGLE) has its own test below
VARIANTS = {**{kind: flags for kind, flags in KINDS.items() if not flags["parallel_drafting"]},
            "speculators-default": {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}}


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_vllm_runs_an_exported_draft_of_each_kind_as_we_do(kind, vllm_process, tmp_path):
    """An exported draft (norms and every weight away from their initial values) loaded into vLLM 0.32's
    own EAGLE-3 model: vLLM reads the kind's switches from config.json, and its combine_hidden_states,
    its forward over the prefix (step 0) and one more draft step at the last position, fed vLLM's own
    aux_output, give our training-time test's outputs; so do its logits' greedy target ids. EAGLE-3.1
    (fc_norm, norm_output) changes what vLLM computes in the way it changes ours."""
    from transformers import AutoConfig
    from vllm.config import set_current_vllm_config

    from eaglenest.draft.export import write_draft
    from eaglenest.draft.model import Eagle3Draft
    from eaglenest.draft.vocab import maps_from_ids
    from eaglenest.states.target import TargetFacts
    from eaglenest.validation.predict import load_exported_draft

    target = AutoConfig.from_pretrained(TOY_TARGET)
    info = TargetFacts.of(target, [1, 14, 25], str(TOY_TARGET))
    cfg = DraftConfig.from_target(info, 48, **VARIANTS[kind])
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    for p in draft.parameters():  # every norm weight away from 1 (fc_norm's too), so each weight counts
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3 if p.dim() == 1 else 0.05)
    d2t, t2d = maps_from_ids(torch.arange(0, 96, 2), target.vocab_size)
    draft.set_target(torch.randn(target.vocab_size, target.hidden_size), d2t, t2d)
    write_draft(tmp_path, cfg, info, draft.state_dict(), None, None, "float32")
    ours, _ = load_exported_draft(tmp_path, draft.embed_weight)
    vllm, vllm_config = _vllm_draft(tmp_path, vllm_process)
    parsed = vllm_config.speculative_config.draft_model_config.hf_config
    assert {k: bool(getattr(parsed, k)) for k in SWITCHES} == {k: getattr(cfg, k) for k in SWITCHES}
    assert (parsed.fc_norm, parsed.norm_output) == ((kind == "eagle3.1"), kind != "eagle3")
    assert (vllm.model.fc_norm is not None) == cfg.fc_norm
    assert (vllm.model.input_norm is not None) == cfg.norm_before_fc

    T = 10
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(3, target.vocab_size, (T + 2,), generator=g)
    aux = torch.randn(T + 2, 3 * target.hidden_size, generator=g)

    def embed(ids):
        return F.embedding(ids, draft.embed_weight)

    with torch.no_grad(), set_current_vllm_config(vllm_config):
        ttt = ours(seq[None], aux[None], ttt_length=2)  # step 1 at base T-1 reads token T+1
        fused = vllm.combine_hidden_states(aux[:T])
        torch.testing.assert_close(fused, ours.combine(aux[:T]), rtol=1e-5, atol=1e-5)
        assert torch.allclose(fused, aux[:T] @ draft.fc.weight.T, atol=1e-3) != (cfg.fc_norm or cfg.norm_before_fc)  # the norms act
        normed0, fed0 = vllm.model(seq[1 : T + 1], torch.arange(T), fused, embed(seq[1 : T + 1]))
        torch.testing.assert_close(normed0, ttt[0][0, :T], rtol=1e-5, atol=1e-5)
        assert torch.equal(fed0, normed0) == cfg.norm_output  # aux_output: the normed output with norm_output
        normed1, _ = vllm.model(seq[T + 1 :], torch.tensor([T]), fed0[-1:], embed(seq[T + 1 :]))
        torch.testing.assert_close(normed1[0], ttt[1][0, T - 1], rtol=1e-5, atol=1e-5)
        greedy = vllm.compute_logits(normed1).argmax(-1)
    assert greedy.tolist() == ours.draft_ids()[ours.lm_head(ttt[1][0, T - 1]).argmax(-1)].view(1).tolist()


def test_vllm_runs_an_exported_peagle_draft_in_one_pass_as_we_do(vllm_process, tmp_path):
    """An exported P-EAGLE draft loaded into vLLM 0.32's own EAGLE-3 model under parallel drafting: vLLM
    loads mask_hidden, its proposer's own code takes our mask token from config.json and fuses mask_hidden
    through combine_hidden_states, and ONE forward over the inputs its proposer builds (the prefix with
    the bonus token last, then k-1 mask slots at the next positions) gives our one-forward outputs at
    every drafted position, and the same greedy tokens as our offline proposal."""
    import types

    from transformers import AutoConfig
    from vllm.config import set_current_vllm_config
    from vllm.v1.spec_decode import llm_base_proposer

    from eaglenest.draft.export import write_draft
    from eaglenest.draft.model import Eagle3Draft
    from eaglenest.draft.vocab import maps_from_ids
    from eaglenest.states.target import TargetFacts
    from eaglenest.validation.predict import load_exported_draft

    k = 3
    target = AutoConfig.from_pretrained(TOY_TARGET)
    info = TargetFacts.of(target, [1, 14, 25], str(TOY_TARGET))
    cfg = DraftConfig.from_target(info, 48, "peagle")
    assert cfg.mask_token_id == target.vocab_size - 1  # the default: the target's last id
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    for p in draft.parameters():  # every norm weight away from 1, mask_hidden away from its start
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3 if p.dim() == 1 else 0.05)
    torch.nn.init.normal_(draft.mask_hidden, std=1.0)
    d2t, t2d = maps_from_ids(torch.arange(0, 96, 2), target.vocab_size)
    draft.set_target(torch.randn(target.vocab_size, target.hidden_size), d2t, t2d)
    write_draft(tmp_path, cfg, info, draft.state_dict(), None, None, "float32")
    ours, _ = load_exported_draft(tmp_path, draft.embed_weight)
    vllm, vllm_config = _vllm_draft(tmp_path, vllm_process, k=k)
    spec = vllm_config.speculative_config
    assert spec.parallel_drafting and vllm.use_parallel_drafting
    torch.testing.assert_close(vllm.mask_hidden, draft.mask_hidden.detach())  # loaded, not left at zeros
    # vLLM's proposer's own reading of the mask token and of the masked positions' hidden state
    proposer = types.SimpleNamespace(draft_model_config=spec.draft_model_config, pass_hidden_states_to_model=True,
                                     hidden_size=cfg.hidden_size, dtype=torch.float32, device=torch.device("cpu"))
    llm_base_proposer.SpecDecodeBaseProposer._init_parallel_drafting_params(proposer)
    assert proposer.parallel_drafting_token_id == cfg.mask_token_id

    T = 10
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(3, target.vocab_size - 1, (T + 1,), generator=g)
    aux = torch.randn(T + 1, 3 * target.hidden_size, generator=g)

    def embed(ids):
        return F.embedding(ids, draft.embed_weight)

    with torch.no_grad(), set_current_vllm_config(vllm_config):
        masked_hidden = vllm.combine_hidden_states(vllm.mask_hidden.view(-1))  # what load_model stores
        torch.testing.assert_close(masked_hidden, ours.combine(ours.mask_hidden)[0], rtol=1e-5, atol=1e-5)
        ttt = ours(seq[None], aux[None], ttt_length=k)
        # after the target verified tokens 0..T-1 and sampled token T: tokens 1..T (T the bonus) at
        # positions 0..T-1, then k-1 mask tokens at T..T+k-2 (llm_base_proposer.set_inputs_first_pass)
        ids = torch.cat([seq[1:], torch.full((k - 1,), proposer.parallel_drafting_token_id)])
        hidden = torch.cat([vllm.combine_hidden_states(aux[:T]), masked_hidden.expand(k - 1, -1)])
        normed, _ = vllm.model(ids, torch.arange(T + k - 1), hidden, embed(ids))
        for j in range(k):
            torch.testing.assert_close(normed[T - 1 + j], ttt[j][0, T - 1], rtol=1e-5, atol=1e-5)
        greedy = vllm.compute_logits(normed[T - 1 :]).argmax(-1)
    assert greedy.tolist() == ours.propose(seq, aux, k)[T - 1].tolist()
