import json

import pytest

from stagereplay.data.datasets import DatasetError, choose_items, load_source
from stagereplay.data.toy import make_item, target_text


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_synthetic_items_are_deterministic_and_consistent():
    a, b = make_item(7, 3), make_item(7, 3)
    assert a == b and make_item(8, 3) != a
    # the chain evaluates left to right to the gold answer
    value = eval(a.steps[0].split("=")[0])
    for step in a.steps:
        lhs, rhs = step.split("=")
        assert eval(lhs) == int(rhs)
        assert 0 <= int(rhs) <= 99
    assert int(a.steps[-1].split("=")[1]) == int(a.gold_answer) and value >= 0
    assert target_text(a).endswith(f"</think>A:{a.gold_answer}")


def test_selection_is_seeded_and_in_source_order():
    rows = load_source({"source": "synthetic", "size": 100, "seed": 0})
    s1, s2, s3 = choose_items(rows, 10, 0), choose_items(rows, 10, 0), choose_items(rows, 10, 1)
    assert s1.equals(s2) and not s1.equals(s3)
    assert list(s1["item_index"]) == list(range(10))
    assert list(s1["source_row"]) == sorted(s1["source_row"])
    with pytest.raises(DatasetError, match="only 100 items"):
        choose_items(rows, 101, 0)


def test_gsm8k_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"question": "How many?", "answer": "Two and two.\n#### 4"},
        {"question": "And now?", "answer": "#### 1,000"},
    ])
    rows = load_source({"source": "jsonl", "path": str(path)})
    assert [r["gold_answer"] for r in rows] == ["4", "1000"]
    assert [r["item_id"] for r in rows] == ["row-000001", "row-000002"]


@pytest.mark.parametrize("bad,match", [
    ('{"question": "q"', "line 2 is not valid JSON"),
    ({"answer": "#### 3"}, "line 2 has no question"),
    ({"question": "q"}, "line 2 has no gold answer"),
    ({"question": "q", "answer": "####"}, "line 2 has an empty gold answer"),
    ({"question": "q", "answer": "#### seven"}, "line 2 has a non-numeric gold answer"),
    (["a list"], "line 2 is not an object"),
])
def test_bad_jsonl_rows_name_the_line(tmp_path, bad, match):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "fine", "answer": "#### 1"}, bad])
    with pytest.raises(DatasetError, match=match):
        load_source({"source": "jsonl", "path": str(path)})


def test_duplicate_ids_and_empty_files_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "question": "q", "answer": "1"},
                                              {"id": "a", "question": "r", "answer": "2"}])
    with pytest.raises(DatasetError, match="repeats item id 'a'"):
        load_source({"source": "jsonl", "path": str(path), "fields": {"id": "id"}})
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match="no items"):
        load_source({"source": "jsonl", "path": str(empty)})
    with pytest.raises(DatasetError, match="does not exist"):
        load_source({"source": "jsonl", "path": str(tmp_path / "missing.jsonl")})


def test_csv_with_column_mapping(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("problem,solution,uid\nWhat?,42,x1\nWhy?,7,x2\n")
    fields = {"question": "problem", "gold": "solution", "id": "uid"}
    rows = load_source({"source": "csv", "path": str(path), "fields": fields})
    assert [(r["item_id"], r["gold_answer"], r["source_row"]) for r in rows] == [("x1", "42", 2), ("x2", "7", 3)]
    with pytest.raises(DatasetError, match="no column 'question'"):
        load_source({"source": "csv", "path": str(path)})
