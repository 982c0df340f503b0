"""Item sources and the deterministic, seeded selection of N items.

Sources: ``synthetic`` (the embedded arithmetic set, generated from a seed), ``jsonl`` (GSM8K-style
``{"question", "answer"}`` lines with the gold answer after ``####``, or an explicit gold field), ``csv`` and
``parquet`` (with a column mapping), ``hf`` (a Hugging Face ``datasets`` dataset by name, subset and split, or a
folder written by ``save_to_disk``; the optional extra ``hf``). Every row is checked: a bad row raises an error
naming the file and the row, duplicate item ids are refused. Knows nothing of models.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
from pathlib import Path

import pandas as pd

from stagereplay.data.answers import normalize_answer, parse_fraction
from stagereplay.data.toy import synthetic_items

ITEM_COLUMNS = ["item_index", "item_id", "question", "gold_answer", "source_row"]


class DatasetError(ValueError):
    """A dataset that cannot be used as it is, with the file, the row and what to fix."""


# How pandas, spreadsheets and databases write a missing value: a question or answer of one of them is a hole in
# the data, not text.
MISSING_VALUES = frozenset(["#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                            "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"])


def _check_file(path: Path) -> None:
    if path.is_dir():
        raise DatasetError(f"dataset.path {str(path)!r} is a directory, not a file; point dataset.path at the "
                           "dataset file inside it")
    if not path.is_file():
        raise DatasetError(f"dataset.path {str(path)!r} does not exist")


def _read_text(path: Path) -> str:
    """The file's text, which must be UTF-8 (a byte-order mark is dropped); else an error naming line and byte."""
    data = path.read_bytes()

    def fix(encoding: str = "<its encoding>") -> str:
        return (f"save it as UTF-8 (for example iconv -f {encoding} -t utf-8 {path.name} > new{path.suffix}) and "
                "point dataset.path at that")

    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DatasetError(f"{path}: the file is UTF-16 (it starts with a UTF-16 byte-order mark), not UTF-8; "
                           f"{fix('utf-16')}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DatasetError(f"{path}: line {line} (byte offset {exc.start}) is not UTF-8 (byte 0x{data[exc.start]:02x})"
                           f"; {fix()}") from None
    if "\x00" in text:
        at = data.index(b"\x00")
        line = data.count(b"\n", 0, at) + 1
        raise DatasetError(f"{path}: line {line} (byte offset {at}) holds a NUL byte: the "
                           f"file looks like UTF-16 or binary, not UTF-8 text; {fix()}")
    return text.removeprefix("\ufeff")


def _check_rows(rows: list[dict], where: str) -> list[dict]:
    if not rows:
        raise DatasetError(f"{where}: the dataset has no items; point dataset.path at a file with at least one row")
    seen: dict[str, int] = {}
    for row in rows:
        if row["item_id"] in seen:
            raise DatasetError(
                f"{where}: row {row['source_row']} repeats item id {row['item_id']!r} "
                f"(first seen at row {seen[row['item_id']]}); item ids must be unique"
            )
        seen[row["item_id"]] = row["source_row"]
    return rows


class RepeatedKeyError(ValueError):
    """A JSON object that gives one key twice: ``json`` keeps the last value and drops the first without a word."""

    def __init__(self, key: str, first, last):
        super().__init__(key)
        self.key, self.first, self.last = key, first, last


def _pairs_once(pairs: list[tuple]) -> dict:
    """``object_pairs_hook`` for :func:`json.loads`: a dict, unless a key repeats (at any depth)."""
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise RepeatedKeyError(key, seen[key], value)
        seen[key] = value
    return seen


def _check_texts(raw: dict, at: str, fields: dict) -> None:
    """Every text field read must be encodable: a JSON escape of half a UTF-16 pair (``"\\ud800"``) decodes to a lone
    surrogate, which no tokenizer, Parquet file or log can write (``UnicodeEncodeError`` in a later stage)."""
    for field in dict.fromkeys(f for f in fields.values() if f):
        value = raw.get(field)
        if not isinstance(value, str):
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise DatasetError(
                f"{at}: field {field!r} holds {value[exc.start]!r} at character {exc.start}, half of a UTF-16 "
                "surrogate pair (a JSON escape such as \\ud800 without its partner), which is no character and "
                "cannot be tokenized or written; write the character itself, or its full pair (\\ud83d\\ude00 "
                "for U+1F600), or remove the row") from None


def _row(raw: dict, line_no: int, where: str, fields: dict, numeric: bool, unit: str = "line") -> dict:
    at = f"{where}: {unit} {line_no}"
    if not isinstance(raw, dict):
        raise DatasetError(f"{at} is not an object with fields; fix or remove it")
    _check_texts(raw, at, fields)
    question = raw.get(fields["question"])
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{at} has no question (field {fields['question']!r}); fix or remove it")
    if question.strip() in MISSING_VALUES:
        raise DatasetError(f"{at} has the question {question!r} (field {fields['question']!r}), which is how a "
                           "missing value is written, not a question; fix or remove it")
    for key in ("gold", "answer"):
        value = raw.get(fields[key]) if fields.get(key) else None
        if value is not None and str(value).strip() in MISSING_VALUES:
            raise DatasetError(f"{at} has the gold answer {str(value)!r} (field {fields[key]!r}), which is how a "
                               "missing value is written, not an answer; fix or remove it")
    if fields.get("gold") and raw.get(fields["gold"]) not in (None, ""):
        gold_field = fields["gold"]
        gold = normalize_answer(str(raw[fields["gold"]]))
    else:
        answer = raw.get(fields["answer"])
        if answer is None or str(answer).strip() == "":
            raise DatasetError(
                f"{at} has no gold answer (field {fields['answer']!r}); fix or remove it"
            )
        answer, gold_field = str(answer), fields["answer"]
        gold = normalize_answer(answer.rsplit("####", 1)[1]) if "####" in answer else normalize_answer(answer)
    if gold is None:
        raise DatasetError(f"{at} has an empty gold answer after '####'; fix or remove it")
    if numeric:
        try:
            eval_fraction(gold)
        except (ValueError, ZeroDivisionError):
            raise DatasetError(
                f"{at} has a non-numeric gold answer {gold!r}, but answer_format needs a number; "
                "fix the row or choose answer_format: boxed"
            ) from None
        except OverflowError:
            shown = gold if len(gold) <= 40 else f"{gold[:20]}…{gold[-8:]} ({len(gold)} characters)"
            raise DatasetError(
                f"{at} has the gold answer {shown!r} (field {gold_field!r}), a number beyond a float's range (about 1.8e308): answers are "
                "read from the model's text as written-out digits, so no answer could ever match it, and it is most "
                "likely a mistake in the row; fix the row, or choose answer_format: boxed to compare answers as text"
            ) from None
    if fields.get("id"):
        item_id = raw.get(fields["id"])
        if item_id is None or str(item_id).strip() in ("", *MISSING_VALUES):  # a float NaN's str is 'nan'
            raise DatasetError(f"{at} has no item id (field {fields['id']!r}); give it one, or leave dataset.fields.id "
                               "unset to number every row (row-000001, ...)")
        item_id = str(item_id)
    else:
        item_id = f"row-{line_no:06d}"
    return {"item_id": item_id, "question": question, "gold_answer": gold, "source_row": line_no}


def eval_fraction(s: str) -> float:
    """``s`` as a float: ValueError where it is no number, OverflowError beyond a float's range."""
    return float(parse_fraction(s))


def load_jsonl(path: str | Path, fields: dict, numeric: bool = True) -> list[dict]:
    path = Path(path)
    _check_file(path)
    rows = []
    for line_no, line in enumerate(io.StringIO(_read_text(path), newline=None), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line, object_pairs_hook=_pairs_once)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: line {line_no} is not valid JSON ({exc.msg}); fix or remove it") from None
        except RepeatedKeyError as exc:
            raise DatasetError(
                f"{path}: line {line_no} gives the key {exc.key!r} twice ({exc.first!r}, then {exc.last!r}); a JSON "
                "reader keeps only the last value, so the row would be read as other than written: remove one of "
                "them") from None
        rows.append(_row(raw, line_no, str(path), fields, numeric))
    return _check_rows(rows, str(path))


def _check_columns(names: list[str], path: Path, where: str) -> None:
    """A column named twice: a row would keep the last one's value only, read as other than written."""
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise DatasetError(f"{path}: {where} names the column {repeated[0]!r} twice ({', '.join(map(str, names))}); "
                           "a row would keep only the last one's value: rename or remove one of them")


def _read_csv(path: Path) -> pd.DataFrame:
    """Every cell a string, an empty cell ``""`` (never a NaN); a line with more fields than the header is refused
    by its line number (pandas would shift the first fields into an index, each value into the wrong column)."""
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
    header = next(reader, [])
    _check_columns(header, path, "line 1 (the header)")
    records = []
    for record in reader:
        if not record:
            continue
        if len(record) > len(header):
            raise DatasetError(
                f"{path}: line {reader.line_num} has {len(record)} fields but the header has {len(header)} "
                f"({','.join(header)}), so its values would land in the wrong columns; quote a field that holds a "
                'comma ("...") or fix the line')
        records.append(record + [""] * (len(header) - len(record)))
    return pd.DataFrame(records, columns=header, dtype=str)


def _read_parquet(path: Path) -> pd.DataFrame:
    """Every cell the Python value the file holds: an integer stays an integer and a missing one is None; a float
    column is read as pandas reads it (a missing value NaN, which the row check names)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _check_columns(pq.read_schema(path).names, path, "its schema")
    table = pq.read_table(path)
    return pd.DataFrame({
        name: column.to_pandas() if pa.types.is_floating(column.type) else pd.Series(column.to_pylist(), dtype=object)
        for name, column in zip(table.column_names, table.columns)})


def load_table(path: str | Path, fields: dict, numeric: bool = True) -> list[dict]:
    path = Path(path)
    _check_file(path)
    # A Parquet file is read as the Python values it holds: pandas would make an integer column with a missing
    # value float64, and its ids "1.0", "2.0" and "nan".
    df = _read_parquet(path) if path.suffix == ".parquet" else _read_csv(path)
    missing = [fields[k] for k in ("question",) if fields[k] not in df.columns]
    if missing:
        raise DatasetError(f"{path}: no column {missing[0]!r}; set dataset.fields to the file's column names "
                           f"(it has {list(df.columns)})")
    # Row numbers count the header as line 1, as a spreadsheet shows them.
    rows = [_row(rec, i + 2, str(path), fields, numeric, unit="row") for i, rec in enumerate(df.to_dict("records"))]
    return _check_rows(rows, str(path))


def load_hf(dataset: dict, fields: dict, numeric: bool = True, base_dir: str | Path = ".",
            offline: bool = True) -> list[dict]:
    """Rows of a Hugging Face dataset split: ``name`` is a hub id (``openai/gsm8k`` with ``subset: main``), a
    local folder of data files, or a folder written by ``save_to_disk``. Offline, only the local cache is read."""
    name, split = dataset.get("name"), dataset.get("split") or "test"
    if not name:
        raise DatasetError("dataset.source hf needs dataset.name: a hub dataset id such as openai/gsm8k, or a folder")
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read when datasets is first imported, just below
    try:
        import datasets as hf
    except ImportError:
        raise DatasetError("dataset.source hf needs the Hugging Face datasets package: "
                           "pip install 'stagereplay[hf]' (or pip install datasets)") from None
    where = f"{name} [{split}]"
    local = Path(name) if Path(name).is_absolute() else Path(base_dir) / name
    if local.is_dir() and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file()):
        data = hf.load_from_disk(str(local))
        if isinstance(data, hf.DatasetDict):
            if split not in data:
                raise DatasetError(f"{name}: no split {split!r}; set dataset.split to one of {sorted(data)}")
            data = data[split]
    else:
        try:
            data = hf.load_dataset(str(local) if local.is_dir() else name, dataset.get("subset"), split=split,
                                   revision=dataset.get("revision"))
        except Exception as exc:  # DatasetNotFoundError, ValueError (unknown split or subset), ConnectionError
            hint = (" With offline: true the dataset must already be in the local Hugging Face cache; load it once "
                    "on a machine with network access, or set offline: false.") if offline else ""
            raise DatasetError(f"cannot load the Hugging Face dataset {where}: {exc}.{hint}") from exc
    if fields["question"] not in data.column_names:
        raise DatasetError(f"{where}: no column {fields['question']!r}; set dataset.fields to the dataset's column "
                           f"names (it has {data.column_names})")
    rows = [_row(rec, i + 1, where, fields, numeric, unit="row") for i, rec in enumerate(data)]
    return _check_rows(rows, where)


def load_synthetic(size: int, seed: int) -> list[dict]:
    return [
        {"item_id": it.item_id, "question": it.question, "gold_answer": it.gold_answer, "source_row": i + 1}
        for i, it in enumerate(synthetic_items(size, seed))
    ]


DEFAULT_FIELDS = {"question": "question", "answer": "answer", "gold": None, "id": None}


def load_source(dataset: dict, base_dir: str | Path = ".", numeric: bool = True, offline: bool = True) -> list[dict]:
    source = dataset.get("source", "synthetic")
    fields = {**DEFAULT_FIELDS, **(dataset.get("fields") or {})}
    if source == "synthetic":
        return load_synthetic(int(dataset.get("size", 5000)), int(dataset.get("seed", 0)))
    if source == "hf":
        return load_hf(dataset, fields, numeric, base_dir, offline)
    path = dataset.get("path")
    if not path:
        raise DatasetError(f"dataset.source {source!r} needs dataset.path")
    path = Path(path) if Path(path).is_absolute() else Path(base_dir) / path
    if source == "jsonl":
        return load_jsonl(path, fields, numeric)
    if source in ("csv", "parquet"):
        return load_table(path, fields, numeric)
    raise DatasetError(f"dataset.source {source!r} is not one of synthetic, jsonl, csv, parquet, hf")


def choose_items(rows: list[dict], n_items: int, seed: int) -> pd.DataFrame:
    """A seeded sample of ``n_items`` rows without replacement, kept in source order."""
    if n_items > len(rows):
        raise DatasetError(f"n_items is {n_items} but the dataset has only {len(rows)} items; lower n_items")
    chosen = sorted(random.Random(f"stagereplay-select:{seed}").sample(range(len(rows)), n_items))
    df = pd.DataFrame([rows[i] for i in chosen], columns=ITEM_COLUMNS[1:])
    df.insert(0, "item_index", range(len(df)))
    return df.astype({"item_index": "int32", "source_row": "int32"})
