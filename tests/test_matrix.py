"""The matrix of validation: the losslessness bound on synthetic scores, the cells as a DataFrame and
CSV that agree with the JSON, and the findings over the cells. Fast: no vLLM."""
import json
import random

import pandas as pd
import pytest

from eaglenest.validation.lossless import score_check
from eaglenest.validation.matrix import build_matrix, cells_frame, matrix_findings, matrix_html, matrix_markdown, write_csv
from eaglenest.validation.report import write_report


def _scores(mean, sd, n, seed):
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


def test_the_bound_passes_a_lossless_run_and_fails_a_corrupted_one():
    target = _scores(-0.05, 0.03, 40, 0)  # the target alone at T=1: near-certain tokens
    # A lossless engine samples the same distribution: another draw of the same scores.
    same = score_check(_scores(-0.05, 0.03, 40, 1), target)
    assert same["lossless"] and abs(same["z"]) < 4
    # Over many lossless draws the bound almost never fires (|z| > 4: about 6e-5 each).
    assert all(score_check(_scores(-0.05, 0.03, 40, s), target)["lossless"] for s in range(2, 200))
    # A corrupted engine (garbage tokens the target finds unlikely): far beyond the bound.
    bad = score_check(_scores(-2.5, 0.8, 40, 3), target)
    assert not bad["lossless"] and bad["z"] < -10 and bad["difference"] < -2
    # A real shift within numerical noise (below the tolerance) is not flagged, however many samples.
    tiny = score_check([-0.05 - 0.01] * 50 + [-0.06 - 0.01] * 50, [-0.05] * 50 + [-0.06] * 50)
    assert tiny["lossless"] and tiny["z"] < -4
    # T=0: identical outputs, zero variance: quiet.
    assert score_check([-0.1] * 8, [-0.1] * 8)["lossless"]
    assert score_check([], target) is None


def _cell(s, t, al=None, tps=100.0, lossless=None, score=-0.1):
    c = {"set": s, "temperature": t, "prompts": 4, "output_tokens": 200, "answers": [],
         "request_settings": {"temperature": t, "top_p": 1.0, "seed": 0, "max_tokens": 64},
         "one_request": {"output_tokens_per_s": tps, "ms_per_token": 1000 / tps}, "score": score}
    if al is not None:
        c.update({"acceptance_length": al, "acceptance_rate": (al - 1) / 3, "per_position": [0.9, 0.8, al - 2.7],
                  "drafts": 100, "draft_tokens": 300, "accepted": round((al - 1) * 100)})
    if lossless is not None:
        c["lossless_check"] = {"lossless": lossless, "difference": 0.0 if lossless else -2.0, "z": 0.0 if lossless else -30.0,
                               "score": score, "reference_score": -0.1}
    return c


def _runs():
    sets = [("heldout", 0.0), ("heldout", 1.0), ("new_forms", 0.0), ("new_forms", 1.0)]
    base = [_cell(s, t) for s, t in sets]
    eagle = [_cell("heldout", 0.0, 3.5, 250, True), _cell("heldout", 1.0, 1.0, 90, False, -3.0),
             _cell("new_forms", 0.0, 2.5, 200, True), _cell("new_forms", 1.0, 1.0, 90, False, -3.0)]
    ngram = [_cell("heldout", 0.0, 1.6, 150, True), _cell("heldout", 1.0, 1.0, 90, False, -3.0),
             _cell("new_forms", 0.0, 2.7, 170, True), _cell("new_forms", 1.0, 1.0, 95, False, -3.0)]
    runs = {"baseline": {"cells": base, "vllm_version": "0.32.0"}, "eagle3": {"cells": eagle, "vllm_version": "0.32.0"},
            "ngram": {"cells": ngram, "vllm_version": "0.32.0"}}
    sets = [{"name": "heldout", "path": "h.jsonl", "prompts": 4}, {"name": "new_forms", "path": "n.jsonl", "prompts": 4}]
    return build_matrix(runs, sets=sets, temperatures=[0.0, 1.0], top_p=1.0, seed=0, k=3,
                        offline={"acceptance_length": 3.45})


def test_the_csv_holds_the_json_cells(tmp_path):
    matrix = _runs()
    write_csv(matrix, tmp_path / "validation.csv")
    df = pd.read_csv(tmp_path / "validation.csv")
    assert len(df) == 12 == len(matrix["cells"])  # 3 methods x 2 sets x 2 temperatures
    assert list(df.columns[:3]) == ["method", "set", "temperature"]
    for cell, row in zip(matrix["cells"], df.to_dict("records")):
        assert (row["method"], row["set"], row["temperature"]) == (cell["method"], cell["set"], cell["temperature"])
        for key in ("acceptance_length", "speedup", "output_tokens"):
            assert row[key] == pytest.approx(cell[key]) if cell[key] is not None else pd.isna(row[key])
        assert [row[f"per_position_{i}"] for i in (1, 2, 3)] == pytest.approx(cell["per_position"] or [float("nan")] * 3,
                                                                              nan_ok=True)
    eagle = df[(df.method == "eagle3") & (df.set == "heldout") & (df.temperature == 0)].iloc[0]
    assert eagle.speedup == pytest.approx(2.5) and bool(eagle.lossless)
    assert cells_frame(matrix).shape[0] == 12


def test_findings_name_the_engine_and_the_weak_cells():
    matrix = _runs()
    found = matrix_findings(matrix, warn_below=0.8)
    kinds = [f["kind"] for f in found]
    lossless = [f for f in found if f["kind"] == "not_lossless"]
    assert len(lossless) == 1 and lossless[0]["temperature"] == 1.0  # quiet at T=0
    assert "vLLM 0.32.0 is not lossless at temperature 1" in lossless[0]["message"]
    assert {tuple(c) for c in lossless[0]["cells"]} == {("eagle3", "heldout"), ("eagle3", "new_forms"),
                                                        ("ngram", "heldout"), ("ngram", "new_forms")}
    # new_forms at T=0: below n-gram (2.5 < 2.7) and below 80% of the held-out 3.5; T=1 cells are not judged.
    assert kinds.count("matrix_ngram") == 1 and kinds.count("matrix_drop") == 1
    assert all("new_forms at T=0" in f["message"] for f in found if f["kind"].startswith("matrix_"))
    page = matrix_html(matrix)
    assert "engine not lossless" in page and "<svg" in page and "offline (T=0)" in page
    card = "\n".join(matrix_markdown(matrix))
    assert "| heldout | 4 | 3.50 (n-gram 1.60) | 3.45 | engine not lossless |" in card


def test_the_report_opens_with_the_matrix_and_writes_its_csv(tmp_path):
    from test_report import _report

    r = _report(matrix=_runs())
    assert {w["kind"] for w in r["warnings"]} >= {"not_lossless", "matrix_ngram", "matrix_drop"}
    write_report(r, tmp_path / "v.json", tmp_path / "v.html", csv_path=tmp_path / "v.csv")
    page = (tmp_path / "v.html").read_text()
    assert page.index("Acceptance by evaluation set and temperature") < page.index("<h2>Summary")
    assert len(pd.read_csv(tmp_path / "v.csv")) == len(r["matrix"]["cells"])
    assert json.loads((tmp_path / "v.json").read_text())["matrix"]["temperatures"] == [0.0, 1.0]
