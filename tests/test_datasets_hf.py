"""The Hugging Face ``datasets`` source, on datasets written locally (no network)."""

import builtins
import json

import pytest

from stagereplay.data.datasets import DatasetError, load_source

hf = pytest.importorskip("datasets")

ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
    {"question": "Half of 1,000?", "answer": "#### 500"},
    {"question": "A third of 4?", "answer": "#### 4/3"},
]


@pytest.fixture()
def saved(tmp_path):
    folder = tmp_path / "gsm8k_like"
    hf.DatasetDict({"test": hf.Dataset.from_list(ROWS), "train": hf.Dataset.from_list(ROWS[:1])}).save_to_disk(folder)
    return folder


def test_dataset_saved_to_disk_by_split(saved):
    rows = load_source({"source": "hf", "name": str(saved), "split": "test"})
    assert [r["gold_answer"] for r in rows] == ["7", "500", "4/3"]
    assert [r["item_id"] for r in rows] == ["row-000001", "row-000002", "row-000003"]
    assert len(load_source({"source": "hf", "name": str(saved), "split": "train"})) == 1
    with pytest.raises(DatasetError, match=r"no split 'validation'; set dataset.split to one of \['test', 'train'\]"):
        load_source({"source": "hf", "name": str(saved), "split": "validation"})


def test_folder_of_data_files_through_load_dataset(tmp_path, monkeypatch):
    monkeypatch.setattr(hf.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "test.jsonl").write_text("".join(json.dumps({"id": f"q{i}", **r}) + "\n" for i, r in enumerate(ROWS)))
    rows = load_source({"source": "hf", "name": "files", "split": "test", "fields": {"id": "id"}},
                       base_dir=tmp_path)
    assert [r["item_id"] for r in rows] == ["q0", "q1", "q2"]


def test_bad_rows_and_columns_are_named(tmp_path):
    folder = tmp_path / "bad"
    hf.Dataset.from_list(ROWS + [{"question": "No answer here", "answer": ""}]).save_to_disk(folder)
    with pytest.raises(DatasetError, match=r"bad \[test\]: row 4 has no gold answer"):
        load_source({"source": "hf", "name": str(folder), "split": "test"})
    with pytest.raises(DatasetError, match=r"no column 'problem'.*\['question', 'answer'\]"):
        load_source({"source": "hf", "name": str(folder), "fields": {"question": "problem"}})
    dup = tmp_path / "dup"
    hf.Dataset.from_list([{"id": "a", **ROWS[0]}, {"id": "a", **ROWS[1]}]).save_to_disk(dup)
    with pytest.raises(DatasetError, match="row 2 repeats item id 'a'"):
        load_source({"source": "hf", "name": str(dup), "fields": {"id": "id"}})


def test_hub_dataset_missing_offline_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(hf.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(hf.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetError,
                       match=r"cannot load the Hugging Face dataset nobody/absent-set \[test\].*offline: true"):
        load_source({"source": "hf", "name": "nobody/absent-set", "split": "test"})


def test_missing_datasets_package_gives_an_install_hint(monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(DatasetError, match=r"pip install 'stagereplay\[hf\]'"):
        load_source({"source": "hf", "name": "openai/gsm8k", "subset": "main"})
    with pytest.raises(DatasetError, match="needs dataset.name"):
        load_source({"source": "hf"})
