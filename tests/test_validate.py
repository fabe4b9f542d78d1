"""Validation and what it is built from: vLLM's /metrics counters and their differences (vllm_format,
validate), acceptance math and the offline chain simulation (predict), the report's keys, its
disagreement warning and its self-contained HTML (report), the requests (the traces client). Fast: no vLLM."""

import json
import math
import re

import pytest
import torch

from eaglenest import report, validate
from eaglenest.model import Eagle3Draft
from eaglenest.predict import counts_from_accepted, load_exported_draft, offline_acceptance, simulate_chain
from eaglenest.report import (bar_chart, build_report, export_differences, findings, line_chart, nice_ticks,
                              read_train_metrics, render_html, train_summary, write_report)
from eaglenest.validate import counter_delta
from eaglenest.vllm_format import acceptance, spec_counters, speculative_config
from test_train import data, run  # noqa: F401  (data: a fixture, the pipeline of a tiny random target)

# What vLLM 0.32's /metrics serves with a speculative config (prometheus_client text format), two engines.
METRICS_BEFORE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="toy"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="toy"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="toy"} 5.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="toy"} 1.7629e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="toy"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="toy"} 15.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="toy"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="toy"} 3.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="toy",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="toy",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="toy",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="toy",position="0"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="toy",position="1"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="toy",position="2"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="toy",position="0"} 1.7629e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="toy"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="toy"} 2.0
python_info{implementation="CPython",major="3",minor="11",patchlevel="9",version="3.11.9"} 1.0
weird_metric{path="a \\"quoted\\", {braced} value\\\\",other="x"} NaN 1700000000000
"""


def _after(before: str, scale: dict) -> str:
    """The same exposition with each spec counter's value raised: value + scale[name] * (1 + position)."""
    out = []
    for line in before.splitlines():
        m = re.match(r"^(vllm:spec_decode_\w+_total)(\{.*\}) (\S+)$", line)
        if m and m.group(1) in scale:
            pos = re.search(r'position="(\d)"', line)
            add = scale[m.group(1)] * (1 if pos is None else 3 - int(pos.group(1)))
            line = f"{m.group(1)}{m.group(2)} {float(m.group(3)) + add}"
        out.append(line)
    return "\n".join(out) + "\n"


def test_spec_counters_refuse_text_that_is_not_prometheus():
    with pytest.raises(ValueError):
        spec_counters("not a metric line at all {\n")


def test_spec_counters_sum_engines_and_keep_positions():
    c = spec_counters(METRICS_BEFORE)
    assert c == {"drafts": 15.0, "draft_tokens": 45.0, "accepted": 15.0, "accepted_per_pos": {0: 9.0, 1: 5.0, 2: 1.0}}
    assert spec_counters("# no speculation here\nvllm:num_requests_running 0\n")["drafts"] == 0.0


def test_counter_differences_give_the_run_alone():
    after = _after(METRICS_BEFORE, {
        "vllm:spec_decode_num_drafts_total": 50,  # two engines: +100 drafts
        "vllm:spec_decode_num_draft_tokens_total": 150,  # +300 = 3 per draft
        "vllm:spec_decode_num_accepted_tokens_total": 60,  # +120
        "vllm:spec_decode_num_accepted_tokens_per_pos_total": 10,  # +60, +40, +20 over two engines
    })
    delta = counter_delta(spec_counters(METRICS_BEFORE), spec_counters(after))
    assert delta == {"drafts": 100.0, "draft_tokens": 300.0, "accepted": 120.0, "accepted_per_pos": {0: 60.0, 1: 40.0, 2: 20.0}}
    stats = acceptance(delta, 3)
    assert stats["acceptance_length"] == pytest.approx(2.2)  # 1 + 120/100
    assert stats["acceptance_rate"] == pytest.approx(0.4)  # 120/300
    assert stats["per_position"] == pytest.approx([0.6, 0.4, 0.2])
    # the per-position rates add up to the accepted tokens per draft
    assert sum(stats["per_position"]) == pytest.approx(stats["acceptance_length"] - 1)
    with pytest.raises(validate.ValidationError, match="restarted"):
        counter_delta(spec_counters(after), spec_counters(METRICS_BEFORE))


def test_acceptance_math_edge_cases():
    none = acceptance({"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": {}}, 3)
    assert none["acceptance_length"] is None and none["per_position"] is None
    # all rejected: length 1; all accepted: k + 1
    assert acceptance(counts_from_accepted([0, 0, 0], 3), 3)["acceptance_length"] == 1.0
    full = acceptance(counts_from_accepted([3, 3], 3), 3)
    assert full["acceptance_length"] == 4.0 and full["acceptance_rate"] == 1.0 and full["per_position"] == [1.0, 1.0, 1.0]
    mixed = counts_from_accepted([0, 1, 3, 2], 3)
    assert mixed == {"drafts": 4, "draft_tokens": 12, "accepted": 6, "accepted_per_pos": {0: 3, 1: 2, 2: 1}}
    # per-position rates never rise with the position: position i needs all before it
    per = acceptance(mixed, 3)["per_position"]
    assert per == sorted(per, reverse=True)


def test_simulate_chain_walks_like_greedy_verification():
    tokens = list(range(100, 112))  # prompt 100..103, completion 104..111 (index 4..11)
    k = 3
    perfect = torch.tensor([[100 + t + 2 + j for j in range(k)] for t in range(len(tokens))])  # row t: tokens[t+2..]
    acc = simulate_chain(perfect, tokens, 4, k)
    # m = 4: accept 5,6,7 (+bonus 8) -> m = 8: accept 9,10,11 -> end
    assert acc == [3, 3]
    wrong = torch.full((len(tokens), k), -1)
    assert simulate_chain(wrong, tokens, 4, k) == [0] * 7  # one token a step: 7 steps after the first token
    # k = 1: one draft token per step, each accepted; the last bonus would fall past the end
    assert simulate_chain(perfect[:, :1], tokens, 4, 1) == [1, 1, 1, 1]
    # a completion of one token: no draft is ever verified
    assert simulate_chain(perfect, tokens[:5], 4, k) == []


def test_simulate_chain_verifies_past_the_end_like_vllm():
    """vLLM verifies a whole draft before its stop check: a draft holding the eos and then what the
    target says after it is accepted in full (and counted), though the request ends at the eos."""
    tokens = list(range(100, 112))
    k = 3
    perfect = torch.tensor([[100 + t + 2 + j for j in range(k)] for t in range(len(tokens))])
    # completion ends at index 9 (the eos, say); 10 and 11 are the target's continuation after it
    assert simulate_chain(perfect, tokens, 4, k, end=9) == [3, 3]  # the second draft covers 9, 10, 11
    assert simulate_chain(perfect, tokens[:10], 4, k) == [3, 1]  # without the continuation: rejected there


# ----------------------------------------------------------------------------- offline, tiny random target

VOCAB, HIDDEN = 100, 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama target and an untrained draft exported for it in vLLM's format."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglenest.export import write_draft
    from eaglenest.model import DraftConfig, Eagle3Draft

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1,
                      bos_token_id=0, pad_token_id=2)
    target = LlamaForCausalLM(cfg).eval()
    dcfg = DraftConfig(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, vocab_size=VOCAB, draft_vocab_size=40, target_hidden_size=HIDDEN,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=256)
    draft = Eagle3Draft(dcfg)
    ids = torch.arange(0, VOCAB, 2)[:40]  # every other target id: d2t = offsets, not zero
    d2t, t2d = ids - torch.arange(40), torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    draft.set_target(target.get_input_embeddings().weight, d2t, t2d)
    info = {"aux_layers": [1, 2, 3], "target": "tiny", "num_hidden_layers": 4, "hidden_size": HIDDEN}
    write_draft(root / "draft", dcfg, info, draft.state_dict(), None, None, "float32")
    return target, root / "draft", draft


def _sequences(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, VOCAB, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist(),
             torch.randint(3, VOCAB, (int(torch.randint(10, 30, (1,), generator=g)),), generator=g).tolist())
            for _ in range(n)]


def test_exported_draft_loads_as_vllm_reads_it(tiny):
    _, draft_dir, original = tiny
    emb = torch.randn(VOCAB, HIDDEN)
    model, config = load_exported_draft(draft_dir, emb)
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert torch.equal(model.d2t, original.d2t) and torch.equal(model.fc.weight, original.fc.weight)
    assert model.config.norm_before_residual is False and torch.equal(model.embed_weight, emb)
    assert model.rotary_emb.inv_freq.dtype == torch.float32
    bf16, _ = load_exported_draft(draft_dir, emb, dtype=torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16 and bf16.rotary_emb.inv_freq.dtype == torch.float32


def test_propose_matches_a_step_by_step_proposer(tiny):
    """The batched chains equal a plain loop that drafts at one position with a growing KV list."""
    target, draft_dir, _ = tiny
    draft, _ = load_exported_draft(draft_dir, target.get_input_embeddings().weight)
    T, k = 12, 3
    tokens = torch.randint(3, VOCAB, (T,))
    aux = torch.randn(T, 3 * HIDDEN)
    batched = draft.propose(tokens, aux, k)
    assert batched.shape == (T, k) and (batched[-1] == -1).all()
    assert set(batched[:-1].flatten().tolist()) <= set(draft.draft_ids().tolist())  # target ids of draft tokens
    with torch.no_grad():
        nxt = tokens[1:]
        h0 = draft.fc(aux[:-1]).unsqueeze(0)
        emb0 = torch.nn.functional.embedding(nxt, draft.embed_weight).unsqueeze(0)
        cos, sin = draft.rotary_emb(h0, torch.arange(T - 1).unsqueeze(0))
        causal = torch.ones(T - 1, T - 1, dtype=torch.bool).tril()
        out0, kv0 = draft.midlayer(emb0, h0, cos, sin, [], causal)
        for t in (0, 4, T - 2):
            hidden = out0[:, t : t + 1]
            tok = draft.draft_ids()[(draft.norm(hidden) @ draft.lm_head.weight.T).argmax(-1)]
            chain = [int(tok)]
            keys = [(kv0[0][:, :, : t + 1], kv0[1][:, :, : t + 1])]
            for j in range(1, k):
                emb = torch.nn.functional.embedding(tok, draft.embed_weight)
                c, s = draft.rotary_emb(hidden, torch.tensor([[t + j]]))
                mask = torch.ones(1, t + 1 + j, dtype=torch.bool)
                hidden, kv = draft.midlayer(emb, hidden, c, s, keys, mask)
                keys.append(kv)
                tok = draft.draft_ids()[(draft.norm(hidden) @ draft.lm_head.weight.T).argmax(-1)]
                chain.append(int(tok))
            assert batched[t].tolist() == chain, t


def test_offline_acceptance_on_a_tiny_random_target(tiny):
    target, draft_dir, _ = tiny
    k = 3
    out = offline_acceptance(None, draft_dir, k=k, sequences=_sequences(), dtype="float32", device="cpu",
                             model=target, progress=False)
    assert 1.0 <= out["acceptance_length"] <= k + 1
    assert 0.0 <= out["acceptance_rate"] <= 1.0 and len(out["per_position"]) == k
    assert out["per_position"] == sorted(out["per_position"], reverse=True)
    assert out["drafts"] > 0 and out["draft_tokens"] == k * out["drafts"]
    assert out["acceptance_length"] == pytest.approx(1 + sum(out["per_position"]))
    assert out["tokens_source"] == "given" and out["aux_layers"] == [1, 2, 3]
    assert 0.0 <= out["target_agreement"] <= 1.0  # random sequences: not this target's greedy answers


def test_offline_acceptance_counts_what_a_perfect_chain_would(tiny, monkeypatch):
    """With proposals equal to the sequence itself every draft is fully accepted: length k + 1
    (but for the last steps, where fewer than k tokens remain)."""
    target, draft_dir, _ = tiny
    k = 2

    def oracle(draft, tokens, aux, k):
        T = len(tokens)
        return torch.tensor([[int(tokens[t + 2 + j]) if t + 2 + j < T else -1 for j in range(k)] for t in range(T)])

    monkeypatch.setattr(Eagle3Draft, "propose", oracle)
    seqs = [(list(range(3, 8)), list(range(10, 10 + 3 * 7 + 1)))]  # first token + 7 full steps of 3
    out = offline_acceptance(None, draft_dir, k=k, sequences=seqs, dtype="float32", device="cpu", model=target, progress=False)
    assert out["acceptance_length"] == pytest.approx(k + 1) and out["per_position"] == [1.0, 1.0]
    assert out["drafts"] == 7


def test_offline_generates_greedy_sequences_when_none_given(tiny, tmp_path):
    """prompts -> the target's own greedy answers: its agreement with them is then 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target, draft_dir, _ = tiny
    vocab = {f"t{i}": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core,
                                  bos_token="t0", eos_token="t1", pad_token="t2", unk_token="t3",
                                  chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    tok.save_pretrained(tmp_path / "tok")
    target.generation_config.eos_token_id = 1
    prompts = [{"id": "a", "messages": [{"role": "user", "content": "t5 t6 t7"}]},
               {"id": "b", "messages": [{"role": "user", "content": "t9 t8"}]}]
    out = offline_acceptance(tmp_path / "tok", draft_dir, k=2, prompts=prompts, max_tokens=12, dtype="float32",
                             device="cpu", model=target, progress=False)
    assert out["tokens_source"] == "generated" and out["target_agreement"] == 1.0
    assert 1.0 <= out["acceptance_length"] <= 3.0 and out["sequences"] == 2


# ----------------------------------------------------------------------------- report

RUNS = {
    "baseline": {"output_tokens_per_s": 100.0, "mean_latency_s": 1.0, "completion_tokens": 4000, "wall_s": 40.0,
                 "answers": [{"completion_token_ids": [1, 2], "prompt_token_ids": [0]}]},
    "eagle3": {"output_tokens_per_s": 180.0, "acceptance_length": 2.5, "acceptance_rate": 0.5,
               "per_position": [0.8, 0.45, 0.25], "answers": []},
    "ngram": {"output_tokens_per_s": 110.0, "acceptance_length": 1.3, "acceptance_rate": 0.1,
              "per_position": [0.2, 0.07, 0.03], "answers": []},
}
OFFLINE = {"acceptance_length": 2.6, "acceptance_rate": 0.53, "per_position": [0.82, 0.48, 0.3]}
CURVES = {"step": [1.0, 2.0, 3.0], "loss": [3.0, 2.0, 1.5], "loss_0": [1.0, 0.7, 0.5], "loss_1": [1.2, 0.9, 0.6],
          "acc_0": [0.3, 0.6, 0.8], "acc_1": [0.2, 0.4, 0.6], "ttt_length": 2}


def _report(**over):
    kw = dict(target="toy/target", draft_dir="draft/checkpoint", k=3, prompts=40, max_tokens=256, runs=RUNS,
              offline=OFFLINE, train=train_summary(CURVES, 3), checks={"served_dtype": "bfloat16"},
              settings={"concurrency": 8})
    kw.update(over)
    return build_report(**kw)


def test_report_holds_the_promised_keys():
    r = _report()
    for key in ("target", "draft", "num_speculative_tokens", "prompts", "eagle3", "ngram", "baseline", "offline", "speedup"):
        assert key in r, key
    for run in ("eagle3", "ngram"):
        assert {"acceptance_length", "acceptance_rate", "per_position", "output_tokens_per_s"} <= set(r[run])
    assert "output_tokens_per_s" in r["baseline"] and {"acceptance_length", "per_position"} <= set(r["offline"])
    assert r["speedup"] == pytest.approx(1.8) and r["agreement"] == pytest.approx(2.5 / 2.6)
    assert "answers" not in r["baseline"]
    json.dumps(r)  # serialisable as is
    assert r["warnings"] == []


def test_disagreement_warning_fires_below_80_percent():
    assert not [w for w in findings({"eagle3": {"acceptance_length": 2.01}, "offline": {"acceptance_length": 2.5}})
                if w["kind"] == "disagreement"]  # 80.4%
    low = findings({"eagle3": {"acceptance_length": 1.99}, "offline": {"acceptance_length": 2.5}})  # 79.6%
    (w,) = [w for w in low if w["kind"] == "disagreement"]
    assert "below 80%" in w["message"]
    text = " ".join(w["causes"])
    for cause in ("off by one", "norm_before_residual", "d2t", "dtype", "chat template", "too little data"):
        assert cause in text, cause
    r = _report(runs={**RUNS, "eagle3": {**RUNS["eagle3"], "acceptance_length": 1.2}})
    assert r["warnings"][0]["kind"] == "disagreement"
    html = render_html(r, CURVES)
    top = html.index("<h2>Summary</h2>")
    assert "disagree" in html[:top] and "off by one" in html[:top]  # said in words at the top


def test_html_is_self_contained_with_svg_plots(tmp_path):
    r = _report()
    write_report(r, tmp_path / "v.json", tmp_path / "v.html", CURVES)
    html = (tmp_path / "v.html").read_text()
    assert json.loads((tmp_path / "v.json").read_text())["speedup"] == pytest.approx(1.8)
    assert not re.search(r"https?://", html) and "<script" not in html and "<link" not in html and "<img" not in html
    assert html.count("<svg") == 4  # loss, accuracy, per-position acceptance, throughput
    for title in ("Training loss", "Training top-1 accuracy", "Per-position acceptance rate", "Throughput in vLLM"):
        assert title in html
    assert "<polyline" in html and "<rect" in html


def test_train_summary_and_metrics_csv(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("step,epoch,lr,loss,loss_0,loss_1,acc_0,acc_1,grad_norm,tokens,tokens_per_s\n"
                    "1,0,1e-4,3.0,1.0,1.2,0.5,0.25,1.0,100,10\n2,0,1e-4,2.0,0.5,0.7,0.8,0.5,1.0,100,10\n")
    curves = read_train_metrics(path)
    assert curves["ttt_length"] == 2 and curves["acc_1"] == [0.25, 0.5]
    s = train_summary(curves, 2)
    assert s["steps"] == 2 and s["acc"] == [0.8, 0.5]
    assert s["predicted_per_position"] == pytest.approx([0.8, 0.4])
    assert s["predicted_acceptance_length"] == pytest.approx(2.2)
    assert train_summary(curves, 3)["predicted_acceptance_length"] is None  # k beyond the trained steps


def test_speculative_configs_are_what_vllm_parses(tmp_path):
    from vllm.config.speculative import SpeculativeConfig

    assert speculative_config("baseline", 3) is None
    e = speculative_config("eagle3", 3, tmp_path / "d")
    assert e == {"method": "eagle3", "model": str((tmp_path / "d").resolve()), "num_speculative_tokens": 3}
    n = speculative_config("ngram", 3, ngram={"prompt_lookup_max": 4, "prompt_lookup_min": 2})
    fields = SpeculativeConfig.__dataclass_fields__ if hasattr(SpeculativeConfig, "__dataclass_fields__") else SpeculativeConfig.model_fields
    assert set(n) <= set(fields) and set(e) <= set(fields)


def test_plots_handle_degenerate_data():
    assert "no data" in line_chart([("a", [], [])], title="t", xlabel="x", ylabel="y")
    assert "<svg" in bar_chart(["a"], [("s", [None])], title="t", xlabel="x", ylabel="y")
    assert nice_ticks(0, 1)[0] == 0 and nice_ticks(0, 1)[-1] >= 1
    assert nice_ticks(5, 5)  # flat data still gets an axis


def test_log_ticks_are_round():
    from eaglenest.report import log_ticks

    ticks = [round(10**t, 6) for t in log_ticks(math.log10(0.3), math.log10(25))]
    assert ticks == [0.5, 1.0, 2.0, 5.0, 10.0, 20.0]
    assert len(log_ticks(math.log10(3.1), math.log10(3.9))) >= 2  # a narrow range still gets an axis


def test_load_warning_names_unreliable_throughput(monkeypatch):
    monkeypatch.setattr(report.os, "cpu_count", lambda: 2)
    busy = findings({"baseline": {"load_average": [1.0, 4.5]}, "eagle3": {}, "ngram": {}})
    assert [w["kind"] for w in busy] == ["load"] and "unreliable" in busy[0]["message"]
    assert findings({"baseline": {"load_average": [1.0, 2.5]}}) == []


def test_measure_run_refuses_a_speculative_config_in_extra_args(tmp_path):
    from eaglenest.server import ServerConfig

    srv = ServerConfig(model="x", extra_args=["--speculative-config", "{}"])
    with pytest.raises(validate.ValidationError, match="server.extra_args"):
        validate.measure_run("eagle3", srv, {"method": "ngram", "num_speculative_tokens": 3}, [], {}, log_dir=tmp_path)


def test_resolve_settings_fills_defaults():
    s = validate.resolve_settings({"ngram": {"prompt_lookup_max": 3}}, {"max_tokens": 77})
    assert s["max_tokens"] == 77 and s["num_speculative_tokens"] == 3 and s["concurrency"] == 8
    assert s["ngram"] == {"prompt_lookup_max": 3, "prompt_lookup_min": 2} and s["offline"]["tokens"] == "generate"


def test_export_differences_name_what_vllm_would_read_wrong(data, tmp_path):  # noqa: F811
    from safetensors.torch import load_file, save_file

    from eaglenest.export import export_draft

    run(data, tmp_path / "train")
    ckpt = tmp_path / "train" / "checkpoint.safetensors"
    export_draft(ckpt, tmp_path / "draft")
    assert export_differences(tmp_path / "draft", ckpt) == []

    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    config["norm_before_residual"] = True
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tmp_path / "draft" / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + torch.arange(len(tensors["d2t"]))  # target ids instead of offsets
    save_file(tensors, str(tmp_path / "draft" / "model.safetensors"))
    diffs = export_differences(tmp_path / "draft", ckpt)
    assert any("aux layer ids" in x for x in diffs) and any("norm_before_residual" in x for x in diffs)
    assert any("not offsets" in x for x in diffs)
    found = findings({"eagle3": {"acceptance_length": 1.0}, "offline": {"acceptance_length": 2.0},
                      "checks": {"export_vs_training": diffs}})
    assert [w["kind"] for w in found] == ["disagreement", "export"]
    causes = found[0]["causes"]
    assert "FOUND" in causes[0] and "FOUND" in causes[1] and "FOUND" in causes[2]


def test_client_counts_tokens_and_repeats_until_min_seconds():
    from stub_server import MODEL, StubServer

    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(5)]
    body = validate.request_settings(16)
    with StubServer(delay=0.05, answer_tokens=10) as stub:
        one = validate.run_requests(stub.url, MODEL, prompts, body, concurrency=2)
        tokens = sum(len(a["completion_token_ids"]) for a in one["answers"])
        assert one["passes"] == 1 and one["requests"] == 5 and one["completion_tokens"] == tokens > 0
        assert [a["id"] for a in one["answers"]] == [p["id"] for p in prompts]
        assert all(a["completion_token_ids"] and a["prompt_token_ids"] for a in one["answers"])
        assert one["output_tokens_per_s"] == pytest.approx(tokens / one["wall_s"], rel=0.01)
        more = validate.run_requests(stub.url, MODEL, prompts, body, concurrency=5, min_seconds=0.3)
        assert more["passes"] >= 2 and more["wall_s"] >= 0.3 and more["completion_tokens"] == tokens * more["passes"]
        assert len(more["answers"]) == 5  # the first pass's answers


def test_client_retries_then_fails_with_the_url_and_status():
    """Validation's requests go through the traces client: its retry policy, its error messages."""
    from stub_server import MODEL, StubServer

    prompts = [{"id": "a", "messages": [{"role": "user", "content": "hello"}]}]
    with StubServer(fail_times=1, fail_status=503) as stub:  # one 503, then an answer: retried
        assert validate.run_requests(stub.url, MODEL, prompts, validate.request_settings(8))["requests"] == 1
    with StubServer(reject_match="hello") as stub:  # a 400 is not retried
        with pytest.raises(validate.ValidationError,
                           match=r"requests to http://127\.0\.0\.1:\d+ failed: .*1 of 1 requests failed; first: HTTP 400"):
            validate.run_requests(stub.url, MODEL, prompts, validate.request_settings(8))


def test_request_settings_are_greedy_whatever_the_generation_config_says():
    s = validate.request_settings(32, {"temperature": 0.7, "max_tokens": 4096, "max_error_fraction": 0.1,
                                       "chat_template_kwargs": {"enable_thinking": False},
                                       "extra_body": {"temperature": 1.0, "top_k": 5}})
    assert s == {"temperature": 0.0, "max_tokens": 32, "chat_template_kwargs": {"enable_thinking": False},
                 "extra_body": {"top_k": 5}}
