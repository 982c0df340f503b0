"""The stages that join what the model stages wrote, and the audit's check: no model, no torch.

A model stage writes one part per shard (and precision); ``gather_ledger``, ``gather_prefixes``, ``gather_audit``
and ``gather_bridge`` join the parts in a deterministic order whatever the shard count, and :func:`check_audit`
stops the pipeline when the audit, recomputed from the saved ledger, did not reproduce it. Their jobs import this
module and the tables' schemas only, never torch, transformers or a decoder (``tests/test_job_imports.py``), so
that each starts in well under a second instead of paying for a model stack it does not use.
"""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa

from stagereplay.experiments.audit import AUDIT_SCHEMA, AuditFailedError, failures_message
from stagereplay.experiments.rows import LEDGER_SCHEMA
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet, write_text_atomic

PREFIX_SCHEMA = pa.schema([
    ("item_index", pa.int32()),
    ("item_id", pa.string()),
    ("revision", pa.string()),
    ("precision", pa.string()),
    ("status", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("stage_ids", pa.list_(pa.int32())),
    ("prefix_fingerprint", pa.string()),
    ("gold_answer", pa.string()),
])
SORT_KEYS = ["item_index", "experiment", "precision", "construction", "replica"]  # a ledger row's key, in order


def gather(parts: list[str], out_path: str, schema: pa.Schema, sort_keys: list[str]) -> None:
    """Join per-shard (and per-precision) parts in a deterministic order, whatever the shard count."""
    frames = [read_parquet(p) for p in parts]
    provs = []
    for p in parts:
        prov = read_provenance(p)
        config = dict(prov.get("config") or {})
        for key in ("shard", "n_shards"):
            config.pop(key, None)
        prov["config"] = config
        provs.append(prov)
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=schema.names)
    df = df.sort_values([k for k in sort_keys if k in df.columns], kind="stable").reset_index(drop=True)
    distinct = []  # parts that differ only by shard carry the same provenance
    for prov in provs:
        if prov not in distinct:
            distinct.append(prov)
    write_parquet(df, out_path, {"stage": "gather", "parts": distinct}, schema)


def gather_ledger(parts: list[str], out_path: str) -> None:
    gather(parts, out_path, LEDGER_SCHEMA, SORT_KEYS)


def gather_prefixes(parts: list[str], out_path: str) -> None:
    gather(parts, out_path, PREFIX_SCHEMA, ["item_index", "precision"])


def gather_audit(parts: list[str], out_path: str) -> None:
    gather(parts, out_path, AUDIT_SCHEMA, SORT_KEYS)


def gather_bridge(parts: list[str], out_path: str) -> None:
    # The bridge's schema lives beside its experiment, whose module imports torch (the caches it compares): only
    # this job pays for it.
    from stagereplay.experiments.bridge import BRIDGE_SCHEMA

    gather(parts, out_path, BRIDGE_SCHEMA, ["item_index", "precision"])


def check_audit(audit_path: str, ledger_path: str, out_path: str) -> dict:
    """Raise :class:`AuditFailedError` naming every ledger row that did not reproduce (or was never audited, or is
    duplicated); else write a small summary to ``out_path``."""
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
    write_text_atomic(out_path, json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary
