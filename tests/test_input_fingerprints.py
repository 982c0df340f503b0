"""The run's inputs by content: a changed dataset file or model file reruns what depends on it, a touched one does
not, the fingerprints are recorded in provenance, and a job refuses model files changed after planning."""

from __future__ import annotations

import os
import shutil

import pytest

from stagereplay.io import file_hashes
from stagereplay.io.file_hashes import HashCache, files_fingerprint
from stagereplay.io.parquet import read_provenance
from stagereplay.models.opening import open_model
from stagereplay.models.sources import PlannedSource, SourceChangedError, check_source_unchanged, resolve_source
from stagereplay.stages.input_fingerprints import (
    dataset_file_fingerprint,
    model_fingerprint,
    rows_fingerprint,
)
from workflow_runner import REPO, snakemake, tiny_config


def test_a_file_is_hashed_once_while_its_size_and_mtime_stay(tmp_path, monkeypatch):
    path = tmp_path / "w.bin"
    path.write_bytes(b"abc")
    calls = []
    real = file_hashes.sha256_of_file
    monkeypatch.setattr(file_hashes, "sha256_of_file", lambda p: calls.append(p) or real(p))
    cache = HashCache(tmp_path / "cache.json")
    first = cache.sha256(path)
    cache.save()
    assert HashCache(tmp_path / "cache.json").sha256(path) == first and len(calls) == 1  # remembered on disk
    os.utime(path, ns=(1, 1))  # touched: hashed again, same digest
    assert HashCache(tmp_path / "cache.json").sha256(path) == first and len(calls) == 2
    path.write_bytes(b"abd")  # edited in place, same size
    assert HashCache(tmp_path / "cache.json").sha256(path) != first


def test_a_set_of_files_changes_with_any_name_or_content(tmp_path):
    (tmp_path / "a").write_bytes(b"1")
    (tmp_path / "b").write_bytes(b"2")
    both = files_fingerprint({"a": tmp_path / "a", "b": tmp_path / "b"})
    assert files_fingerprint({"a": tmp_path / "a"})["sha256"] != both["sha256"]
    assert files_fingerprint({"a": tmp_path / "a", "c": tmp_path / "b"})["sha256"] != both["sha256"]
    assert both["files"]["a"] == file_hashes.sha256_of_file(tmp_path / "a")


def test_model_fingerprint_covers_every_file_and_a_changed_weight_is_refused(tmp_path):
    model = tmp_path / "toy"
    shutil.copytree(REPO / "data/toy/primary", model / "primary")
    recorded = model_fingerprint(str(model), "primary")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(recorded["files"])
    check_source_unchanged(resolve_source(str(model), "primary"), recorded)  # unchanged: no error
    shutil.copyfile(REPO / "data/toy/later/model.safetensors", model / "primary/model.safetensors")
    changed = r"toy/primary changed after this run was planned \(model.safetensors\)"
    with pytest.raises(SourceChangedError, match=changed):  # the job's open refuses it before loading anything
        open_model(PlannedSource(str(model), "primary", fingerprint=recorded), "fp32", None, device="cpu")
    assert model_fingerprint(str(model), "missing") is None  # the preflight names a bad revision


def test_dataset_fingerprints(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a", "question": "1+1", "answer": "2"}\n')
    fp = dataset_file_fingerprint({"source": "jsonl", "path": str(path)})
    assert fp["sha256"] == files_fingerprint({"d.jsonl": path})["sha256"]
    assert dataset_file_fingerprint({"source": "synthetic", "size": 10, "seed": 0}) is None
    assert rows_fingerprint([{"q": "1"}]) != rows_fingerprint([{"q": "2"}])


def _dry_run_jobs(workdir, target):
    out = snakemake(workdir, "-n", "--cores", "1", target).stdout
    return "Nothing to be done" not in out, out


def test_changed_inputs_rerun_and_touched_ones_do_not(tmp_path):
    """Edit the dataset file: the selection reruns; swap the weights in place: the generation reruns; touch
    either: nothing to be done. The fingerprints are in the provenance of what the jobs wrote."""
    model = tmp_path / "model"
    shutil.copytree(REPO / "data/toy/primary", model / "primary")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"id": "q{i}", "question": "{i}+{i}", "answer": "{2 * i}"}}\n' for i in range(1, 9)))
    tiny_config(tmp_path, n_items=2, max_new_tokens=4, max_stage_tokens=8, precisions=["fp32"],
                reference_precision="fp32", model=str(model), dataset={"source": "jsonl", "path": str(data)},
                bridge={"n_rows": 1, "seed": 0})
    part = "results/tiny/primary/parts/matched_fp32_0.parquet"
    snakemake(tmp_path, "--cores", "1", part)
    items = read_provenance(tmp_path / "results/tiny/selection/items.parquet")
    assert items["dataset_sha256"] == dataset_file_fingerprint({"source": "jsonl", "path": str(data)})["sha256"]
    assert len(items["dataset_fingerprint"]) == 64 and items["dataset_rows"] == 8
    assert read_provenance(tmp_path / part)["model_sha256"] == model_fingerprint(str(model), "primary")["sha256"]
    assert _dry_run_jobs(tmp_path, part)[0] is False

    os.utime(data)
    os.utime(model / "primary/model.safetensors")
    assert _dry_run_jobs(tmp_path, part)[0] is False  # touched only

    shutil.copyfile(REPO / "data/toy/later/model.safetensors", model / "primary/model.safetensors")
    rerun, out = _dry_run_jobs(tmp_path, part)
    assert rerun and "reconstruct_prefixes" in out and "select_items" not in out
    shutil.copyfile(REPO / "data/toy/primary/model.safetensors", model / "primary/model.safetensors")
    assert _dry_run_jobs(tmp_path, part)[0] is False  # the same content again

    data.write_text(data.read_text().replace('"answer": "2"', '"answer": "3"'))
    rerun, out = _dry_run_jobs(tmp_path, part)
    assert rerun and "select_items" in out
