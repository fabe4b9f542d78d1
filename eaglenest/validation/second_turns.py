"""Second turns in validation: an evaluation set's follow-up question (MT-Bench's second turn), asked after
the target's own answer to the first.

A set's row holds a second turn where its conversation goes on: prepare_prompts' conversation rows
(``[system?, user, {"role": "assistant"}, user, ...]``, the assistant turn a slot the target fills). The
matrix asks the first turn as before (``first_turn``); then, on every server start (the target alone, each
draft, n-gram), the second is asked at T=0 with the conversation ``[user 1, the target alone's T=0 answer
to it, user 2]`` (``turn_two_prompts``), so every method is measured on the same context, the one the
target makes itself. The target alone's server is the first to start, so its answers are known before any
draft's run; its own second turns are asked on the same start, after its matrix. Where the target alone
runs last (validate.offline.engine none: it scores everyone's outputs) there are no answers in time and no
second turns are asked, said in the log. Off with validate.second_turns false.

The figures (tokens per target step, vLLM's acceptance length per drafted step, per set and run) are in
validation.json's ``second_turns``, the page, the model cards and the log, beside the same set's turn-1
figures at T=0.
"""

from __future__ import annotations

from .matrix import PER_DRAFTED_STEP
from .plots import esc

TURN = 2  # the turn measured (MT-Bench has two)
# The keys of a measured cell that the report keeps (``runs.measure_cell``'s, answers dropped).
FIGURES = ("prompts", "output_tokens", "tokens_per_step", "acceptance_length", "drafted_share", "per_position")


def first_turn(row: dict) -> dict:
    """A prompt row as the matrix sends it: its messages up to its first user turn, with ``second_turn`` (the
    next user turn's text) where the conversation goes on to one after a single answer slot."""
    messages = row["messages"]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first is None or first == len(messages) - 1:
        return row
    out = {**row, "messages": messages[:first + 1]}
    rest = messages[first + 1:]
    if (len(rest) >= 2 and rest[0].get("role") == "assistant" and not rest[0].get("tool_calls")
            and rest[1].get("role") == "user" and isinstance(rest[1].get("content"), str)):
        out["second_turn"] = rest[1]["content"]
    return out


def has_second_turns(rows: list[dict]) -> bool:
    return any("second_turn" in r for r in rows)


def turn_two_prompts(rows: list[dict], answers: list[dict]) -> list[dict]:
    """The second turns of ``rows`` (``first_turn``'s) as prompt rows: ``[first turn's messages, the assistant's
    answer, the second user turn]``; ``answers``: the target alone's trace records of ``rows``, in order. The
    answer is its content (the reasoning apart, as chat templates leave it out of past turns)."""
    if len(answers) != len(rows):
        raise ValueError(f"{len(answers)} answers for {len(rows)} rows")
    return [{"id": f"{r.get('id')}/turn{TURN}", "source": r.get("source"),
             "messages": [*r["messages"], {"role": "assistant", "content": a.get("content") or ""},
                          {"role": "user", "content": r["second_turn"]}]}
            for r, a in zip(rows, answers) if "second_turn" in r]


def turn_two_cells(cells: list[dict], baseline_cells: list[dict]) -> list[dict]:
    """The second-turn cells: one per set whose T=0 cell holds rows with a second turn, its prompts built from
    the target alone's answers in that cell (``baseline_cells``: its measured cells, answers still in), sent
    with that cell's request settings."""
    answered = {c["set"]: c["answers"] for c in baseline_cells if c["temperature"] == 0}
    out = []
    for c in cells:
        if c["temperature"] == 0 and has_second_turns(c["prompts"]) and c["set"] in answered:
            out.append({"set": c["set"], "temperature": 0, "turn": TURN, "headline": False, "settings": c["settings"],
                        "prompts": turn_two_prompts(c["prompts"], answered[c["set"]])})
    return out


def second_turns_section(runs: dict) -> list[dict]:
    """validation.json's ``second_turns``: per set, every run's turn-2 figures beside its turn-1 tokens per
    target step on the same set at T=0. ``runs``: ``{name: run}`` whose ``second_turns`` are its measured
    turn-2 cells and ``cells`` its matrix cells."""
    section = {}
    for name, run in runs.items():
        first = {c["set"]: c for c in run.get("cells", []) if c["temperature"] == 0}
        for c in run.get("second_turns") or []:
            s = section.setdefault(c["set"], {"set": c["set"], "turn": TURN, "prompts": c["prompts"], "runs": {}})
            s["runs"][name] = {**{k: c.get(k) for k in FIGURES},
                               "turn_1_tokens_per_step": first.get(c["set"], {}).get("tokens_per_step"),
                               "output_tokens_per_s": (c.get("one_request") or {}).get("output_tokens_per_s")}
    return list(section.values())


def _f3(v) -> str:
    return "–" if v is None else f"{v:.3f}"


LABELS = {"baseline": "target alone", "eagle3": "EAGLE-3", "ngram": "n-gram"}


def _rows(section: list[dict]) -> list[list[str]]:
    return [[s["set"], LABELS.get(name, name), _f3(r["turn_1_tokens_per_step"]), _f3(r["tokens_per_step"]),
             _f3(r["acceptance_length"])] for s in section for name, r in s["runs"].items()]


HEADER = ["set", "run", "turn 1, tokens per target step", f"turn {TURN}, tokens per target step",
          f"turn {TURN}, {PER_DRAFTED_STEP}"]
SAID = (f"Turn {TURN} asked after the target alone's own T=0 answer to turn 1, greedy, one request at a time; turn 1: "
        f"the same set's T=0 cell.")


def second_turns_html(section: list[dict]) -> list[str]:
    if not section:
        return []
    rows = "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in row) + "</tr>" for row in _rows(section))
    head = "".join(f"<th>{esc(h)}</th>" for h in HEADER)
    return ["<h2>Second turns</h2>", f'<p class="muted">{esc(SAID)}</p>',
            f"<table><tr>{head}</tr>{rows}</table>"]


def second_turns_markdown(section: list[dict]) -> list[str]:
    """The section as Markdown lines, for the model cards."""
    if not section:
        return []
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(section)]
    return [SAID, "", *lines, ""]


def second_turns_said(section: list[dict]) -> list[str]:
    """One log line per set, e.g. ``mt_bench turn 2 (6 prompts): EAGLE-3 1.412 tokens per target step ...``."""
    lines = []
    for s in section:
        runs = "; ".join(f"{LABELS.get(name, name)} {_f3(r['tokens_per_step'])} tokens per target step (turn 1 "
                         f"{_f3(r['turn_1_tokens_per_step'])}" + (f", vLLM's acceptance length per drafted step "
                                                                 f"{_f3(r['acceptance_length'])})" if r["acceptance_length"] is not None else ")")
                         for name, r in s["runs"].items())
        lines.append(f"{s['set']} turn {TURN} ({s['prompts']} prompts, after the target's own turn-1 answers): {runs}")
    return lines
