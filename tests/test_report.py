"""report: the findings (keys, the disagreement warning and its causes, the export check) and the
self-contained HTML page with its SVG plots. Fast: no vLLM."""

import json
import math
import re

import pytest
import torch

from eaglenest.validation import report
from eaglenest.validation.plots import bar_chart, line_chart, nice_ticks
from eaglenest.validation.page import render_html
from eaglenest.validation.report import export_differences, findings, read_train_metrics, train_summary, write_report
from tests.support.reports import CURVES, RUNS, WARN_BELOW, sample_report
from tests.support.training_run import run


def test_report_holds_the_promised_keys():
    r = sample_report()
    for key in ("target", "draft", "num_speculative_tokens", "prompts", "eagle3", "ngram", "baseline", "offline", "speedup"):
        assert key in r, key
    for name in ("eagle3", "ngram"):
        assert {"tokens_per_step", "drafted_share", "acceptance_length", "acceptance_rate", "per_position",
                "output_tokens_per_s"} <= set(r[name])
    assert {"output_tokens_per_s", "tokens_per_step", "drafted_share"} <= set(r["baseline"])
    assert {"tokens_per_step", "drafted_share", "acceptance_length", "per_position"} <= set(r["offline"])
    # the headline speed-up is one request at a time's; the configured concurrency's beside it
    assert r["speedup"] == pytest.approx(2.2) and r["speedup_concurrent"] == pytest.approx(1.8)
    assert r["ngram_speedup"] == pytest.approx(1.2) and r["ngram_speedup_concurrent"] == pytest.approx(1.1)
    assert r["agreement"] == pytest.approx(2.45 / 2.55)  # per target step
    assert "answers" not in r["baseline"]
    json.dumps(r)  # serialisable as is
    assert r["warnings"] == []


def test_disagreement_warning_fires_below_80_percent():
    # by tokens per target step: vLLM's per-drafted-step figures here would say the opposite each time
    assert not [w for w in findings({"eagle3": {"tokens_per_step": 2.01, "acceptance_length": 1.5},
                                     "offline": {"tokens_per_step": 2.5, "acceptance_length": 2.5}}, WARN_BELOW)
                if w["kind"] == "disagreement"]  # 80.4%
    low = findings({"eagle3": {"tokens_per_step": 1.99, "acceptance_length": 2.5},
                    "offline": {"tokens_per_step": 2.5, "acceptance_length": 2.5}}, WARN_BELOW)  # 79.6%
    (w,) = [w for w in low if w["kind"] == "disagreement"]
    assert "makes 1.990 tokens per target step, 80% of the offline prediction's 2.500 (below 80%" in w["message"]
    assert "acceptance length per drafted step (vLLM's figure): vLLM 2.500, offline 2.500" in w["message"]
    text = " ".join(w["causes"])
    for cause in ("off by one", "norm_before_residual", "d2t", "dtype", "chat template", "too little data"):
        assert cause in text, cause
    r = sample_report(runs={**RUNS, "eagle3": {**RUNS["eagle3"], "tokens_per_step": 1.2}})
    assert r["warnings"][0]["kind"] == "disagreement"
    html = render_html(r, CURVES)
    top = html.index("<h2>Summary</h2>")
    assert "disagree" in html[:top] and "off by one" in html[:top]  # said in words at the top


def test_html_is_self_contained_with_svg_plots(tmp_path):
    r = sample_report()
    write_report(r, tmp_path / "v.json", tmp_path / "v.html", CURVES)
    html = (tmp_path / "v.html").read_text()
    assert json.loads((tmp_path / "v.json").read_text())["speedup"] == pytest.approx(2.2)
    top = html.index("<h2>Summary</h2>")
    assert "one request at a time <b>2.20×</b>" in html[:top] and "1.80× with 8 requests in flight" in html[:top]
    # the headline is per target step; vLLM's per-drafted-step figures beside it, so labelled
    assert ("Tokens per target step in vLLM <b>2.45</b> (offline prediction 2.55, n-gram 1.30, the target alone 1; "
            "acceptance length per drafted step (vLLM&#x27;s figure): EAGLE-3 2.500 (drafted on 100% of steps), "
            "n-gram 2.600 (drafted on 20% of steps))") in html[:top]
    summary = html[top:html.index("<h2>Plots</h2>")]
    for cell in ("1 request: ms/token", "8 in flight: output tok/s", "<td>9.10</td>", "<td>110.0</td>", "<td>2.20</td>",
                 "<th>tokens per target step</th>", "<th>share of steps drafted</th>",
                 "<th>acceptance length per drafted step (vLLM&#x27;s figure)</th>", "<td>2.450</td>", "<td>1.300</td>",
                 "<td>2.550</td>", "<td>0.20</td>", "<td>1.000</td>"):
        assert cell in summary, cell
    assert not re.search(r"https?://", html) and "<script" not in html and "<link" not in html and "<img" not in html
    assert html.count("<svg") == 4  # loss, accuracy, per-position acceptance, throughput
    for title in ("Training loss", "Training top-1 accuracy", "Per-position acceptance rate (per drafted step)",
                  "Throughput in vLLM"):
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


def test_plots_handle_degenerate_data():
    assert "no data" in line_chart([("a", [], [])], title="t", xlabel="x", ylabel="y")
    assert "<svg" in bar_chart(["a"], [("s", [None])], title="t", xlabel="x", ylabel="y")
    assert nice_ticks(0, 1)[0] == 0 and nice_ticks(0, 1)[-1] >= 1
    assert nice_ticks(5, 5)  # flat data still gets an axis


def test_log_ticks_are_round():
    from eaglenest.validation.plots import log_ticks

    ticks = [round(10**t, 6) for t in log_ticks(math.log10(0.3), math.log10(25))]
    assert ticks == [0.5, 1.0, 2.0, 5.0, 10.0, 20.0]
    assert len(log_ticks(math.log10(3.1), math.log10(3.9))) >= 2  # a narrow range still gets an axis


def test_load_warning_names_unreliable_throughput(monkeypatch):
    monkeypatch.setattr(report.os, "cpu_count", lambda: 2)
    busy = findings({"baseline": {"load_average": [1.0, 4.5]}, "eagle3": {}, "ngram": {}}, WARN_BELOW)
    assert [w["kind"] for w in busy] == ["load"] and "unreliable" in busy[0]["message"]
    assert findings({"baseline": {"load_average": [1.0, 2.5]}}, WARN_BELOW) == []


def test_export_differences_name_what_vllm_would_read_wrong(data, tmp_path):
    from safetensors.torch import load_file, save_file

    from eaglenest.draft.export import export_draft

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
    found = findings({"eagle3": {"tokens_per_step": 1.0}, "offline": {"tokens_per_step": 2.0},
                      "checks": {"export_vs_training": diffs}}, WARN_BELOW)
    assert [w["kind"] for w in found] == ["disagreement", "export"]
    causes = found[0]["causes"]
    assert "FOUND" in causes[0] and "FOUND" in causes[1] and "FOUND" in causes[2]


def test_cross_checks_compare_the_runs_answers_and_vllms_prompt_tokens():
    """Outputs equal to the baseline's, finish reasons, and vLLM's prompt tokens against the
    tokenizer's chat template (the shipped toy target's tokenizer)."""
    from transformers import AutoTokenizer

    from tests.support.config import TOY_TARGET
    from eaglenest.settings import GenerationSettings
    from eaglenest.validation.report import cross_checks
    from eaglenest.states.target import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(TOY_TARGET)
    prompts = [{"messages": [{"role": "user", "content": "What is 2+3?"}]},
               {"messages": [{"role": "user", "content": "What is 7*8?"}]}]
    base = [{"prompt_token_ids": chat_prompt_ids(tok, p["messages"]), "completion_token_ids": [5, 6],
             "finish_reason": "stop"} for p in prompts]
    base[1]["prompt_token_ids"] = base[1]["prompt_token_ids"][:-1]  # vLLM templated this one differently
    runs = {"baseline": {"answers": base, "served_dtype": "bfloat16"}, "eagle3": {"answers": base},
            "ngram": {"answers": [dict(a, completion_token_ids=[5]) for a in base]}}
    checks = cross_checks(TOY_TARGET, prompts, runs, GenerationSettings.defaults(), {"dtype": "float32", "target_agreement": 1.0})
    assert checks["prompt_template_mismatches"] == 1 and checks["finish_reasons"] == {"stop": 2}
    assert checks["eagle3_outputs_equal_baseline"] == 1.0 and checks["ngram_outputs_equal_baseline"] == 0.0
    assert (checks["served_dtype"], checks["offline_dtype"]) == ("bfloat16", "float32")
    assert [w["kind"] for w in findings({"checks": checks, "prompts": 2}, WARN_BELOW)] == ["template", "dtype"]


def test_speed_warning_follows_the_one_request_speed_up():
    slow = {key: {**r, "one_request": {**r["one_request"]}} for key, r in RUNS.items()}
    slow["eagle3"]["one_request"]["output_tokens_per_s"] = 40.0  # 0.8x the target alone, 1.8x at concurrency
    (w,) = [w for w in sample_report(runs=slow)["warnings"] if w["kind"] == "speed"]
    assert "one request at a time (×0.80" in w["message"]
    assert not [w for w in sample_report()["warnings"] if w["kind"] == "speed"]


def test_learning_curve_orders_the_kept_drafts_and_adds_the_final_one():
    from eaglenest.validation.report import learning_curve

    points = [{"step": 20, "tokens": 200, "tokens_per_step": 2.4, "drafted_share": 1.0, "acceptance_length": 2.5,
               "per_position": [0.8], "prompts": 4},
              {"step": 10, "tokens": 100, "tokens_per_step": 1.9, "drafted_share": 1.0, "acceptance_length": 2.0,
               "per_position": [0.6], "prompts": 4}]
    curves = {"step": [1.0, 2.0, 30.0], "tokens": [100.0, 100.0, 100.0]}
    final = {"tokens_per_step": 2.2, "drafted_share": 1.0, "acceptance_length": 2.4, "per_position": [0.7], "requests": 12}
    curve = learning_curve(points, final, curves, 4)
    assert [p["step"] for p in curve["points"]] == [10, 20, 30]
    assert curve["points"][-1] == {"step": 30, "tokens": 300, "tokens_per_step": 2.2, "drafted_share": 1.0,
                                   "acceptance_length": 2.4, "acceptance_rate": None, "per_position": [0.7],
                                   "prompts": 4, "final": True}
    assert curve["last_gain"] == pytest.approx(-0.2)  # per target step (per drafted step it is -0.1)
    assert learning_curve([], final, curves, 4) is None


def test_ngram_finding_compares_tokens_per_target_step():
    """RUNS: n-gram ahead per drafted step (2.6 > 2.5), behind per step: no finding (test above). Ahead per step:
    the finding, with vLLM's per-drafted-step figures said as such."""
    ahead = {**RUNS, "ngram": {**RUNS["ngram"], "tokens_per_step": 2.5, "drafted_share": 0.94}}
    (w,) = [w for w in sample_report(runs=ahead)["warnings"] if w["kind"] == "ngram"]
    assert w["message"] == ("The EAGLE-3 draft (2.450 tokens per target step) does not beat n-gram speculation "
                            "(2.500; vLLM's acceptance length per drafted step: EAGLE-3 2.500 (drafted on 100% of "
                            "steps), n-gram 2.600 (drafted on 94% of steps)).")
