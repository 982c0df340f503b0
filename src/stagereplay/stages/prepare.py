"""The prepare_model stage: a revision's model source (GGUF file, hub snapshot, local folder) as prepared snapshots in
the model store, one per precision the run needs, all from one read of the source (:mod:`stagereplay.models.store`
says how entries are keyed and shared; :mod:`stagereplay.models.snapshot` what one holds and how it is proven).

The stage's output is the run's record of the entries it uses, ``results/<run>/models/<revision>.json``: the store's
folder, and per precision the entry's key, its snapshot and weights sha256. Every model-loading job reads the entry
through it (:func:`entry_for`) and, where the entry has gone since (removed from the store to free disk), prepares it
again and refuses it unless its weights are the recorded ones."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from stagereplay.io.file_hashes import HashCache
from stagereplay.io.parquet import write_text_atomic
from stagereplay.models.sources import ModelSource, resolve_source
from stagereplay.models.store import ModelStore, StoreError, ensure, entry_key
from stagereplay.stages.input_fingerprints import check_model_unchanged, model_fingerprint
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
    check_model_unchanged(s.model_fingerprint, s.model, s.revision, s.base_dir, hashes)
    source = resolve_source(s.model, s.revision, s.base_dir)
    fingerprint = s.model_fingerprint
    if not (fingerprint or {}).get("sha256"):  # a hub model downloaded by this job: fingerprinted now
        from stagereplay.models.sources import fetch_hub_snapshot

        if source.kind == "hub":
            fetch_hub_snapshot(source, s.offline, s.allow_pickle)
        fingerprint = model_fingerprint(s.model, s.revision, s.base_dir, hashes)
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


def read_record(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path} is not a readable record of prepared models ({exc}); delete it and rerun the "
                         "workflow (rule prepare_model writes it)") from exc


def entry_for(s, precision: str, hashes: HashCache | None = None) -> Path:
    """The store entry a job of settings ``s`` loads at ``precision``: the one its run's record names, prepared
    again where it has gone from the store (and refused unless it is the recorded snapshot)."""
    record = read_record(s.prepared_models)
    planned = record.get("snapshots", {}).get(precision)
    if planned is None:
        raise StoreError(f"{s.prepared_models} records no snapshot at {precision} (it has "
                         f"{sorted(record.get('snapshots', {}))}); delete it and rerun the workflow")
    if ModelStore(record["store"]).problems(planned["key"], record.get("source_sha256")):
        log.warning("store entry %s is not in %s (removed or damaged): preparing it again", planned["key"],
                    record["store"])
    # the store the run's record names (where the entry was prepared), whatever the job's settings say
    entry = snapshots_for(dataclasses.replace(s, model_store=record["store"]), [precision], hashes)[precision]
    if entry["key"] != planned["key"] or entry["manifest"]["snapshot"]["sha256"] != planned["snapshot_sha256"]:
        raise StoreError(
            f"the store entry of {record.get('source')} at {precision} is {entry['key']} (snapshot sha256 "
            f"{entry['manifest']['snapshot']['sha256'][:16]}), not {planned['key']} ({planned['snapshot_sha256'][:16]}) "
            f"as {s.prepared_models} records: the source or the converting packages changed since this run prepared "
            "it. Rerun the workflow, which prepares it again and reruns what loaded it")
    return Path(entry["path"])
