"""The run's inputs by content: the dataset file's fingerprint and each revision's model files' fingerprints.

The workflow takes them when it plans (:mod:`stagereplay.io.file_hashes` keeps that to a ``stat`` per file once
a file has been hashed) and hands them to the stages in their settings. A changed input therefore changes the
params of every job that reads it, and Snakemake reruns those jobs and what depends on them; a file that is only
touched changes nothing. The stages record the fingerprints in the provenance of every file they write, where
the report's identity table reads them, and a model-loading job refuses model files that changed after the
workflow planned it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from stagereplay.io.file_hashes import HashCache, files_fingerprint, folder_files
from stagereplay.models.sources import ModelLoadError, ModelSource, fetch_hub_snapshot, resolve_source

FILE_SOURCES = ("jsonl", "csv", "parquet")


class InputChangedError(RuntimeError):
    """An input file's content is not the one the workflow planned the job with."""


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


def source_files(source: ModelSource) -> dict[str, Path] | None:
    """The files a model source is loaded from, by name; None for a hub model not in the local cache."""
    if source.kind == "gguf":
        return {source.gguf_file: Path(source.path) / source.gguf_file}
    if source.kind == "hub":
        try:
            source, _ = fetch_hub_snapshot(source, offline=True)
        except ModelLoadError:
            return None
    return folder_files(source.path)


def model_fingerprint(model: str, revision: str | None, base_dir: str | Path = ".",
                      cache: HashCache | None = None) -> dict | None:
    """``{"source", "sha256", "files"}`` over the files of one revision's model source; None where the source
    cannot be resolved (the preflight names why) or is a hub model not yet in the local cache (its job records
    the hub commit it resolved instead)."""
    try:
        source = resolve_source(model, revision, base_dir)
        files = source_files(source)
    except (ModelLoadError, OSError):
        return None
    if files is None:
        return None
    return {"source": source.describe(), **files_fingerprint(files, cache)}


def check_model_unchanged(recorded: dict | None, model: str, revision: str | None, base_dir: str | Path = ".",
                          cache: HashCache | None = None) -> None:
    """Refuse model files whose content is no longer the one recorded when the workflow planned the job."""
    if not recorded or not recorded.get("sha256"):
        return
    now = model_fingerprint(model, revision, base_dir, cache)
    if now is None or now["sha256"] != recorded["sha256"]:
        changed = sorted(name for name in set(recorded["files"]) | set((now or {}).get("files", {}))
                         if recorded["files"].get(name) != (now or {}).get("files", {}).get(name))
        raise InputChangedError(
            f"the model files of {recorded['source']} changed after this run was planned ({', '.join(changed)}); "
            "rerun the workflow so that every result comes from one set of weights")
