"""The stages that join what the model stages wrote, and the audit's check: no model, no torch.

A model stage writes one part per shard (and precision); ``gather_ledger``, ``gather_prefixes``, ``gather_audit``,
``gather_bridge`` and the gathers of the later model stages (a later revision's replayed baseline, transplants, the
minimal search, onset, batch invariance, cache differences, fidelity and the cache dumps) join the parts in the
order one job writes its rows, whatever the shard count, so that the gathered file is byte-identical to the
one-shard run's; :func:`check_audit`
stops the pipeline when the audit, recomputed from the saved ledger, did not reproduce it. Their jobs import this
module and the tables' schemas only, never torch, transformers or a decoder (``tests/test_job_imports.py``), so
that each starts in well under a second instead of paying for a model stack it does not use.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from stagereplay.experiments.audit import AUDIT_SCHEMA, AuditFailedError, failures_message
from stagereplay.experiments.rows import LEDGER_SCHEMA
from stagereplay.io.keys import ITEM_FIELDS, ITEM_KEY, LEDGER_KEY, within_revision
from stagereplay.io.parquet import read_parquet, read_provenance, record_link, write_parquet, write_text_atomic
from stagereplay.io.provenance import recorded_batch_plan

PREFIX_SCHEMA = pa.schema([
    *ITEM_FIELDS,
    ("status", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("stage_ids", pa.list_(pa.int32())),
    ("prefix_fingerprint", pa.string()),
    ("gold_answer", pa.string()),
])
SORT_KEYS = within_revision(LEDGER_KEY)  # a ledger row's key in its revision's file, in order


SHARD_KEYS = ("shard", "n_shards")  # the config keys that say which part a job wrote, not what it computed


def unsharded(config: dict) -> dict:
    """A job's config less the keys naming its shard: what every shard of the job shares."""
    return {k: v for k, v in config.items() if k not in SHARD_KEYS}


def part_records(parts: list[str], per_part: tuple[str, ...] = ()) -> list[dict]:
    """The distinct provenance records of ``parts``, each less its shard keys and the ``per_part`` keys (counts of
    what that part wrote): parts that differ only by shard carry the same record."""
    distinct = []
    for p in parts:
        prov = {k: v for k, v in read_provenance(p).items() if k not in per_part}
        prov["config"] = unsharded(dict(prov.get("config") or {}))
        if prov not in distinct:
            distinct.append(prov)
    return distinct


def joined(parts: list[str], schema: pa.Schema) -> pd.DataFrame:
    frames = [read_parquet(p) for p in parts]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=schema.names)


def gather(parts: list[str], out_path: str, schema: pa.Schema, sort_keys: list[str]) -> None:
    """Join per-shard (and per-precision) parts in a deterministic order, whatever the shard count."""
    df = joined(parts, schema)
    df = df.sort_values([k for k in sort_keys if k in df.columns], kind="stable").reset_index(drop=True)
    write_parquet(df, out_path, {"stage": "gather", "parts": part_records(parts)}, schema)


def part_schema(parts: list[str]) -> pa.Schema:
    """The table's schema as its parts hold it (they were written with it): a gather need not import the stage,
    whose module loads torch."""
    return pq.read_schema(parts[0]).remove_metadata()


def item_ranks(plan: dict | None, df: pd.DataFrame) -> pd.Series:
    """Each row's item's place in the order one job takes the items: batch by batch of the recorded plan, row by
    row; without a plan (batch 1), item by item."""
    if plan is None:
        return df["item_index"].astype("int64")
    rank = {item_id: k for k, item_id in enumerate(i for batch in plan["batches"] for i in batch)}
    return df["item_id"].map(rank).astype("int64")


def in_job_order(parts: list[str], precisions: list[str], plan: dict | None, per_part: tuple[str, ...] = ()):
    """The parts' rows as one job writes them, for a stage that does not sort its table: precision by precision
    (in ``precisions``' order), item by item (:func:`item_ranks`); an item's rows stay in the order its one part
    holds them. Returns the frame, its schema and the parts' records."""
    schema = part_schema(parts)
    df = joined(parts, schema)
    keys = pd.DataFrame({"precision": df["precision"].map({p: k for k, p in enumerate(precisions)}),
                         "item": item_ranks(plan, df)})
    order = keys.sort_values(["precision", "item"], kind="stable").index
    return df.loc[order].reset_index(drop=True), schema, part_records(parts, per_part)


def part_config(parts: list[str]) -> dict:
    return read_provenance(parts[0]).get("config") or {}


def gather_sorted(parts: list[str], out_path: str, sort_keys: list[str]) -> None:
    """A stage whose one job sorts its table by ``sort_keys``: the transplants, the minimal search, the onset."""
    gather(parts, out_path, part_schema(parts), sort_keys)


def gather_transplants(parts: list[str], out_path: str) -> None:
    gather_sorted(parts, out_path, ["item_index"])


def gather_minimal_transplants(parts: list[str], out_path: str) -> None:
    gather_sorted(parts, out_path, ["item_index", "direction"])


def gather_divergence_onset(parts: list[str], out_path: str) -> None:
    gather_sorted(parts, out_path, ["precision", "item_index", "layer", "component"])


def gather_fidelity(parts: list[str], out_path: str) -> None:
    gather_sorted(parts, out_path, ["precision", "item_index", "construction", "step"])


def gather_batch_invariance(parts: list[str], out_path: str) -> None:
    """Precision by precision of the config, item by item of the selection (the items run alone, in item order)."""
    df, schema, records = in_job_order(parts, list(part_config(parts)["precisions"]), None)
    write_parquet(df, out_path, {"stage": "gather", "parts": records}, schema)


def gather_cache_differences(parts: list[str], out_path: str) -> None:
    """Precision by precision of the config, batch by batch of the prefixes' recorded plan."""
    plan = recorded_batch_plan(parts[0])
    df, schema, records = in_job_order(parts, list(part_config(parts)["precisions"]), plan)
    write_parquet(df, out_path, {"stage": "gather", "parts": records}, schema)


DUMP_COUNTS = ("files", "bytes_written")  # a dump part's own counts: the gathered manifest records the sums


def gather_caches(manifests: list[str], folders: list[str], out_dir: str, manifest_path: str) -> int:
    """The shards' cache dumps (the files their manifests list) in one folder (hard links where the file system
    allows, else copies: the same bytes) and their manifests in one, precision by precision (sorted), batch by
    batch of the baseline's plan; the provenance sums the parts' counts. Returns the bytes the dumps hold."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for manifest, folder in zip(manifests, folders, strict=True):
        for name in read_parquet(manifest)["path"]:
            f, target = Path(folder) / name, out / name
            if target.exists():
                raise FileExistsError(f"{f}: another shard dumped {name} too; the parts overlap: rerun dump_caches")
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)
            record_link(f, target)  # checked by a stat before each run, and bound to this job
    counts = {k: sum(int(read_provenance(m).get(k) or 0) for m in manifests) for k in DUMP_COUNTS}
    df, schema, records = in_job_order(manifests, sorted({p for m in manifests for p in read_parquet(m)["precision"]}),
                                       recorded_batch_plan(manifests[0]), per_part=DUMP_COUNTS)
    write_parquet(df, manifest_path, {"stage": "gather", "parts": records, **counts}, schema)
    return counts["bytes_written"]


def gather_ledger(parts: list[str], out_path: str) -> None:
    """Ledger rows in the ledger's order: the generation's parts, or a later revision's replayed baseline (rule
    ``gather_replay_baseline``: ledger rows of the transplant pair)."""
    gather(parts, out_path, LEDGER_SCHEMA, SORT_KEYS)


def gather_prefixes(parts: list[str], out_path: str) -> None:
    gather(parts, out_path, PREFIX_SCHEMA, within_revision(ITEM_KEY))


def gather_audit(parts: list[str], out_path: str) -> None:
    gather(parts, out_path, AUDIT_SCHEMA, SORT_KEYS)


def gather_bridge(parts: list[str], out_path: str) -> None:
    # The bridge's schema lives beside its experiment, whose module imports torch (the caches it compares): only
    # this job pays for it.
    from stagereplay.experiments.bridge import BRIDGE_SCHEMA

    gather(parts, out_path, BRIDGE_SCHEMA, within_revision(ITEM_KEY))


def check_audit(audit_path: str, ledger_path: str, out_path: str) -> dict:
    """Raise :class:`AuditFailedError` naming every ledger row that did not reproduce (or was never audited, or is
    duplicated); else write a small summary to ``out_path``."""
    summary = verify_audit(audit_path, ledger_path)
    write_text_atomic(out_path, json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def verify_audit(audit_path: str, ledger_path: str) -> dict:
    """:func:`check_audit` without writing anything: raise :class:`AuditFailedError` as it does, else return its
    summary."""
    audit = read_parquet(audit_path)
    ledger = read_parquet(ledger_path)
    key = SORT_KEYS
    failed = [r for r in audit.to_dict("records") if not r["reproduced"]]
    for r in failed:
        r["differed"] = list(r["differed"])
    audited = set(map(tuple, audit[key].astype(str).values.tolist()))
    for r in ledger.to_dict("records"):
        if tuple(str(r[k]) for k in key) not in audited:
            failed.append({**{k: r[k] for k in key}, "item_id": r["item_id"], "revision": r["revision"],
                           "differed": ["not_audited"], "detail": "no audit record for this ledger row"})
    duplicated = ledger[ledger.duplicated(key, keep=False)]
    for r in duplicated.to_dict("records"):
        failed.append({**{k: r[k] for k in key}, "item_id": r["item_id"], "revision": r["revision"],
                       "differed": ["duplicate_row"], "detail": "the ledger holds this key more than once"})
    if failed:
        raise AuditFailedError(failures_message(failed) + f"\nThe audit's findings stay in {audit_path}.")
    items = ledger[ledger["experiment"] == "matched"][["item_index", "precision", "construction"]].drop_duplicates()
    summary = {"audit": str(audit_path), "ledger_rows": int(len(ledger)), "audit_rows": int(len(audit)),
               "reproduced": int(audit["reproduced"].sum()), "trajectories": int(len(items))}
    return summary
