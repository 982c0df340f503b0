"""The run's inputs by content: the dataset file's fingerprint and each revision's model files' fingerprints.

The workflow takes them when it plans (:mod:`stagereplay.io.file_hashes` keeps that to a ``stat`` per file once
a file has been hashed) and hands them to the stages in their settings. A changed input therefore changes the
params of every job that reads it, and Snakemake reruns those jobs and what depends on them; a file that is only
touched changes nothing. The stages record the fingerprints in the provenance of every file they write, where
the report's identity table reads them, and a model-loading job refuses model files that changed after the
workflow planned it (:func:`stagereplay.models.sources.check_source_unchanged`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from stagereplay.io.file_hashes import HashCache, files_fingerprint
from stagereplay.models.sources import ModelLoadError, resolve_source, source_fingerprint

FILE_SOURCES = ("jsonl", "csv", "parquet")


def dataset_file_fingerprint(dataset: dict, base_dir: str | Path = ".", cache: HashCache | None = None) -> dict | None:
    """``{"path", "sha256", "files"}`` of a file dataset; None for a synthetic one (made from its config) or a
    Hugging Face one (pinned by its name, config and revision), whose rows are fingerprinted as they are read
    (:func:`rows_fingerprint`)."""
    if dataset.get("source", "synthetic") not in FILE_SOURCES or not dataset.get("path"):
        return None
    path = Path(dataset["path"])
    path = path if path.is_absolute() else Path(base_dir) / path
    if not path.is_file():
        return None  # the preflight names a missing or mistaken path
    return {"path": str(dataset["path"]), **files_fingerprint({path.name: path}, cache)}


def rows_fingerprint(rows: list[dict]) -> str:
    """sha256 over the dataset's rows as read (every field, in file order): the content the selection drew from,
    whatever the source."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str, ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def model_fingerprint(model: str, revision: str | None, base_dir: str | Path = ".",
                      cache: HashCache | None = None) -> dict | None:
    """``{"source", "sha256", "files"}`` over the files of one revision's model source; None where the source
    cannot be resolved (the preflight names why) or is a hub model not yet in the local cache (its job records
    the hub commit it resolved instead)."""
    try:
        return source_fingerprint(resolve_source(model, revision, base_dir), cache)
    except (ModelLoadError, OSError):
        return None
