"""Rows read as other than written, values no later stage can hold, a model store the run cannot use
(docs/BAD_INPUTS.md): each refused before any work, naming the file, line, field or key and the fix. Before, a
repeated JSON key was read silently (the last value won), and the others failed in a later stage with a bare
``UnicodeEncodeError``, ``OverflowError`` or an OS traceback from ``prepare_model``."""

import contextlib
import os
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stagereplay.data.answers import extract_answer, is_correct, normalize_answer
from stagereplay.data.datasets import DatasetError, load_source
from stagereplay.models.store import ModelStore, StoreError
from stagereplay.stages.preflight import check_model_store, check_run
from test_bad_inputs_data import valid_config
from test_model_store import settings
from workflow_runner import snakemake, tiny_config


def jsonl(tmp_path, *lines: str) -> dict:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return {"source": "jsonl", "path": str(path)}


# --- a key given twice --------------------------------------------------------------------------------------

def test_a_jsonl_row_giving_a_key_twice_is_refused_naming_line_and_key(tmp_path):
    dataset = jsonl(tmp_path, '{"question": "1+1", "answer": "2"}',
                    '{"question": "12+7", "question": "99+1", "answer": "19"}')
    message = (r"d.jsonl: line 2 gives the key 'question' twice \('12\+7', then '99\+1'\); a JSON reader keeps only "
               r"the last value, so the row would be read as other than written: remove one of them")
    with pytest.raises(DatasetError, match=message):
        load_source(dataset)
    with pytest.raises(DatasetError, match=message):  # the preflight, before any job
        check_run(valid_config(dataset=dataset, n_items=1))
    nested = jsonl(tmp_path, '{"question": "1+1", "answer": "2", "meta": {"src": "a", "src": "b"}}')
    with pytest.raises(DatasetError, match="line 1 gives the key 'src' twice"):
        load_source(nested)


def test_a_column_named_twice_is_refused(tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text("question,answer,question\n12+7,19,99+1\n")
    with pytest.raises(DatasetError, match=r"d.csv: line 1 \(the header\) names the column 'question' twice "
                                           r"\(question, answer, question\); a row would keep only the last"):
        load_source({"source": "csv", "path": str(csv)})
    table = pa.Table.from_arrays([pa.array(["12+7"]), pa.array(["19"]), pa.array(["99+1"])],
                                 names=["question", "answer", "question"])
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match="d.parquet: its schema names the column 'question' twice"):
        load_source({"source": "parquet", "path": str(tmp_path / "d.parquet")})


# --- values no later stage can hold ----------------------------------------------------------------------------

def test_a_lone_surrogate_is_refused_naming_line_and_field(tmp_path):
    dataset = jsonl(tmp_path, '{"question": "1+1", "answer": "2"}', '{"question": "12\\ud800+7", "answer": "19"}')
    message = (r"d.jsonl: line 2: field 'question' holds '\\ud800' at character 2, half of a UTF-16 surrogate pair "
               r".*write the character itself, or its full pair")
    with pytest.raises(DatasetError, match=message):
        load_source(dataset)
    with pytest.raises(DatasetError, match=message):
        check_run(valid_config(dataset=dataset, n_items=1))
    whole = jsonl(tmp_path, '{"question": "12+7 \\ud83d\\ude00", "answer": "19"}')  # a full pair is a character
    assert load_source(whole, numeric=True)[0]["question"] == "12+7 \U0001F600"


@pytest.mark.parametrize("gold", ["1e400", "-2.5E+309", "1" * 400, "1e999999999", "1e-400"])
def test_a_gold_answer_beyond_a_floats_range_is_refused(tmp_path, gold):
    dataset = jsonl(tmp_path, '{"question": "1+1", "answer": "2"}', f'{{"question": "big", "answer": "{gold}"}}')
    with pytest.raises(DatasetError, match=r"d.jsonl: line 2 has the gold answer '.*' \(field 'answer'\), a number "
                                           r"beyond a float's range .*fix the row, or choose answer_format: boxed"):
        load_source(dataset)
    assert load_source(dataset, numeric=False)[1]["gold_answer"]  # compared as text: accepted


def test_answers_too_large_for_a_float_are_compared_without_an_error():
    """A model may write a 400-digit fraction: its answer is the reduced fraction, never an OverflowError."""
    huge = "1" * 400 + "/7"
    assert normalize_answer(huge) == huge and extract_answer(f"A: {huge}") == huge
    assert is_correct(huge, huge) and normalize_answer("1e400") == "1e400"
    assert normalize_answer("6/4") == "3/2" and normalize_answer("1,000.0") == "1000"


# --- the model store -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` and all in it unwritable, as on a read-only mount, for root too (chmod does not stop root: the
    immutable flag does)."""
    subprocess.run(["chmod", "-R", "a-w", str(folder)], check=True)
    if os.access(folder, os.W_OK):  # links inside cannot take the flag: chattr fails on them, the rest is flagged
        subprocess.run(["chattr", "-R", "+i", str(folder)], capture_output=True)
    try:
        if os.access(folder, os.W_OK) or os.access(folder / ".locks", os.W_OK):
            pytest.skip("cannot make a folder read-only here")
        yield
    finally:
        subprocess.run(["chattr", "-R", "-i", str(folder)], capture_output=True)
        subprocess.run(["chmod", "-R", "u+w", str(folder)], check=True)


def test_a_model_store_that_is_a_file_or_read_only_is_refused(tmp_path, tiny_model_dir):
    keys = ["bf16-abc"]
    (tmp_path / "file").write_text("not a folder")
    for root in (tmp_path / "file", tmp_path / "file" / "store"):
        with pytest.raises(StoreError, match=rf"model_store: {tmp_path}/file is a file, but the run keeps its prepared "
                                             r"snapshots in the folder .*: point model_store \(config\) at a folder"):
            check_model_store(ModelStore(root), keys)
    store = tmp_path / "store"
    store.mkdir()
    check_model_store(ModelStore(store), keys)
    check_model_store(ModelStore(store / "new"), keys)  # created by the run where missing
    from stagereplay.stages.prepare import prepare_model

    prepared = prepare_model(str(tmp_path / "a.json"), settings(tiny_model_dir, store))
    whole = [entry["key"] for entry in prepared["snapshots"].values()]
    with read_only(store):
        with pytest.raises(StoreError, match=rf"model_store: the store is not writable \(read-only, or another "
                                             r"user's\), but 1 snapshot\(s\) this run loads are not prepared there yet "
                                             r"\(bf16-abc\) and prepare_model writes them into it: make it writable"):
            check_model_store(ModelStore(store), [*whole, "bf16-abc"])
        with pytest.raises(StoreError, match="where the store .*/store/new would be created, is not writable"):
            check_model_store(ModelStore(store / "new"), keys)
        check_model_store(ModelStore(store), whole)  # every entry whole: only read
        again = prepare_model(str(tmp_path / "b.json"), settings(tiny_model_dir, store))  # a read-only store serves
        assert again["snapshots"] == prepared["snapshots"]


def test_the_dry_run_refuses_a_model_store_that_is_a_file(tmp_path):
    (tmp_path / "store").write_text("not a folder")
    tiny_config(tmp_path, n_items=2, precisions=["bf16"], model_store=str(tmp_path / "store"))
    proc = snakemake(tmp_path, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert f"model_store: {tmp_path}/store is a file, but the run keeps its prepared snapshots" in out, out[-3000:]
    assert not (tmp_path / "results").exists()
