"""Reading a dataset: a Hugging Face hub name or local files (.jsonl, .json, .parquet, .csv, or a directory
of them) -> rows, one dict each, so that a bad row costs a count, not the run; and the cheap look at the
first rows the parse-time checks take (``head_rows``, ``columns_refusal``).
"""

from __future__ import annotations

import contextlib
import csv
import glob
import gzip
import json
import sys
from pathlib import Path

from ..errors import PromptsError, RowError
from ..util import is_local_path, say
from .messages import COLUMNS, SYSTEM_COLUMNS, extract_messages, find_columns, row_id

# Local file kinds by name ending, for datasets.load_dataset(<kind>, data_files=...).
EXTENSIONS = {".jsonl": "json", ".jsonl.gz": "json", ".json": "json", ".json.gz": "json",
              ".parquet": "parquet", ".csv": "csv"}


# ---------------------------------------------------------------------------------------------
# Loading


def _kind(name: str) -> str | None:
    lower = name.lower()
    return next((kind for ext, kind in EXTENSIONS.items() if lower.endswith(ext)), None)


def is_local_dataset(path: str, base=None) -> bool:
    """Local files rather than a Hugging Face hub dataset: a local path (``util.is_local_path``, relative
    to ``base``) or a name with a dataset file's extension."""
    return is_local_path(path, base) or _kind(path) is not None


def _local_files(path: str) -> tuple[str, list[str]]:
    """(kind, files) of a local file or directory; PromptsError when there is nothing to read."""
    p = Path(path).expanduser()
    if not p.exists():
        raise PromptsError(f"dataset {path!r}: no such file or directory. Give an existing local "
                           f"file/directory ({', '.join(EXTENSIONS)}) or a Hugging Face hub name like "
                           f"'mlabonne/open-perfectblend'.")
    if p.is_file():
        kind = _kind(p.name)
        if kind is None:
            raise PromptsError(f"dataset {path!r}: unknown file type; expected one of {', '.join(EXTENSIONS)}")
        return kind, [str(p)]

    def data_files(pattern):
        return sorted(str(f) for f in p.glob(pattern) if f.is_file() and _kind(f.name)
                      and not any(part.startswith(".") for part in f.relative_to(p).parts))

    # Files at the top level; else anywhere below (the data/ folder of a cloned hub repo).
    files = data_files("*") or data_files("**/*")
    kinds = sorted({_kind(Path(f).name) for f in files})
    if not files:
        raise PromptsError(f"dataset directory {path!r} holds no {', '.join(EXTENSIONS)} files")
    if len(kinds) > 1:
        raise PromptsError(f"dataset directory {path!r} mixes file types ({', '.join(kinds)}); "
                           f"point dataset.path at one file or a directory of one type")
    return kinds[0], files


def _load(path: str, split: str, cache_dir: str | None, subset: str | None = None, mapped=()):
    """(rows, n_rows, columns) where rows yields dicts, so that a bad row costs a count, not the run;
    ``mapped``: the columns dataset.columns names, read beside the ones this stage guesses."""
    import datasets  # slow to import; only this stage needs it

    if is_local_dataset(path):
        kind, files = _local_files(path)
        try:
            # glob.escape: data_files are patterns, and a '[' in a path makes the file vanish.
            ds = datasets.load_dataset(kind, data_files=[glob.escape(f) for f in files], split="train",
                                       cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001 -- arrow refuses some rows; json can still read the rest
            if kind != "json":
                raise PromptsError(f"dataset {path!r}: cannot read it as {kind}: {_why(e)}") from e
            say(f"prompts: datasets could not read {path} as a table ({_why(e)}); "
                f"reading it with the json module, bad lines count as malformed")
            return _json_rows(path, files)
    else:
        try:
            named = {"name": subset} if subset else {}  # the dataset's configuration, where it has several
            ds = datasets.load_dataset(path, **named, split=split, cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001 -- network, name, split, auth: all the user's to fix
            raise PromptsError(f"dataset {path!r} (split {split!r}) could not be loaded from the Hugging Face "
                               f"hub: {_why(e)}. Check the name and split, the network (or HF_HUB_OFFLINE with "
                               f"a filled cache), or point dataset.path at a local file.") from e
    return _dataset_rows(ds, mapped), len(ds), list(ds.column_names)


def _why(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip() and str(cause) not in text:
        text += f" ({str(cause).strip()})"
    return text


def _dataset_rows(ds, mapped=()):
    """Rows of a datasets.Dataset, reading only the columns this stage uses (``mapped``: those dataset.columns names)."""
    wanted = [c for c in ds.column_names if c in dict(COLUMNS) or c in (*SYSTEM_COLUMNS, "input", "source", "tools", *mapped)]
    ds = ds.select_columns(wanted)

    def rows():
        for batch in ds.iter(batch_size=1024):
            for values in zip(*(batch[c] for c in wanted)):
                yield dict(zip(wanted, values))
    return rows()


BAD_LINE = object()  # a line that is not JSON: counted as malformed


def _json_rows(path: str, files: list[str]):
    """JSON / JSON Lines read with the json module: a line that is not JSON becomes a malformed row."""
    rows, columns = [], {}  # columns in order of first appearance, like datasets
    for f in files:
        opener = gzip.open if f.lower().endswith(".gz") else open
        try:
            with opener(f, "rt", encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError, EOFError) as e:
            raise PromptsError(f"dataset {path!r}: cannot read {f}: {e}") from e
        try:
            whole = json.loads(text)  # a .json file holding one array
            parsed = whole if isinstance(whole, list) else [whole]
        except json.JSONDecodeError:
            parsed = []
            for line in text.splitlines():
                if line.strip():
                    try:
                        parsed.append(json.loads(line))
                    except json.JSONDecodeError:
                        parsed.append(BAD_LINE)
        for r in parsed:
            if isinstance(r, dict):
                columns.update(dict.fromkeys(r))
        rows.extend(parsed)
    return iter(rows), len(rows), list(columns)


# ---------------------------------------------------------------------------------------------
# Before any job: a local dataset's first rows


HEAD_ROWS = 20  # rows the parse-time check reads (it runs at every start, dry-runs included)
HEAD_JSON_BYTES = 1 << 20  # of a .json array, only the objects within its first MiB are read


def head_rows(path: str, n: int = HEAD_ROWS) -> tuple[list, list[str]] | None:
    """(the first ``n`` rows, the columns) of a local dataset, read without ``datasets`` (slow to import, and it
    copies the whole file into its cache); None where they cannot be read cheaply (a .json array whose first
    object is above HEAD_JSON_BYTES, lines that are not JSON): prepare_prompts reads those and says what it finds.
    PromptsError for a directory with nothing to read (``_local_files``)."""
    kind, files = _local_files(path)
    f = files[0]  # a directory's files share one kind and, as datasets reads them, one set of columns
    if kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(f)
        batch = next(pf.iter_batches(batch_size=n), None)
        return (batch.to_pylist() if batch is not None else []), list(pf.schema_arrow.names)
    opener = gzip.open if f.lower().endswith(".gz") else open
    with opener(f, "rt", encoding="utf-8", newline="" if kind == "csv" else None) as fh:
        if kind == "csv":
            reader = csv.DictReader(fh)
            return [dict(r) for _, r in zip(range(n), reader)], list(reader.fieldnames or [])
        text = fh.read(HEAD_JSON_BYTES)
    rows = _head_json(text, n)
    if rows is None:
        return None
    columns = {}
    for r in rows:
        columns.update(dict.fromkeys(r))
    return rows, list(columns)


def _head_json(text: str, n: int) -> list[dict] | None:
    """The first ``n`` objects of JSON text: one a line, or the items of one array (read object by object,
    so the text may stop mid-file); None where they are not objects read that way."""
    decoder, rows = json.JSONDecoder(), []
    body = text.lstrip()
    if body.startswith("["):
        i = len(text) - len(body) + 1
        while len(rows) < n:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i >= len(text) or text[i] == "]":
                break
            try:
                row, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                break  # an object cut at HEAD_JSON_BYTES
            rows.append(row)
    else:
        lines = text.splitlines()[:-1] if len(text) == HEAD_JSON_BYTES else text.splitlines()  # the last may be cut
        for line in (x for x in lines if x.strip()):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                return None  # datasets may read what this does not (one object over several lines)
            if len(rows) == n:
                break
    return rows if rows and all(isinstance(r, dict) for r in rows) else None


def columns_refusal(path: str, mapping: dict | None, where: str, *, key: str = "dataset.columns") -> str | None:
    """Why no prompt will come from the local dataset at ``path`` with the columns ``mapping`` (dataset.columns, at
    ``key``), judged by its first HEAD_ROWS rows: a mapped column it does not have, no question column, or no
    row of them yielding a question. None when one does, or they cannot be read cheaply (``head_rows``). The
    reason is headed by ``where`` (the config key of the dataset and its path)."""
    try:
        head = head_rows(path)
        if head is None:
            return None
        rows, columns = head
        if not rows:
            return None  # an empty file: prepare_prompts says so
        cols = find_columns(columns, mapping, where, key=key, sample=rows)
    except PromptsError as e:  # _local_files' and find_columns', the first headed by the path: where names it
        why = str(e)
        for prefix in (f"dataset {path!r}: ", f"dataset directory {path!r} "):
            why = why.removeprefix(prefix)
        return why if why.startswith((where, key)) else f"{where}: {why}"
    except (OSError, UnicodeDecodeError, EOFError, ValueError, csv.Error) as e:  # ValueError: pyarrow's ArrowInvalid
        return f"{where}: cannot read it: {e}"
    reasons = []
    for row in rows:
        try:
            extract_messages(row, fmt=cols.column, kind=cols.kind)
            if cols.id:
                row_id(row, cols.id)
            return None
        except RowError as e:
            reasons.append(str(e))
    mapped = f"{key}.{'conversation' if cols.kind == 'turns' else 'question'}"
    return (f"{where}: none of its first {len(rows)} rows holds a question in column {cols.column!r} "
            f"(e.g. {reasons[0]}); found columns {columns}; set {mapped} to the column that holds it "
            f"(question: plain text, conversation: a list of turns)")


def open_dataset(path: str, split: str, cache_dir, subset, progress: bool, mapping: dict, key: str):
    """(rows, n_rows, Columns) of the dataset; PromptsError when it is empty or has no question column."""
    mapped = [c for c in (mapping or {}).values() if c is not None]
    with _datasets_progress(progress):
        rows, n_rows, columns = _load(path, split, cache_dir, subset, mapped)
    if n_rows == 0:
        raise PromptsError(f"dataset {path!r} has no rows; check the file (or the split, for a hub dataset)")
    return rows, n_rows, find_columns(columns, mapping, f"dataset {path!r}", key=key)


@contextlib.contextmanager
def _datasets_progress(progress: bool):
    """Silence datasets' own bars when progress is off or stderr is a log file (they redraw with a
    carriage return per update; our own bar reports in plain lines), and put their state back afterwards."""
    import datasets
    was_disabled = datasets.are_progress_bars_disabled()
    silence = (not progress or not sys.stderr.isatty()) and not was_disabled
    if silence:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if silence:
            datasets.enable_progress_bars()
