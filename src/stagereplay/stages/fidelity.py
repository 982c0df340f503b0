"""Stage ``measure_fidelity``: per item, precision and construction pair, how far the construction's next-token
distributions lie from the live reference's along the reference's own suffix
(:mod:`stagereplay.experiments.fidelity`), one row per suffix step. Every batch of the recorded plan is decoded as
the generation decoded it (its prompts from the ledger, its rows, its regime); the regenerated live rows must be
the ledger's, and a construction's cache must be the ledger's where the matched experiment recorded one. Its
gather (``gather_fidelity``) loads no model and lives in :mod:`stagereplay.stages.gather`."""

from __future__ import annotations

import logging

import pandas as pd

from stagereplay.decode.greedy import matcher_from_config
from stagereplay.decode.plans import BatchPlan, batches_of
from stagereplay.experiments.bridge import choose_bridge_items
from stagereplay.experiments.fidelity import FIDELITY_SCHEMA, REFERENCE, fidelity_batch
from stagereplay.io.fingerprints import check_fingerprint_scheme
from stagereplay.io.parquet import read_parquet, write_parquet
from stagereplay.io.provenance import recorded_batch_plan
from stagereplay.stages.jobs import config_of, load_as_recorded
from stagereplay.stages.progress import progress
from stagereplay.stages.settings import FidelitySettings

log = logging.getLogger("stagereplay")


def fidelity_items(item_indexes, items, seed: int) -> set[int]:
    """The items compared: every one (``all``) or a seeded sample of ``items`` of them, drawn from the selection's
    item indexes alone (before anything is compared)."""
    pool = [int(i) for i in item_indexes]
    if items == "all":
        return set(pool)
    if isinstance(items, str) and items.isdigit():  # --config fidelity={items: 50} gives the text
        items = int(items)
    if isinstance(items, bool) or not isinstance(items, int) or items < 1:
        raise ValueError(f"fidelity.items is {items!r}; give all or a whole number of items, at least 1")
    return set(choose_bridge_items(pool, items, seed))


def measure_fidelity(items_path: str, ledger_path: str, out_path: str, s: FidelitySettings) -> pd.DataFrame:
    """The fidelity rows of one precision and shard, each batch of the ledger's recorded plan decoded whole."""
    selection = read_parquet(items_path)
    ledger = read_parquet(ledger_path)
    check_fingerprint_scheme(ledger_path)  # rebuilt caches are checked against its fingerprints
    plan = BatchPlan.from_record(recorded_batch_plan(ledger_path))
    wanted = fidelity_items(selection["item_index"], s.items, s.items_seed)
    batches = [b for b in batches_of(selection.to_dict("records"), plan, s.shard, s.n_shards, ledger_path)
               if any(int(item["item_index"]) in wanted for item in b.items)]
    rep1 = ledger[(ledger["experiment"] == "matched") & (ledger["replica"] == 1) & (ledger["precision"] == s.precision)]
    recorded = {int(r["item_index"]): r for r in rep1[rep1["construction"] == REFERENCE].to_dict("records")}
    missing = [item["item_id"] for b in batches for item in b.items if int(item["item_index"]) not in recorded]
    if missing:
        raise KeyError(f"items {missing[:5]} have no matched live row at {s.precision} in {ledger_path}; rerun "
                       "reconstruct_prefixes (the fidelity stage regenerates the recorded prompts)")
    ours = rep1[rep1["construction"].isin(s.constructions) & (rep1["status"] == "ok")]
    recorded_caches = {(int(r["item_index"]), r["construction"]): r["cache_fingerprint"]
                       for r in ours.to_dict("records")}
    job = load_as_recorded(s, s.precision, ledger_path)
    tokenizer = job.loaded.tokenizer
    matcher = matcher_from_config(s.boundary, tokenizer)
    settings = job.run_settings()
    rows = []
    for batch in progress(batches, f"measure_fidelity {s.revision}/{s.precision} shard {s.shard}", enabled=s.progress):
        prompts = [[int(i) for i in recorded[int(item["item_index"])]["prompt_ids"]] for item in batch.items]
        rows += fidelity_batch(job.decoder, batch, prompts, settings, matcher, tuple(s.constructions),
                               recorded=recorded, recorded_caches=recorded_caches, wanted=wanted)
    df = pd.DataFrame(rows, columns=FIDELITY_SCHEMA.names)
    prov = job.provenance("measure_fidelity", config_of(s), batch_plan=None if plan is None else plan.record(),
                          fidelity={"reference": REFERENCE, "constructions": list(s.constructions),
                                    "items": s.items, "items_seed": s.items_seed, "n_items": len(wanted),
                                    "max_new_tokens": s.max_new_tokens})
    write_parquet(df, out_path, prov, FIDELITY_SCHEMA)
    log.info("fidelity %s/%s shard %d: %d steps of %d items x %d constructions", s.revision, s.precision, s.shard,
             len(df), df["item_index"].nunique(), len(s.constructions))
    return df
