"""prepare_prompts: formats, bad rows, stable ids and shards, held-out set, errors. Local files only."""
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglenest.data.datasets import columns_refusal
from eaglenest.data.messages import extract_messages, prompt_id
from eaglenest.data.prompts import REASONS, PromptsError, RowError, prepare_prompts, same_prompts, shard_number
from eaglenest.settings import PromptSettings


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """datasets caches every local file it reads as arrow: keep that out of ~/.cache."""
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


# --- writing datasets -------------------------------------------------------------------------

def write(path, rows):
    """rows in the file type path's name asks for; list/dict cells become JSON text in a CSV."""
    path.parent.mkdir(parents=True, exist_ok=True)
    name = path.name
    if name.endswith(".jsonl.gz"):
        with gzip.open(path, "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    elif name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows))
    elif name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif name.endswith(".csv"):
        import pandas as pd
        cell = lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v  # noqa: E731
        pd.DataFrame([{k: cell(v) for k, v in r.items()} for r in rows]).to_csv(path, index=False)
    return str(path)


def sharegpt(q, system=None, answer="an answer"):
    turns = ([{"from": "system", "value": system}] if system else []) + [
        {"from": "human", "value": q}, {"from": "gpt", "value": answer}, {"from": "human", "value": "more?"}]
    return {"conversations": turns}


def openai(q, system=None):
    turns = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": q}, {"role": "assistant", "content": "an answer"}]
    return {"messages": turns}


ROW = {"conversations": sharegpt, "messages": openai,
       "prompt": lambda q: {"prompt": q}, "question": lambda q: {"question": q, "answer": "42"}}


def read_out(out):
    shards = sorted(out.glob("shard_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))
    lines = lambda p: [json.loads(x) for x in p.read_text().splitlines()]  # noqa: E731
    return [lines(p) for p in shards], lines(out / "heldout.jsonl"), json.loads((out / "stats.json").read_text())


def questions(records):
    return [r["messages"][-1]["content"] for r in records]


def quick(path, **kw) -> PromptSettings:
    """The library's quick call: one shard and nothing held out, unless ``kw`` says otherwise."""
    return PromptSettings.defaults().replace(path=str(path), **{"shards": 1, "heldout": 0, **kw})


def run(tmp_path, rows, name="d.jsonl", out="out", **kw):
    path = write(tmp_path / name, rows)
    stats = prepare_prompts(tmp_path / out, quick(path, **kw), progress=False)
    return stats, *read_out(tmp_path / out)[:2]


# --- formats ----------------------------------------------------------------------------------

@pytest.mark.parametrize("ext", ["jsonl", "json", "parquet", "csv", "jsonl.gz"])
@pytest.mark.parametrize("fmt", ["conversations", "messages", "prompt", "question"])
def test_every_format_from_every_file_type(tmp_path, fmt, ext):
    rows = [dict(ROW[fmt](f"question {i}?"), source=f"src{i % 2}") for i in range(6)]
    stats, shards, held = run(tmp_path, rows, name=f"d.{ext}", shards=2)
    assert stats["format"] == fmt and stats["rows_read"] == 6 and stats["kept"] == 6
    records = shards[0] + shards[1]
    assert sorted(questions(records)) == [f"question {i}?" for i in range(6)]
    for r in records:
        assert r["messages"] == [{"role": "user", "content": r["messages"][0]["content"]}]
        assert r["id"] == prompt_id(r["messages"]) and len(r["id"]) == 16 and int(r["id"], 16) >= 0
        assert r["source"] == f"src{int(r['messages'][0]['content'].split()[1][0]) % 2}"
        assert int(r["id"], 16) % 2 == shards.index(next(s for s in shards if r in s))
    assert held == []


def test_source_defaults_to_dataset_name(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b", "source": ""}])
    prepare_prompts(tmp_path / "out", quick(path), progress=False)
    shards, _, _ = read_out(tmp_path / "out")
    assert {r["source"] for r in shards[0]} == {path}


def test_directory_of_files_and_gz(tmp_path):
    write(tmp_path / "data" / "a.jsonl", [{"prompt": "one"}, {"prompt": "two"}])
    write(tmp_path / "data" / "b.jsonl.gz", [{"prompt": "three"}])
    (tmp_path / "data" / "README.md").write_text("not data")
    stats = prepare_prompts(tmp_path / "out", quick(str(tmp_path / "data")), progress=False)
    assert stats["rows_read"] == 3 and stats["train"] == 3
    # A cloned hub repo keeps its files one level down.
    write(tmp_path / "repo" / "data" / "train-0.parquet", [{"question": "q"}])
    assert prepare_prompts(tmp_path / "out2", quick(str(tmp_path / "repo")), progress=False)["train"] == 1


def test_directory_mixing_file_types_is_refused(tmp_path):
    write(tmp_path / "data" / "a.jsonl", [{"prompt": "one"}])
    write(tmp_path / "data" / "b.parquet", [{"prompt": "two"}])
    with pytest.raises(PromptsError, match="mixes file types"):
        prepare_prompts(tmp_path / "out", quick(str(tmp_path / "data")), progress=False)


def test_path_with_glob_characters(tmp_path):
    # datasets treats data_files as glob patterns: unescaped, this file "does not exist".
    stats, shards, _ = run(tmp_path, [{"prompt": "a"}], name="we[ird]/d.jsonl")
    assert stats["train"] == 1


def test_hub_name_goes_to_load_dataset_with_split(tmp_path, monkeypatch):
    import datasets
    calls = []

    def fake(path, **kw):
        calls.append((path, kw))
        return datasets.Dataset.from_list([{"conversations": sharegpt("hub q")["conversations"], "x": 1}])
    monkeypatch.setattr(datasets, "load_dataset", fake)
    stats = prepare_prompts(tmp_path / "out", quick("mlabonne/open-perfectblend", split="test",
                                                    cache_dir=str(tmp_path / "cache")), progress=False)
    assert calls == [("mlabonne/open-perfectblend", {"split": "test", "cache_dir": str(tmp_path / "cache")})]
    assert stats["split"] == "test" and stats["train"] == 1
    shards, _, _ = read_out(tmp_path / "out")
    assert shards[0][0]["source"] == "mlabonne/open-perfectblend"


def test_evaluation_set_shapes_and_a_hub_subset(tmp_path, monkeypatch):
    """The shapes of the usual evaluation sets: MT-Bench's list of turns (the first is the question),
    MATH-500's problem column, GSM8K's question; a hub dataset's configuration goes to load_dataset as name."""
    import datasets

    assert extract_messages({"prompt": ["first turn", "second turn"]}) == [{"role": "user", "content": "first turn"}]
    assert extract_messages({"problem": "Solve x."}) == [{"role": "user", "content": "Solve x."}]
    calls = []

    def fake(path, **kw):
        calls.append((path, kw))
        return datasets.Dataset.from_list([{"question": "q?", "answer": "a"}])
    monkeypatch.setattr(datasets, "load_dataset", fake)
    prepare_prompts(tmp_path / "out", quick("openai/gsm8k", split="test", cache_dir=None), subset="main", progress=False)
    assert calls == [("openai/gsm8k", {"name": "main", "split": "test", "cache_dir": None})]


def test_hub_failure_is_a_prompts_error(tmp_path, monkeypatch):
    import datasets

    def fake(path, **kw):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub")
    monkeypatch.setattr(datasets, "load_dataset", fake)
    with pytest.raises(PromptsError, match="someone/data.*Couldn't reach"):
        prepare_prompts(tmp_path / "out", quick("someone/data"), progress=False)


# --- dataset.columns --------------------------------------------------------------------------

TEXT_ROWS = [{"text": f"text question {i}?", "label": i % 2} for i in range(5)]


def test_a_text_column_is_refused_unmapped_and_read_once_dataset_columns_names_it(tmp_path):
    path = write(tmp_path / "d.jsonl", TEXT_ROWS)
    with pytest.raises(PromptsError) as e:
        prepare_prompts(tmp_path / "out", quick(path), progress=False)
    assert "d.jsonl" in str(e.value) and "['text', 'label']" in str(e.value) and "dataset.columns.question: text" in str(e.value)
    stats, shards, _ = run(tmp_path, TEXT_ROWS, columns={"question": "text"})
    assert stats["format"] == "text" and stats["columns"] == {"question": "text"} and stats["kept"] == 5
    assert sorted(questions(shards[0])) == [f"text question {i}?" for i in range(5)]
    assert all(r["id"] == prompt_id(r["messages"]) for r in shards[0])


def dialog(q, shape, uid):
    """A conversation under a column no guess knows (``dialog``), OpenAI- or ShareGPT-shaped, and its id (``uid``)."""
    turns = {"openai": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q},
                        {"role": "assistant", "content": "a"}],
             "sharegpt": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": q},
                          {"from": "gpt", "value": "a"}]}[shape]
    return {"uid": uid, "dialog": turns, "prompt": "a column the mapping overrides"}


@pytest.mark.parametrize("ext", ["jsonl", "parquet", "csv"])
@pytest.mark.parametrize("shape", ["openai", "sharegpt"])
def test_a_mapped_conversation_column_of_either_shape_and_an_id_column(tmp_path, shape, ext):
    """The mapped conversation column wins over a guessed one (prompt); its first user turn is the question; the id
    column's values are the prompts' ids (integers as text), each in the shard its id picks; a row with an id seen
    before, or the same question as an earlier row, is a duplicate."""
    rows = [dialog(f"question {i}?", shape, f"conv-{i}") for i in range(6)] + [
        dialog("another question?", shape, "conv-0"), dialog("question 1?", shape, "conv-new")]
    stats, shards, _ = run(tmp_path, rows, name=f"d.{ext}", shards=2, keep_system=True,
                           columns={"conversation": "dialog", "id": "uid"})
    assert stats["format"] == "dialog" and stats["kept"] == 6 and stats["dropped"]["duplicate"] == 2
    for i, shard in enumerate(shards):
        for r in shard:
            n = r["messages"][1]["content"].split()[1].rstrip("?")
            assert r["id"] == f"conv-{n}" and shard_number(r["id"]) % 2 == i
            assert r["messages"] == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": f"question {n}?"}]
    stats, shards, _ = run(tmp_path, [{"n": i, "q": f"q{i}"} for i in range(3)], name="n.jsonl", out="out2",
                           columns={"question": "q", "id": "n"})
    assert sorted(r["id"] for r in shards[0]) == ["0", "1", "2"]


def test_a_misspelt_or_doubled_mapping_is_refused_naming_the_columns_present(tmp_path):
    path = write(tmp_path / "d.jsonl", TEXT_ROWS)
    for columns, words in [({"question": "txet"}, ["dataset.columns.question is 'txet'", "['text', 'label']"]),
                           ({"question": "text", "id": "uid"}, ["dataset.columns.id is 'uid'", "['text', 'label']"]),
                           ({"question": "text", "conversation": "label"}, ["question ('text') and conversation ('label')"])]:
        with pytest.raises(PromptsError) as e:
            prepare_prompts(tmp_path / "out", quick(path, columns=columns), progress=False)
        assert all(w in str(e.value) for w in words), str(e.value)
        line = columns_refusal(path, columns, f"dataset.path {path}")
        assert line is not None and "\n" not in line and all(w in line for w in words), line


@pytest.mark.parametrize("ext", ["jsonl", "json", "parquet", "csv", "jsonl.gz"])
def test_the_first_rows_of_every_file_type_tell_whether_a_prompt_will_come(tmp_path, ext):
    """The parse-time check reads a few rows without datasets: a lone text column is refused naming the file, its
    columns and the setting; mapped, it passes; a column of turns that never holds a question is refused too."""
    path = write(tmp_path / f"d.{ext}", TEXT_ROWS)
    line = columns_refusal(path, {}, f"dataset.path {path}")
    assert line.startswith(f"dataset.path {path}: no question column") and "['text', 'label']" in line
    assert "dataset.columns.question: text" in line and "\n" not in line
    assert columns_refusal(path, {"question": "text"}, "dataset.path") is None
    assert columns_refusal(write(tmp_path / f"ok.{ext}", [sharegpt("q")]), {}, "dataset.path") is None
    bad = write(tmp_path / f"bad.{ext}", [{"messages": [{"role": "assistant", "content": "hi"}]}] * 3)
    line = columns_refusal(bad, {}, "dataset.path bad")
    assert "none of its first 3 rows holds a question in column 'messages'" in line and "dataset.columns.conversation" in line


def test_the_first_rows_of_a_directory_and_files_not_read_cheaply(tmp_path):
    write(tmp_path / "data" / "a.jsonl", TEXT_ROWS)
    write(tmp_path / "data" / "b.jsonl", TEXT_ROWS)
    assert "no question column" in columns_refusal(str(tmp_path / "data"), None, "dataset.path data")
    (tmp_path / "pretty.jsonl").write_text(json.dumps({"text": "q"}, indent=2))  # datasets reads it; the check does not
    assert columns_refusal(str(tmp_path / "pretty.jsonl"), None, "dataset.path pretty") is None
    (tmp_path / "empty").mkdir()
    assert columns_refusal(str(tmp_path / "empty"), None, "dataset.path empty").startswith("dataset.path empty: holds no")
    (tmp_path / "q.txt").write_text("What is 1 + 1?\n")  # once "prompts: 0" in the plan, and passed
    assert columns_refusal(str(tmp_path / "q.txt"), None, "dataset.path q.txt") == (
        "dataset.path q.txt: unknown file type; expected one of .jsonl, .jsonl.gz, .json, .json.gz, .parquet, .csv")


def test_stats_made_with_another_column_mapping_are_not_this_configs():
    settings = PromptSettings.defaults().replace(path="d.jsonl", seed=0, limit=None, keep_system=False, max_prompt_chars=10,
                                                 columns={"question": None, "conversation": None, "id": None})
    made = {"path": "d.jsonl", "seed": 0, "limit": None, "keep_system": False, "max_prompt_chars": 10}
    assert same_prompts(made, settings)  # written before dataset.columns: every column guessed
    assert same_prompts({**made, "columns": dict(settings.columns)}, settings)
    assert not same_prompts({**made, "columns": {"question": "text", "conversation": None, "id": None}}, settings)


# --- bad rows ---------------------------------------------------------------------------------

U = {"from": "human", "value": "fine question"}
BAD = [
    # conversations (ShareGPT)
    ({"conversations": "not a list"}, "malformed"),
    ({"conversations": None}, "malformed"),
    ({"conversations": {"from": "human", "value": "q"}}, "malformed"),
    ({"conversations": ["human: q"]}, "malformed"),
    ({"conversations": [[U]]}, "malformed"),                                  # nested list
    ({"turns": [{"from": "gpt", "value": "an answer first"}, "q"]}, "malformed"),  # MT-Bench shape, a turn not a user's
    ({"turns": ["  "]}, "empty"),
    ({"conversations": [None, U]}, "malformed"),
    ({"conversations": [{"from": "human"}]}, "malformed"),                    # no value
    ({"conversations": [{"value": "q"}]}, "malformed"),                       # no from
    ({"conversations": [{"from": "robot", "value": "q"}]}, "malformed"),      # unknown role
    ({"conversations": [{"from": 3, "value": "q"}]}, "malformed"),
    ({"conversations": [U, {"from": "alien", "value": "x"}]}, "malformed"),   # bad turn after the question
    ({"conversations": [{"from": "gpt", "value": "Hi! Ask me."}, U]}, "malformed"),  # assistant first
    ({"conversations": [{"from": "human", "value": None}]}, "non_string"),
    ({"conversations": [{"from": "human", "value": ["q"]}]}, "non_string"),
    ({"conversations": [{"from": "human", "value": 7}]}, "non_string"),
    ({"conversations": [{"from": "system", "value": 7}, U]}, "non_string"),
    ({"conversations": []}, "empty"),
    ({"conversations": [{"from": "human", "value": ""}]}, "empty"),
    ({"conversations": [{"from": "human", "value": " \n\t "}]}, "empty"),
    ({"conversations": [{"from": "system", "value": "You are helpful."}]}, "empty"),  # system only
    # messages (OpenAI)
    ({"messages": "user: hi"}, "malformed"),
    ({"messages": [{"role": "user"}]}, "malformed"),
    ({"messages": [{"content": "q"}]}, "malformed"),
    ({"messages": [{"role": "wizard", "content": "q"}]}, "malformed"),
    ({"messages": [{"role": "assistant", "content": "hello"}]}, "malformed"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]}, "non_string"),
    ({"messages": [{"role": "user", "content": None}]}, "non_string"),
    ({"messages": [{"role": "user", "content": "   "}]}, "empty"),
    ({"messages": [{"role": "system", "content": "sys"}]}, "empty"),
    # plain columns
    ({"prompt": None}, "empty"),
    ({"prompt": ""}, "empty"),
    ({"prompt": "\n  "}, "empty"),
    ({"prompt": 12}, "non_string"),
    ({"prompt": ["a", 2]}, "non_string"),
    ({"prompt": {"text": "q"}}, "non_string"),
    ({"question": False}, "non_string"),
    ({"answer": "no question column in this row"}, "malformed"),
    ("a row that is not an object", "malformed"),
]


@pytest.mark.parametrize("row,reason", BAD, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD)])
def test_extract_messages_reasons(row, reason):
    with pytest.raises(RowError) as info:
        extract_messages(row)
    assert info.value.reason == reason and isinstance(info.value, ValueError)


def test_extract_messages_takes_first_user_turn_and_optional_system():
    conv = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q1"},
                              {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"}]}
    assert extract_messages(conv) == [{"role": "user", "content": "Q1"}]
    assert extract_messages(conv, keep_system=True) == [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Q1"}]
    # OpenAI keys inside a conversations column, roles in any case, tool calls after the question.
    msgs = {"messages": [{"role": "Developer", "content": "sys"}, {"role": "USER", "content": "Q"},
                         {"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool"}]}
    assert extract_messages(msgs, keep_system=True) == [{"role": "system", "content": "sys"},
                                                        {"role": "user", "content": "Q"}]
    blank_system = {"messages": [{"role": "system", "content": " "}, {"role": "user", "content": "Q"}]}
    assert extract_messages(blank_system, keep_system=True) == [{"role": "user", "content": "Q"}]
    alpaca = {"instruction": "Translate.", "input": "bonjour", "system_prompt": "S"}
    assert extract_messages(alpaca, keep_system=True) == [{"role": "system", "content": "S"},
                                                          {"role": "user", "content": "Translate.\n\nbonjour"}]
    assert extract_messages({"instruction": "Do it.", "input": ""}) == [{"role": "user", "content": "Do it."}]


@pytest.mark.parametrize("ext", ["jsonl", "json"])
def test_bad_rows_in_a_file_are_counted_not_fatal(tmp_path, ext):
    # Mixed types in one column: datasets 5.2 stores them as a Json feature rather than failing.
    rows = [r for r, _ in BAD if isinstance(r, dict) and "conversations" in r] + [
        {"conversations": [U]}, {"conversations": [U]}]
    expected = {r: 0 for r in REASONS}
    for r, reason in BAD:
        if isinstance(r, dict) and "conversations" in r:
            expected[reason] += 1
    expected["duplicate"] = 1
    stats, shards, _ = run(tmp_path, rows, name=f"d.{ext}")
    assert stats["dropped"] == expected
    assert stats["kept"] == 1 and stats["rows_read"] == len(rows)


def test_lines_that_are_not_json_fall_back_to_the_json_module(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "good"}\nnot json at all\n[1, 2]\n\n{"prompt": "also good"}\n{"prompt": 5}\n')
    stats = prepare_prompts(tmp_path / "out", quick(str(path)), progress=False)
    assert stats["rows_read"] == 5 and stats["kept"] == 2
    assert stats["dropped"]["malformed"] == 2 and stats["dropped"]["non_string"] == 1
    assert "json module" in capsys.readouterr().err


def test_csv_empty_cells_and_parquet_nulls_are_empty(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('prompt,source\nhello,a\n"",b\n   ,c\n,d\n')
    stats = prepare_prompts(tmp_path / "out", quick(str(path)), progress=False)
    assert stats["kept"] == 1 and stats["dropped"]["empty"] == 3
    stats, _, _ = run(tmp_path, [{"prompt": "x"}, {"prompt": None}], name="d.parquet", out="out2")
    assert stats["dropped"]["empty"] == 1


def test_csv_conversations_written_by_pandas_repr(tmp_path):
    import pandas as pd
    pd.DataFrame([sharegpt("from repr"), {"conversations": "[unparseable"}]).to_csv(tmp_path / "d.csv", index=False)
    stats = prepare_prompts(tmp_path / "out", quick(str(tmp_path / "d.csv")), progress=False)
    assert stats["kept"] == 1 and stats["dropped"]["malformed"] == 1


def test_duplicates_and_too_long(tmp_path):
    rows = [{"prompt": "same"}, {"prompt": "same", "source": "other"}, {"prompt": "x" * 11}, {"prompt": "x" * 10}]
    stats, shards, _ = run(tmp_path, rows, max_prompt_chars=10)
    assert stats["dropped"]["duplicate"] == 1 and stats["dropped"]["too_long"] == 1
    assert sorted(questions(shards[0])) == ["same", "x" * 10]


def test_keep_system(tmp_path):
    rows = [sharegpt("q", system="You are a pirate."), openai("q2", system="Be terse.")]
    _, shards, _ = run(tmp_path, rows[:1], keep_system=True)
    assert shards[0][0]["messages"] == [{"role": "system", "content": "You are a pirate."},
                                        {"role": "user", "content": "q"}]
    _, shards, _ = run(tmp_path, rows[:1], out="out2")
    assert shards[0][0]["messages"] == [{"role": "user", "content": "q"}]
    _, shards, _ = run(tmp_path, rows[1:], name="m.jsonl", out="out3", keep_system=True)
    assert [m["role"] for m in shards[0][0]["messages"]] == ["system", "user"]


# --- ids, shards, shuffle, held-out -----------------------------------------------------------

def many(n):
    return [sharegpt(f"question number {i}") for i in range(n)]


def placement(out):
    shards, held, _ = read_out(out)
    return {r["id"]: (i, r["messages"][0]["content"]) for i, s in enumerate(shards) for r in s}, held


def test_ids_and_shards_stable_when_limit_shards_heldout_change(tmp_path):
    path = write(tmp_path / "d.jsonl", many(200))
    prepare_prompts(tmp_path / "a", quick(path, shards=4, limit=50, heldout=10), progress=False)
    prepare_prompts(tmp_path / "b", quick(path, shards=4, limit=120, heldout=10), progress=False)
    a, held_a = placement(tmp_path / "a")
    b, held_b = placement(tmp_path / "b")
    assert len(a) == 50 and len(b) == 120 and set(a) <= set(b)
    assert all(b[i] == a[i] for i in a)  # same shard, same content
    # Raising the limit appends: each shard of the bigger run starts with the smaller run's shard.
    sa, _, _ = read_out(tmp_path / "a")
    sb, _, _ = read_out(tmp_path / "b")
    assert all(sb[k][:len(sa[k])] == sa[k] for k in range(4))
    assert held_a == held_b
    # Another shard count or held-out size: a prompt keeps its id and content; shard = id mod shards.
    prepare_prompts(tmp_path / "c", quick(path, shards=3, heldout=25), progress=False)
    c, held_c = placement(tmp_path / "c")
    assert all(c[i][1] == a[i][1] and c[i][0] == int(i, 16) % 3 for i in set(a) & set(c))
    assert held_c[:10] == held_a  # the held-out set grows from its front, like the training set


def test_heldout_disjoint_from_training(tmp_path):
    stats, shards, held = run(tmp_path, many(60), shards=3, heldout=15)
    train_ids = {r["id"] for s in shards for r in s}
    assert len(held) == 15 == stats["heldout"] and len(train_ids) == 45 == stats["train"]
    assert not train_ids & {r["id"] for r in held}
    assert stats["shards"] == [len(s) for s in shards]


def test_seeded_shuffle_deterministic_seed_dependent_row_order_independent(tmp_path):
    rows = many(80)
    order = lambda out: [r["id"] for r in read_out(tmp_path / out)[0][0]]  # noqa: E731
    run(tmp_path, rows, name="a.jsonl", out="s0", seed=0)
    run(tmp_path, rows, name="a.jsonl", out="s0bis", seed=0)
    run(tmp_path, rows[::-1], name="reversed.jsonl", out="s0rev", seed=0)
    run(tmp_path, rows, name="a.jsonl", out="s1", seed=1)
    assert order("s0") == order("s0bis") == order("s0rev")
    assert order("s1") != order("s0") and sorted(order("s1")) == sorted(order("s0"))
    _, _, held0 = run(tmp_path, rows, out="h0", heldout=10, seed=0)
    _, _, held1 = run(tmp_path, rows, out="h1", heldout=10, seed=1)
    assert held0 != held1


def test_outputs_atomic_and_stale_shards_removed(tmp_path):
    run(tmp_path, many(20), shards=4)
    run(tmp_path, many(20), shards=2)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["heldout.jsonl", "shard_0.jsonl", "shard_1.jsonl", "stats.json"]


def test_stats_and_summary(tmp_path, capsys):
    rows = many(12) + [many(1)[0], {"conversations": []}]
    stats, _, _ = run(tmp_path, rows, shards=2, heldout=2, limit=5, seed=7)
    on_disk = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert on_disk == stats
    assert stats | {"path": None} == {
        "path": None, "split": None, "format": "conversations", "columns": {"question": None, "conversation": None, "id": None},
        "rows_read": 14, "kept": 12, "heldout": 2,
        "train": 5, "unused": 5, "shards": stats["shards"], "seed": 7, "limit": 5, "keep_system": False,
        "max_prompt_chars": 32000, "dropped": {"duplicate": 1, "empty": 1, "non_string": 0, "malformed": 0,
                                               "too_long": 0}, "longest_prompt": stats["longest_prompt"]}
    assert sum(stats["shards"]) == 5
    written = [json.loads(line) for f in sorted((tmp_path / "out").glob("*.jsonl")) for line in f.read_text().splitlines()]
    longest = max(written, key=lambda r: sum(len(m["content"]) for m in r["messages"]))
    assert stats["longest_prompt"] == {"id": longest["id"], "chars": sum(len(m["content"]) for m in longest["messages"]),
                                       "messages": longest["messages"]}
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("prompts: 12 kept of 14 rows (1 duplicate, 1 empty); "
                   "5 train in 2 shards (limit 5, 5 unused), 2 held out")


# --- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("missing", ["nope.jsonl", "./data/nope", "/no/such/dir", "~/no-such-eaglenest-file"])
def test_missing_local_path_names_it_and_skips_the_hub(tmp_path, monkeypatch, missing):
    import datasets
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("went to load_dataset"))
    with pytest.raises(PromptsError, match="no such file") as info:
        prepare_prompts(tmp_path / "out", quick(missing), progress=False)
    assert repr(missing) in str(info.value)


def test_no_usable_column_names_the_columns(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"text": "hello", "label": 1}])
    with pytest.raises(PromptsError, match=r"d\.jsonl.*\['text', 'label'\]"):
        prepare_prompts(tmp_path / "out", quick(path), progress=False)


def test_all_rows_dropped_says_why(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": ""}, {"prompt": "  "}, {"prompt": 3}])
    with pytest.raises(PromptsError, match=r"all 3 rows were dropped.*2 empty.*1 non_string"):
        prepare_prompts(tmp_path / "out", quick(path), progress=False)
    assert not (tmp_path / "out").exists()


def test_empty_file_and_unreadable_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")  # datasets raises a bare StopIteration on this
    with pytest.raises(PromptsError, match="no rows"):
        prepare_prompts(tmp_path / "out", quick(str(tmp_path / "empty.jsonl")), progress=False)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(PromptsError, match="bad.parquet"):
        prepare_prompts(tmp_path / "out", quick(str(tmp_path / "bad.parquet")), progress=False)


def test_heldout_taking_everything_and_bad_arguments(tmp_path):
    path = write(tmp_path / "d.jsonl", many(3))
    with pytest.raises(PromptsError, match="heldout=3"):
        prepare_prompts(tmp_path / "out", quick(path, heldout=3), progress=False)
    for kw in ({"shards": 0}, {"limit": 0}, {"heldout": -1}):
        with pytest.raises(PromptsError):
            prepare_prompts(tmp_path / "out", quick(path, **kw), progress=False)


def test_datasets_cache_goes_where_the_config_says_not_to_the_home_cache(tmp_path, monkeypatch):
    """datasets keeps an Arrow copy of every dataset it loads: it lands in cache_dir (by default
    data/.hf_cache under the working directory), never in ~/.cache/huggingface."""
    import datasets
    home_cache = tmp_path / "home-cache"  # stands in for ~/.cache/huggingface/datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home_cache)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(5)))
    prepare_prompts(tmp_path / "a", quick(str(path)), progress=False)  # the default: data/.hf_cache here
    prepare_prompts(tmp_path / "b", quick(str(path), cache_dir=str(tmp_path / "mine")), progress=False)
    assert any((tmp_path / "data" / ".hf_cache").rglob("*.arrow"))
    assert any((tmp_path / "mine").rglob("*.arrow"))
    assert not home_cache.exists()
    prepare_prompts(tmp_path / "c", quick(str(path), cache_dir=None), progress=False)  # None: datasets' own default
    assert any(home_cache.rglob("*.arrow"))  # (so the assertion above could fail)
