"""Opening a revision's model for a job: the one way from a planned model source to loaded weights.

:func:`open_model` resolves the source once, verifies once and loads; it prepares nothing and converts nothing.
Verifying is three checks, each a ``stat`` per file once the files have been hashed: the source's files are the
ones the workflow fingerprinted when it planned the job; where the run prepared the model, the store entry's files
are the ones its own record (:data:`stagereplay.models.store.HASHES`) holds; and the entry is the snapshot that the
run's record of its entries names. A store entry that is gone or damaged fails the job, naming the entry: preparing
is the prepare_model stage's (:mod:`stagereplay.stages.prepare`), which the workflow runs again before its first
job.

Knows nothing of Snakemake, stages, GPUs or decoders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from stagereplay.io.file_hashes import HashCache
from stagereplay.models.loading import LoadedModel, load_model
from stagereplay.models.snapshot import MANIFEST_FORMAT, load_snapshot
from stagereplay.models.sources import PlannedSource, check_source_unchanged
from stagereplay.models.store import ModelStore, StoreError, read_record


def open_model(source: PlannedSource, precision: str, prepared: str | Path | None, *, device: str = "auto",
               attn_implementation: str = "sdpa", numerics: str = "default", cache: HashCache | None = None,
               took: Callable[[str], None] = lambda part: None) -> LoadedModel:
    """``source`` at ``precision`` on ``device``: from the store entry that the run's record ``prepared``
    (``results/<run>/models/<revision>.json``) names at ``precision``, else (None) from the source's own files.
    ``cache`` remembers the source's digests (the workflow's, by default); ``took(part)`` is called as the
    checks end (``model files check``, ``store entry``), for the job's log of its start. The model's info names
    the source's files as they were checked (``model_sha256``, ``model_files``) where the workflow fingerprinted
    them."""
    cache = HashCache() if cache is None else cache
    resolved = source.resolve()
    check_source_unchanged(resolved, source.fingerprint, cache)
    cache.save()
    took("model files check")
    if prepared is None:
        loaded = load_model(resolved, precision, device, attn_implementation, source.trust_remote_code,
                            source.allow_pickle, source.offline, numerics=numerics)
    else:
        folder, manifest = recorded_entry(prepared, precision, (source.fingerprint or {}).get("sha256"))
        took("store entry")
        loaded = load_snapshot(folder, manifest, resolved, precision, device, attn_implementation, numerics,
                               source.trust_remote_code)
    if (source.fingerprint or {}).get("sha256"):
        loaded.info["model_sha256"] = source.fingerprint["sha256"]
        loaded.info["model_files"] = source.fingerprint["files"]
    return loaded


def recorded_entry(prepared: str | Path, precision: str, source_sha256: str | None = None) -> tuple[Path, dict]:
    """(folder, manifest) of the store entry that the run's record ``prepared`` names at ``precision``, refused
    unless it is whole (by its own record of its files), made from the source's files (``source_sha256``, else the
    record's) and the very snapshot the record names."""
    record = read_record(prepared)
    planned = record.get("snapshots", {}).get(precision)
    if planned is None:
        raise StoreError(f"{prepared} records no snapshot at {precision} (it has "
                         f"{sorted(record.get('snapshots', {}))}); delete it and rerun the workflow")
    store, key = ModelStore(record["store"]), planned["key"]
    problems = store.problems(key, source_sha256 or record.get("source_sha256"))
    if problems:
        raise StoreError(
            f"store entry {key} of {record.get('source')} at {precision} is gone or damaged in {store.root} "
            f"({'; '.join(problems)}); a job prepares nothing: rerun the workflow, which prepares it again before "
            "its first job")
    manifest = store.manifest(key)
    if (manifest.get("format"), manifest.get("precision"), manifest["snapshot"]["sha256"]) != (
            MANIFEST_FORMAT, precision, planned["snapshot_sha256"]):
        raise StoreError(
            f"store entry {key} holds the snapshot {manifest['snapshot']['sha256'][:16]} at "
            f"{manifest.get('precision')!r}, not {planned['snapshot_sha256'][:16]} at {precision!r} as {prepared} "
            "records: it was prepared again with other bytes since this run used it. Delete the record and rerun "
            "the workflow, which records the entry anew and reruns every job that loads it")
    store.touch(key)
    return store.path(key), manifest
