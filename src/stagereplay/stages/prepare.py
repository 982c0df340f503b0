"""The prepare_model stage: a revision's model source (GGUF file, hub snapshot, local folder) as prepared snapshots in
the model store, one per precision the run needs, all from one read of the source (:mod:`stagereplay.models.store`
says how entries are keyed and shared; :mod:`stagereplay.models.snapshot` what one holds and how it is proven).

The stage's output is the run's record of the entries it uses, ``results/<run>/models/<revision>.json``: the store's
folder, and per precision the entry's key, its snapshot and weights sha256. Every model-loading job opens the entry
through it (:func:`stagereplay.models.opening.open_model`) and prepares nothing: an entry that has gone since (removed
from the store to free disk) or is damaged is prepared again here, by :func:`prepare_again`, which the workflow runs
before its first job, and refused unless it is the recorded snapshot byte for byte."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from stagereplay.io.file_hashes import HashCache
from stagereplay.io.parquet import write_text_atomic
from stagereplay.models.sources import ModelSource, check_source_unchanged, fetch_hub_snapshot, source_fingerprint
from stagereplay.models.store import ModelStore, StoreError, ensure, entry_key, read_record
from stagereplay.stages.settings import PrepareSettings

log = logging.getLogger(__name__)
RECORD_FORMAT = 1


def _writer(source: ModelSource, fingerprint: dict | None, s, hashes: HashCache):
    """``prepare({precision: folder})`` for :func:`stagereplay.models.store.ensure`: every precision from one read."""

    def prepare(folders: dict[str, Path]) -> dict:
        from stagereplay.models.loading import set_determinism  # torch only where something is prepared
        from stagereplay.models.snapshot import write_snapshots

        set_determinism(s.threads)
        log.info("preparing %s at %s into the model store", source.describe(), ", ".join(folders))
        return write_snapshots(source, folders, source_fingerprint=fingerprint, trust_remote_code=s.trust_remote_code,
                               allow_pickle=s.allow_pickle, offline=s.offline, cache=hashes)

    return prepare


def snapshots_for(s, precisions, hashes: HashCache | None = None) -> dict[str, dict]:
    """{precision: {"key", "path", "manifest", "prepared_now"}}: the store's entries of ``s``'s revision at
    ``precisions``, prepared where missing."""
    hashes = hashes or HashCache()
    source = s.planned_source.resolve()
    check_source_unchanged(source, s.model_fingerprint, hashes)
    fingerprint = s.model_fingerprint
    if not (fingerprint or {}).get("sha256"):  # a hub model downloaded by this job: fingerprinted now
        if source.kind == "hub":
            fetch_hub_snapshot(source, s.offline, s.allow_pickle)
        fingerprint = source_fingerprint(source, hashes)
    if not (fingerprint or {}).get("sha256"):
        raise StoreError(f"cannot fingerprint the files of {source.describe()}, so its store entry has no key")
    keys = {p: entry_key(fingerprint["sha256"], source.kind, p) for p in precisions}
    store = ModelStore(s.model_store)
    entries = ensure(store, keys, fingerprint["sha256"], _writer(source, fingerprint, s, hashes))
    hashes.save()
    return entries


def prepare_model(out_record: str, s: PrepareSettings) -> dict:
    """Write ``out_record``, the run's record of the revision's store entries at ``s.precisions``; return it."""
    entries = snapshots_for(s, s.precisions)
    record = {"format": RECORD_FORMAT, "revision": s.revision, "store": str(ModelStore(s.model_store).root),
              "snapshots": {}}
    for precision, entry in entries.items():
        manifest = entry["manifest"]
        record["source"] = manifest["source"]
        record["source_sha256"] = manifest["source_fingerprint"]["sha256"]
        record["snapshots"][precision] = {
            "key": entry["key"], "snapshot_sha256": manifest["snapshot"]["sha256"], "mode": manifest["mode"],
            "weights_sha256": manifest.get("weights_sha256"), "prepared_seconds": manifest.get("seconds")}
        log.info("%s at %s: store entry %s (%s, %s)", manifest["source"], precision, entry["key"], manifest["mode"],
                 "prepared now" if entry["prepared_now"] else "already in the store")
    write_text_atomic(out_record, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def prepare_again(record_path: str | Path, s: PrepareSettings, hashes: HashCache | None = None) -> list[str]:
    """Prepare again, in the store that the run's record ``record_path`` names, every entry of it that is gone or
    damaged; return their precisions. An entry that comes out another snapshot than the record names is refused:
    the jobs that loaded the recorded one would disagree with those that load it."""
    record = read_record(record_path)
    store = ModelStore(record["store"])
    snapshots = record.get("snapshots", {})
    again = sorted(p for p, planned in snapshots.items() if store.problems(planned["key"], record.get("source_sha256")))
    if not again:
        return []
    for precision in again:
        log.warning("store entry %s (%s at %s) is not whole in %s (removed or damaged): preparing it again",
                    snapshots[precision]["key"], record.get("source"), precision, store.root)
    # the store the run's record names (where the entry was prepared), whatever the settings say
    entries = snapshots_for(dataclasses.replace(s, model_store=record["store"]), again, hashes)
    for precision in again:
        planned, entry = snapshots[precision], entries[precision]
        made = entry["manifest"]["snapshot"]["sha256"]
        if entry["key"] != planned["key"] or made != planned["snapshot_sha256"]:
            raise StoreError(
                f"the store entry of {record.get('source')} at {precision} is {entry['key']} (snapshot sha256 "
                f"{made[:16]}), not {planned['key']} ({planned['snapshot_sha256'][:16]}) as {record_path} records: "
                "the source or the converting packages changed since this run prepared it. Delete the record and "
                "rerun the workflow, which records the entry anew and reruns every job that loads it")
    return again
