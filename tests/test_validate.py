"""validation: the orchestration of the vLLM runs (validate), one run (runs), the counter differences
around it (metrics), its settings, and the requests sent through the traces client (requests; a stub
server: it injects the failures a real one can't on demand). Fast: no vLLM."""

import json
import pytest

from eaglenest.config import validate_config
from eaglenest.errors import ValidationError
from eaglenest.serving.settings import ServerConfig
from eaglenest.settings import ValidateSettings
from eaglenest.vllm_facts import acceptance, spec_counters
from eaglenest.validation import metrics, requests, runs, validate
from eaglenest.validation.matrix import matrix_temperatures
from eaglenest.validation.metrics import counter_delta
from tests.support.reports import OFFLINE, sample_report
from tests.support.untrained import export_untrained
from tests.support.vllm_metrics import METRICS_BEFORE, metrics_after


def greedy(max_tokens: int | None = None):
    """Validation's T=0 request settings with the schema's defaults (and ``max_tokens`` long)."""
    return requests.request_settings(ValidateSettings.defaults().replace(max_tokens=max_tokens))


def test_counter_differences_give_the_run_alone():
    after = metrics_after(METRICS_BEFORE, {
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
    with pytest.raises(ValidationError, match="restarted"):
        counter_delta(spec_counters(after), spec_counters(METRICS_BEFORE))


def test_measure_run_refuses_a_speculative_config_in_extra_args(tmp_path):
    srv = ServerConfig(model="x", extra_args=["--speculative-config", "{}"])
    with pytest.raises(ValidationError, match="server.extra_args"):
        runs.measure_run("eagle3", srv, {"method": "ngram", "num_speculative_tokens": 3}, [], greedy(), log_dir=tmp_path,
                         concurrency=8, warmup_requests=0, min_seconds=0.0)


def test_validate_settings_read_every_key_with_the_schemas_defaults():
    s = ValidateSettings.from_config(validate_config({"validate": {"ngram": {"prompt_lookup_max": 3}},
                                                      "generation": {"max_tokens": 77}}))
    assert s.request_max_tokens == 77 and s.num_speculative_tokens == 3 and s.concurrency == 8
    assert s.ngram == {"prompt_lookup_max": 3, "prompt_lookup_min": 2} and s.offline["tokens"] == "generate"
    assert s.replace(max_tokens=32).request_max_tokens == 32


def test_client_counts_tokens_and_repeats_until_min_seconds():
    from tests.stub_server import MODEL, StubServer

    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(5)]
    body = greedy(16)
    with StubServer(delay=0.05, answer_tokens=10) as stub:
        one = requests.run_requests(stub.url, MODEL, prompts, body, concurrency=2)
        tokens = sum(len(a["completion_token_ids"]) for a in one["answers"])
        assert one["passes"] == 1 and one["requests"] == 5 and one["completion_tokens"] == tokens > 0
        assert [a["id"] for a in one["answers"]] == [p["id"] for p in prompts]
        assert all(a["completion_token_ids"] and a["prompt_token_ids"] for a in one["answers"])
        assert one["output_tokens_per_s"] == pytest.approx(tokens / one["wall_s"], rel=0.01)
        more = requests.run_requests(stub.url, MODEL, prompts, body, concurrency=5, min_seconds=0.3)
        assert more["passes"] >= 2 and more["wall_s"] >= 0.3 and more["completion_tokens"] == tokens * more["passes"]
        assert len(more["answers"]) == 5  # the first pass's answers


def test_one_request_speed_gives_tokens_per_s_and_the_pooled_per_token_latency():
    run = {"requests": 4, "passes": 1, "completion_tokens": 200, "wall_s": 2.0, "output_tokens_per_s": 100.0,
           "mean_latency_s": 0.5, "answers": []}
    one = requests.one_request_speed([run])
    assert one["ms_per_token"] == pytest.approx(10.0)  # 4 requests x 0.5 s over 200 tokens
    assert one["output_tokens_per_s"] == 100.0 and "answers" not in one and "runs_output_tokens_per_s" not in one
    slow, fast = {**run, "output_tokens_per_s": 80.0, "mean_latency_s": 0.6}, {**run, "output_tokens_per_s": 120.0}
    three = requests.one_request_speed([fast, run, slow])  # the median run's figures, every run's tokens/s
    assert three["output_tokens_per_s"] == 100.0 and three["ms_per_token"] == pytest.approx(10.0)
    assert three["runs_output_tokens_per_s"] == [120.0, 100.0, 80.0]


def test_client_retries_then_fails_with_the_url_and_status():
    """Validation's requests go through the traces client: its retry policy, its error messages."""
    from tests.stub_server import MODEL, StubServer

    prompts = [{"id": "a", "messages": [{"role": "user", "content": "hello"}]}]
    with StubServer(fail_times=1, fail_status=503) as stub:  # one 503, then an answer: retried
        assert requests.run_requests(stub.url, MODEL, prompts, greedy(8))["requests"] == 1
    with StubServer(reject_match="hello") as stub:  # a 400 is not retried
        with pytest.raises(ValidationError,
                           match=r"requests to http://127\.0\.0\.1:\d+ failed: .*1 of 1 requests failed; first: HTTP 400"):
            requests.run_requests(stub.url, MODEL, prompts, greedy(8))


def test_request_settings_are_greedy_whatever_the_generation_config_says():
    """Validation's requests take generation's template arguments, extra body, timeout and retries, never its
    sampling: T=0 by default, validate's max_tokens and seed, and extra_body's sampling keys dropped."""
    s = ValidateSettings.from_config(validate_config({"validate": {"max_tokens": 32}, "generation": {
        "temperature": 0.7, "max_tokens": 4096, "seed": 5, "chat_template_kwargs": {"enable_thinking": False},
        "extra_body": {"temperature": 1.0, "top_k": 5}, "request_timeout": 9, "max_retries": 2}}))
    r = requests.request_settings(s)
    assert requests.sent_settings(r) == {"temperature": 0.0, "top_p": 1.0, "seed": 0, "max_tokens": 32}
    assert r.chat_template_kwargs == {"enable_thinking": False} and r.extra_body == {"top_k": 5}
    assert (r.request_timeout, r.max_retries) == (9, 2)


def test_request_settings_carry_the_cell_sampling_settings():
    s = ValidateSettings.from_config(validate_config({"validate": {"max_tokens": 64, "top_p": 0.95, "seed": 7},
                                                      "generation": {"extra_body": {"top_p": 0.5, "top_k": 5}}}))
    r = requests.request_settings(s, temperature=1.0, chat_template_kwargs={"thinking": True})
    assert r.extra_body == {"top_k": 5} and r.chat_template_kwargs == {"thinking": True}
    assert requests.sent_settings(r) == {"temperature": 1.0, "top_p": 0.95, "seed": 7, "max_tokens": 64}
    # validate.seed null: no seed (the schema's "none"); validate.top_p null: generation's
    unseeded = requests.request_settings(s.replace(seed=None, top_p=None), temperature=1.0)
    assert requests.sent_settings(unseeded) == {"temperature": 1.0, "top_p": 1.0, "seed": None, "max_tokens": 64}


def test_temperatures_default_to_zero_and_the_generation_temperature():
    def stage(**validate):
        return ValidateSettings.from_config(validate_config({"validate": validate, "generation": {"temperature": 0.6,
                                                                                                  "top_p": 0.95}}))

    s = stage()
    assert matrix_temperatures(s.temperatures, s.generation.temperature) == [0.0, 0.6] and s.request_top_p == 0.95
    assert matrix_temperatures(None, 0.0) == [0.0]
    s = stage(temperatures=[1.0, 0.6, 1.0], top_p=0.8)
    assert matrix_temperatures(s.temperatures, s.generation.temperature) == [0.0, 0.6, 1.0]  # T=0 always, each once
    assert s.request_top_p == 0.8


def test_evaluation_sets_load_through_the_training_loader(tmp_path):
    from eaglenest.validation.evalsets import load_set, resolve_sets

    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text('{"id": "h", "messages": [{"role": "user", "content": "held out"}]}\n')
    gsm = tmp_path / "gsm.jsonl"  # GSM8K's shape
    gsm.write_text("".join(f'{{"question": "q{i}?", "answer": "{i}"}}\n' for i in range(5)))
    sets = resolve_sets([{"name": "gsm", "path": str(gsm), "limit": 3}], heldout)
    assert [s["name"] for s in sets] == ["heldout", "gsm"] and sets[1]["split"] == "train"
    assert load_set(sets[0])[0]["id"] == "h"
    rows = load_set(sets[1])
    assert len(rows) == 3 and all(r["messages"][0]["content"].startswith("q") for r in rows)
    with pytest.raises(ValidationError, match="used twice"):
        resolve_sets([{"name": "heldout", "path": str(gsm)}], heldout)


def test_without_a_transformers_target_the_target_alone_server_scores_every_run_last(data, tmp_path, monkeypatch):
    """validate.offline.engine auto with hidden.backend vllm (a target too large for transformers): nothing loads
    the target, the target-alone run goes last and scores every run's outputs on its own server before it stops,
    and the report says there is no offline prediction (vLLM itself is faked here: the real server's scores are
    tested against transformers in tests/test_real_server.py)."""
    v = validate
    export_untrained(data["vocab_path"], data["head_path"], tmp_path / "draft")
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"id": f"h{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                               for i in range(3)))
    metrics = tmp_path / "train_metrics.csv"
    metrics.write_text("step,loss,loss_0,loss_1,loss_2,acc_0,acc_1,acc_2,tokens\n1,2.0,2.0,2.0,2.0,0.5,0.3,0.2,100\n")
    order, scored = [], []

    def fake_run(name, server, spec, prompts, settings, *, cells=(), before_stop=None, k=None, **_):
        order.append(name)
        answers = [{"prompt_token_ids": [1, 2], "completion_token_ids": [3, 4, 5], "finish_reason": "stop", "latency_s": 0.1}
                   for _ in prompts]
        one = {"requests": len(prompts), "passes": 1, "completion_tokens": 9, "wall_s": 1.0, "output_tokens_per_s": 9.0,
               "ms_per_token": 100.0, "mean_latency_s": 0.3}
        spec_figures = {"acceptance_length": 2.0, "acceptance_rate": 0.33, "per_position": [0.5, 0.3, 0.2],
                        "drafts": 9, "draft_tokens": 27, "accepted": 9} if k or (spec or {}).get("num_speculative_tokens") else {}
        result = {"answers": answers, "one_request": one, "output_tokens_per_s": 20.0, "mean_latency_s": 0.3, "passes": 1,
                  "completion_tokens": 9, "wall_s": 1.0, "requests": 3, "seconds_to_ready": 1.0, **spec_figures,
                  "cells": [{"set": c["set"], "temperature": c["temperature"], "prompts": len(c["prompts"]),
                             "answers": answers, "one_request": one, "output_tokens": 9,
                             "request_settings": requests.sent_settings(c["settings"]), **spec_figures} for c in cells]}
        if before_stop:
            before_stop("http://127.0.0.1:9", None, result)
        return result

    def fake_scores(url, model, sequences, **_):
        scored.append(len(sequences))
        return [-0.5] * len(sequences)

    monkeypatch.setattr(v, "measure_run", fake_run)
    monkeypatch.setattr(v, "served_scores", fake_scores)
    monkeypatch.setattr(v, "load_target", lambda *a, **k: pytest.fail("loaded the whole target into transformers"))
    monkeypatch.setattr(v, "vllm_version", lambda python: "0.32.0")
    server = ServerConfig(mode="local", model=str(data["head_path"].parent), served_model_name="t")
    settings = ValidateSettings.defaults().replace(max_tokens=8, target=server.model, temperatures=[0, 1.0],
                                                   hidden_backend="vllm")
    report = v.validate_draft(tmp_path / "draft", heldout, metrics, tmp_path / "r.json", tmp_path / "r.html", settings,
                              server=server, log=lambda m: None)
    assert order == ["eagle3", "ngram", "baseline"]
    assert sum(scored) == 3 * 2 * 3, "every run's two cells of three outputs, scored on the target-alone server"
    assert "skipped" in report["offline"] and "acceptance_length" not in report["offline"]
    cells = report["matrix"]["cells"]
    assert len(cells) == 3 * 2 and all(c.get("score") == -0.5 for c in cells), cells
    assert all(c["lossless_check"]["lossless"] for c in cells if c["method"] != "baseline"), "equal scores: lossless"
    assert "No offline prediction" in (tmp_path / "r.html").read_text()


def test_validate_drafts_are_served_by_their_kind_and_set_side_by_side(data, tmp_path, monkeypatch):
    """validate.drafts: each other draft is one more vLLM run at validation's k, served as its config.json says
    (P-EAGLE with parallel drafting, DFlash with method dflash), measured on the headline cell only, scored for
    losslessness, and set beside this run's draft, n-gram and the target alone in validation.json and the page;
    the matrix keeps this run's runs only (vLLM is faked: the real one in tests/test_formats.py)."""
    from eaglenest.draft.vllm_format import kind_of

    v = validate
    export_untrained(data["vocab_path"], data["head_path"], tmp_path / "draft")
    config = json.loads((tmp_path / "draft/config.json").read_text())
    for name, extra in (("peagle", {"parallel_drafting": True, "mask_token_id": 5, "fc_norm": False, "norm_output": False}),
                        ("dflash", {"block_size": 8, "num_hidden_layers": 1, "dflash_config": {"block_size": 8, "mask_token_id": 5, "target_layer_ids": [0, 1, 2]}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"id": f"h{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                               for i in range(3)))
    metrics = tmp_path / "train_metrics.csv"
    metrics.write_text("step,loss,loss_0,loss_1,loss_2,acc_0,acc_1,acc_2,tokens\n1,2.0,2.0,2.0,2.0,0.5,0.3,0.2,100\n")
    served = {}

    def fake_run(name, server, spec, prompts, settings, *, cells=(), k=None, **_):
        served[name] = (spec, [(c["set"], c["temperature"]) for c in cells])
        answers = [{"prompt_token_ids": [1, 2], "completion_token_ids": [3, 4, 5], "finish_reason": "stop", "latency_s": 0.1}
                   for _ in prompts]
        one = {"requests": len(prompts), "passes": 1, "completion_tokens": 9, "wall_s": 1.0,
               "output_tokens_per_s": 18.0 if k else 9.0, "ms_per_token": 100.0, "mean_latency_s": 0.3}
        figures = {"acceptance_length": 2.0, "acceptance_rate": 0.33, "per_position": [0.5, 0.3, 0.2], "drafts": 9,
                   "draft_tokens": 27, "accepted": 9, "tokens_per_step": 2.0, "drafted_share": 1.0} if k else {}
        return {"answers": answers, "one_request": one, "output_tokens_per_s": 20.0, "mean_latency_s": 0.3, "passes": 1,
                "completion_tokens": 9, "wall_s": 1.0, "requests": 3, "seconds_to_ready": 1.0, "speculative_config": spec,
                **figures, "cells": [{"set": c["set"], "temperature": c["temperature"], "prompts": len(c["prompts"]),
                                      "answers": answers, "one_request": one, "output_tokens": 9,
                                      "request_settings": requests.sent_settings(c["settings"]), "scores": [-0.5] * 3, **figures}
                                     for c in cells]}

    monkeypatch.setattr(v, "measure_run", fake_run)
    monkeypatch.setattr(v, "load_target", lambda *a, **k: pytest.fail("loaded the whole target into transformers"))
    monkeypatch.setattr(v, "vllm_version", lambda python: "0.32.0")
    server = ServerConfig(mode="local", model=str(data["head_path"].parent), served_model_name="t")
    settings = ValidateSettings.defaults().replace(
        max_tokens=8, target=server.model, temperatures=[0, 1.0], hidden_backend="vllm", other_drafts=[{"name": "p", "path": str(tmp_path / "peagle")}, {"name": "d", "path": str(tmp_path / "dflash")}])
    logged = []
    report = v.validate_draft(tmp_path / "draft", heldout, metrics, tmp_path / "r.json", tmp_path / "r.html", settings,
                              server=server, log=logged.append)
    assert list(served) == ["eagle3", "draft_p", "draft_d", "ngram", "baseline"]  # the target alone scores, last
    assert served["draft_p"][0]["parallel_drafting"] is True and served["draft_d"][0]["method"] == "dflash"
    assert served["draft_d"][0]["num_speculative_tokens"] == 3 and any("trained for k=7" in m for m in logged)
    assert served["draft_p"][1] == [("heldout", 0.0)] and len(served["eagle3"][1]) == 2  # extras: the headline only
    rows = {r["draft"]: r for r in report["drafts"]}
    assert list(rows) == ["this run", "p", "d", "n-gram", "target alone"]
    assert [rows[n]["kind"] for n in ("this run", "p", "d")] == [kind_of(config), "peagle", "dflash"]
    assert rows["d"]["speedup"] == 2.0 and rows["d"]["lossless"] == "pass" and rows["d"]["identical_to_target"] == 1.0
    assert rows["target alone"]["lossless"] == "reference" and rows["p"]["per_position"] == [0.5, 0.3, 0.2]
    assert {c["method"] for c in report["matrix"]["cells"]} == {"baseline", "eagle3", "ngram"}
    assert json.loads((tmp_path / "r.json").read_text())["drafts"] == report["drafts"]
    assert "Drafts side by side" in (tmp_path / "r.html").read_text()


def test_tokens_per_step_cover_exactly_the_requests_the_counters_do(tmp_path, monkeypatch):
    """The counters are read around every timed request of a run (each one-request phase and the concurrent
    one, every pass): the tokens per step divide by the steps of all of them, not of the first pass only.
    A cell reads its own counters around its own requests; the headline cell takes the run's figures."""
    v = runs
    readings = iter([{"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "accepted_per_pos": {}},
                     # the headline phases: 3 passes of 2 requests, 10 tokens each: 60 tokens, 6 requests
                     {"drafts": 18.0, "draft_tokens": 54.0, "accepted": 18.0, "accepted_per_pos": {0: 12.0, 1: 6.0}},
                     {"drafts": 18.0, "draft_tokens": 54.0, "accepted": 18.0, "accepted_per_pos": {0: 12.0, 1: 6.0}},
                     # the cell: 2 requests, 20 tokens: 4 drafts accepting 2 in all; 18 - 2 = 16 steps
                     {"drafts": 22.0, "draft_tokens": 66.0, "accepted": 20.0, "accepted_per_pos": {0: 14.0, 1: 6.0}}])
    phases = iter([2, 1, 1])  # passes over the 2 prompts: the one-request phase, the concurrent one, the T=1 cell

    def fake_requests(url, model, prompts, settings, *, concurrency=8, api_key=None, min_seconds=0.0):
        passes = next(phases, 1)
        answers = [{"completion_token_ids": list(range(10)), "prompt_token_ids": [1], "latency_s": 0.1} for _ in prompts]
        return {"requests": passes * len(prompts), "passes": passes, "completion_tokens": 10 * passes * len(prompts),
                "wall_s": 1.0, "output_tokens_per_s": 10.0 * passes * len(prompts), "mean_latency_s": 0.1,
                "answers": answers}

    monkeypatch.setattr(v, "start_local", lambda *a, **k: {"pid": -1})
    monkeypatch.setattr(v, "stop_local", lambda *a, **k: None)
    monkeypatch.setattr(v, "wait_ready", lambda *a, **k: {"urls": ["http://127.0.0.1:9"], "seconds_to_ready": 1.0})
    monkeypatch.setattr(v, "settled_counters", lambda *a, **k: next(readings))
    monkeypatch.setattr(v, "run_requests", fake_requests)
    prompts = [{"id": "a"}, {"id": "b"}]
    cells = [{"set": "heldout", "temperature": 0.0, "prompts": prompts, "settings": greedy(), "headline": True},
             {"set": "heldout", "temperature": 1.0, "prompts": prompts, "settings": greedy().replace(temperature=1.0)}]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    run = v.measure_run("ngram", ServerConfig(model="x"), spec, prompts, greedy(), log_dir=tmp_path, concurrency=8,
                        warmup_requests=0, min_seconds=0.0, cells=cells, log=lambda m: None)
    # 6 requests, 60 tokens, 18 accepted: 60 - 6 - 18 = 36 steps, 18 of them drafted
    assert (run["counted_requests"], run["counted_completion_tokens"], run["decode_steps"]) == (6, 60, 36)
    assert run["tokens_per_step"] == pytest.approx(54 / 36) and run["drafted_share"] == pytest.approx(0.5)
    assert run["acceptance_length"] == pytest.approx(2.0)  # vLLM's: per drafted step
    head, hot = run["cells"]
    assert {key: head[key] for key in metrics.COUNTED_KEYS} == {key: run[key] for key in metrics.COUNTED_KEYS}
    assert (hot["counted_requests"], hot["decode_steps"], hot["drafts"]) == (2, 16, 4)
    assert hot["tokens_per_step"] == pytest.approx(18 / 16) and hot["drafted_share"] == pytest.approx(4 / 16)


def test_the_target_alone_makes_one_token_a_step():
    phases = [{"requests": 4, "completion_tokens": 44}, {"requests": 2, "completion_tokens": 22}]
    got = metrics.counted_figures(None, phases, None)
    assert got == {"tokens_per_step": 1.0, "drafted_share": 0.0, "decode_steps": 60, "counted_requests": 6,
                   "counted_completion_tokens": 66}


def test_the_log_summary_compares_tokens_per_target_step():
    report, lines = {**sample_report(), "seconds": 1.0}, []
    validate._log_summary(report, OFFLINE, 8, "v.json", "v.html", lines.append)
    assert lines[0].startswith("validate_draft: EAGLE-3 tokens per target step (vllm format 2.450) in vLLM vs 2.550 "
                               "offline, n-gram 1.300 (vLLM's acceptance length per drafted step: EAGLE-3 2.500, n-gram "
                               "2.600 drafting on 20% of steps); speed-up ×2.20 (n-gram ×1.20) one request at a time")
