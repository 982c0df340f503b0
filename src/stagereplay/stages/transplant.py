"""Stages of the cache dumps and the transplants, at one revision R over the primary revision's prefix ids.

The two constructions of ``transplant.constructions`` (``live`` and ``prefill`` by default) and each one's own
continuation come from a *baseline* file: at the primary revision the ledger (matched or fixed-prefix rows), at any
other revision ``replay_baseline.parquet`` (:func:`replay_fixed_prefixes`: R's constructions on the primary's prefix
ids, two replicas each, in the primary's batch plan).

A live cache cannot cross a process boundary: ``live`` is rebuilt by its own schedule (``incremental``) in the
row's recorded batch, and its fingerprint is compared with the ledger's live one; equal means the rebuilt cache *is*
the live cache, byte for byte (``live_fingerprint_match``), otherwise the rows say ``incremental``. Every other
rebuilt cache and every own continuation must equal the baseline's exactly, or the stage stops.

The outcome-blind selection of the items to transplant (``select_transplant_items``, with ``baseline_rows``) loads
no model and lives in :mod:`stagereplay.stages.transplant_selection`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pyarrow as pa

from stagereplay.decode.plans import BatchPlan, batches_of
from stagereplay.experiments.matched import fixed_prefix
from stagereplay.experiments.packing import packing_refusal
from stagereplay.experiments.recipe import DecodeSettings, ReplicaMismatchError, run
from stagereplay.experiments.rows import LEDGER_SCHEMA
from stagereplay.experiments.transplant import transplant_batch
from stagereplay.experiments.transplant_specs import enumerate_sweeps, rebuilt_as
from stagereplay.io import cache_dumps
from stagereplay.io.fingerprints import check_fingerprint_scheme, fingerprint_ids
from stagereplay.io.keys import ITEM_FIELDS
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.io.provenance import recorded_batch_plan, software_versions
from stagereplay.stages.gather import unsharded
from stagereplay.stages.jobs import config_of, load_as_recorded
from stagereplay.stages.progress import progress
from stagereplay.stages.settings import DumpSettings, ReplaySettings, TransplantSettings
from stagereplay.stages.transplant_selection import BASELINE_EXPERIMENT, baseline_pair, baseline_rows

log = logging.getLogger("stagereplay")

DUMP_SCHEMA = pa.schema([
    *ITEM_FIELDS,
    ("construction", pa.string()),
    ("path", pa.string()),  # relative to the manifest's folder
    ("bytes", pa.int64()),
    ("prefix_fingerprint", pa.string()),
    ("cache_fingerprint", pa.string()),
    ("live_fingerprint_match", pa.bool_()),  # null where the pair has no live construction
])

TRANSPLANT_SCHEMA = pa.schema([
    *ITEM_FIELDS,
    ("donor", pa.string()),
    ("recipient", pa.string()),
    ("direction", pa.string()),  # "<donor>-><recipient>"
    ("sweep", pa.string()),  # the config sweep that asked for this transplant (the first, if several did)
    ("layer_set", pa.string()),  # "all", "L7", "0-11", ...
    ("layers", pa.list_(pa.int32())),
    ("component", pa.string()),  # kv | k | v
    ("positions", pa.string()),  # all | prompt | stage
    ("divergent", pa.bool_()),  # donor's and recipient's own continuations differ
    ("outcome", pa.string()),  # donor | recipient | neither
    ("first_divergence_donor", pa.int32()),
    ("first_divergence_recipient", pa.int32()),
    ("suffix_ids", pa.list_(pa.int32())),
    ("suffix_fingerprint", pa.string()),
    ("margins", pa.list_(pa.float32())),
    ("stop_reason", pa.string()),
    ("cache_fingerprint", pa.string()),  # of the transplanted boundary cache, as the continuation read it
    ("donor_suffix_fingerprint", pa.string()),
    ("recipient_suffix_fingerprint", pa.string()),
    ("donor_cache_fingerprint", pa.string()),
    ("recipient_cache_fingerprint", pa.string()),
    ("live_fingerprint_match", pa.bool_()),  # null where the pair has no live construction
    # the controls (docs/STUDY.md, "Controls of the localisation"): no-op, placebo, sham
    ("noop", pa.bool_()),  # the transplanted bytes are identical in donor and recipient: evidence of nothing
    ("placebo_kind", pa.string()),  # shifted | negated (the donor-minus-recipient difference moved or negated)
    ("placebo_outcome", pa.string()),  # donor | recipient | neither, for the placebo of the same spec
    ("placebo_first_divergence_donor", pa.int32()),
    ("placebo_first_divergence_recipient", pa.int32()),
    ("placebo_suffix_fingerprint", pa.string()),
    ("placebo_stop_reason", pa.string()),
    ("placebo_cache_fingerprint", pa.string()),
    ("sham_cache_fingerprint", pa.string()),  # the recipient's own bytes written back: equals its own, or the stage stops
    ("layout_pad", pa.int32()),  # the recipient row's layout in its batch (the donor's is the same)
    ("layout_position", pa.int32()),
    ("rows_transplanted", pa.int32()),  # rows of the batch transplanted in the same decode (the others checked unchanged)
])


class Rebuild:
    """Both constructions of the pair rebuilt for one batch of the baseline, checked against its rows."""

    def __init__(self, job, batch, pairs: dict[int, dict], pair, settings: DecodeSettings, keep: set[int]):
        self.batch, self.pair, self.settings, self.job = batch, tuple(pair), settings, job
        members = [pairs.get(int(item["item_index"])) for item in batch.items]
        self.prompts = [[int(i) for i in item["prompt_ids"]] for item in batch.items]
        # rows of the batch without both constructions are filler (as in the experiment, rows without a prefix)
        self.stages = [[int(i) for i in m["row_a"]["stage_ids"]] if m else None for m in members]
        self.own = {name: run(job.decoder, rebuilt_as(name), self.prompts, settings, stages=self.stages, keep=keep)
                    for name in self.pair}
        self.names, self.match = {}, {}
        for r, m in enumerate(members):
            if m is not None:
                self.names[r], self.match[r] = self._check(r, m)

    def _check(self, r: int, m: dict) -> tuple[dict, bool | None]:
        """Names of the row's two rebuilt caches (``live`` only when bit-exact with the ledger's live cache) and
        whether a live one matched; stops on any other difference from the baseline."""
        names, match = {}, None
        for name, row in zip(self.pair, (m["row_a"], m["row_b"])):
            res = self.own[name][r]
            same = res.fingerprints[0] == row["cache_fingerprint"]
            names[name] = name
            if name == "live":  # rebuilt by its own schedule: live only if bit-exact with the ledger's live cache
                match = same
                if not same:
                    names[name] = "incremental"
                    log.warning("item %r: the rebuilt incremental cache is not bit-exact with the ledger's live "
                                "cache; it is labelled 'incremental', not 'live'", row["item_id"])
                    continue  # no baseline continuation to compare with
            elif not same:
                raise ReplicaMismatchError(
                    f"item {row['item_id']!r}: the rebuilt {name} cache at {row['precision']} differs from the "
                    "baseline's (a replica that is not bit-exact): check that the model, precision, device, threads, "
                    "attention implementation and batch plan are the ones the baseline ran with")
            if list(res.suffix_ids) != list(row["suffix_ids"]):
                raise ReplicaMismatchError(f"item {row['item_id']!r}: the {name} continuation rebuilt here differs "
                                           "from the baseline's although the caches are bit-exact")
        return names, match


class Packing:
    """Whether a stage's decodes are packed (:mod:`stagereplay.experiments.packing`): as asked
    (``transplant.pack``), refused for a batch size the decoder cannot pack (warned once, recorded)."""

    def __init__(self, asked: bool, decoder):
        self.asked, self.decoder, self.refused = bool(asked), decoder, {}

    def on(self, rows: int) -> bool:
        if not self.asked:
            return False
        if rows not in self.refused:
            self.refused[rows] = packing_refusal(self.decoder, rows)
            if self.refused[rows]:
                log.warning("transplant.pack: packing refused for batches of %d rows (%s); they run unpacked", rows,
                            self.refused[rows])
        return self.refused[rows] is None

    def record(self) -> dict:
        """What provenance says: asked or not, and each refused batch size with the reason."""
        return {"asked": self.asked, "refused": {str(k): v for k, v in sorted(self.refused.items()) if v}}


def replay_fixed_prefixes(prefixes_path: str, items_path: str, out_path: str, s: ReplaySettings) -> None:
    """The baseline of a non-primary revision for this shard's batches: the transplant pair (``live`` rebuilt as
    ``incremental``) on the primary revision's prefix ids at ``s.precision``, in the primary's batch plan, two
    replicas each (``gather_replay_baseline`` joins the shards' parts)."""
    prefixes = read_parquet(prefixes_path)
    prefixes = prefixes[(prefixes["precision"] == s.precision)]
    selection = read_parquet(items_path)
    plan = BatchPlan.from_record(recorded_batch_plan(prefixes_path))
    batches = batches_of(selection.to_dict("records"), plan, s.shard, s.n_shards, source=prefixes_path)
    by_index = {int(r["item_index"]): r for r in prefixes.to_dict("records")}
    job = load_as_recorded(s, s.precision, prefixes_path)
    settings = job.run_settings()
    pair = tuple(rebuilt_as(c) for c in s.constructions)
    rows = []
    for batch in progress(batches, f"replay_fixed_prefixes {s.revision}/{s.precision} shard {s.shard}",
                          enabled=s.progress):
        refs = [by_index.get(int(item["item_index"])) for item in batch.items]
        prompts = [[int(i) for i in ref["prompt_ids"]] for ref in refs]
        stages = [[int(i) for i in ref["stage_ids"]] if ref["status"] == "ok" else None for ref in refs]
        rows += fixed_prefix(job.decoder, batch, prompts, stages, settings, job.loaded.tokenizer, pair=pair,
                             experiment=BASELINE_EXPERIMENT)
    prov = job.provenance("replay_fixed_prefixes", config_of(s), batch_plan=None if plan is None else plan.record())
    write_parquet(pd.DataFrame(rows, columns=LEDGER_SCHEMA.names), out_path, prov, LEDGER_SCHEMA)


def batches_with(baseline_path: str, baseline: pd.DataFrame, precision: str, items: set[int], shard: int = 0,
                  n_shards: int = 1):
    """The plan and the batches of shard ``shard`` of ``n_shards`` (in the baseline's recorded plan, else each item
    alone, split as the generation splits them) that hold ``items``; every item of a batch comes with its prompt
    ids, since the batch's layout depends on all of them."""
    plan = BatchPlan.from_record(recorded_batch_plan(baseline_path))
    rows = baseline[(baseline["precision"] == precision) & (baseline["replica"] == 1)]
    records = list({int(r["item_index"]): {"item_index": int(r["item_index"]), "item_id": r["item_id"],
                                           "prompt_ids": list(r["prompt_ids"])}
                    for r in rows.to_dict("records")}.values())
    batches = batches_of(records, plan, shard, n_shards, source=baseline_path)
    return plan, [b for b in batches if any(int(it["item_index"]) in items for it in b.items)]


def dump_caches(baseline_path: str, out_dir: str, manifest_path: str, s: DumpSettings) -> int:
    """Dump both constructions' boundary caches of the chosen items (``divergent``, ``all`` or ``none``) of this
    shard's batches at every precision of the baseline, rebuilt in their recorded batch; returns the bytes written.
    A dump's file records no shard, so that every shard count dumps the same bytes (``gather_caches`` joins them)."""
    if s.items not in ("divergent", "all", "none"):
        raise ValueError(f"dump.items must be divergent, all or none, got {s.items!r}")
    baseline = read_parquet(baseline_path)
    check_fingerprint_scheme(baseline_path)  # rebuilt caches are matched to its rows by cache fingerprint
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pair = baseline_pair(baseline_path, s.constructions)
    rows, total, job, plan = [], 0, None, None
    for precision in ([] if s.items == "none" else sorted(baseline["precision"].unique())):
        pairs = baseline_rows(baseline, precision, pair)
        if s.items == "divergent":
            pairs = pairs[[a != b for a, b in zip(pairs["suffix_a"], pairs["suffix_b"])]]
        if pairs.empty:
            continue
        job = load_as_recorded(s, precision, baseline_path)
        settings = job.decode_settings()
        by_index = {int(p["item_index"]): p for p in pairs.to_dict("records")}
        plan, batches = batches_with(baseline_path, baseline, precision, set(by_index), s.shard, s.n_shards)
        prov = job.provenance("dump_caches", unsharded(config_of(s)),
                              batch_plan=None if plan is None else plan.record())
        for batch in progress(batches, f"dump_caches {s.revision}/{precision} shard {s.shard}", enabled=s.progress):
            wanted = {r for r, it in enumerate(batch.items) if int(it["item_index"]) in by_index}
            rebuild = Rebuild(job, batch, by_index, pair, settings, keep=wanted)
            for r in sorted(wanted):
                p = by_index[int(batch.items[r]["item_index"])]
                row_a = p["row_a"]
                for name in pair:
                    label = rebuild.names[r][name]
                    filename = cache_dumps.dump_filename(p["item_index"], precision, label)
                    written = cache_dumps.save_cache(out / filename, rebuild.own[name][r].layers, {
                        "item_index": p["item_index"], "item_id": p["item_id"], "revision": s.revision,
                        "precision": precision, "construction": label,
                        "prefix_fingerprint": row_a["prefix_fingerprint"], "prompt_len": len(row_a["prompt_ids"]),
                        "pending_id": int(row_a["stage_ids"][-1]), "live_fingerprint_match": rebuild.match[r],
                        "provenance": prov})
                    total += written["bytes"]
                    rows.append({"item_index": p["item_index"], "item_id": p["item_id"], "revision": s.revision,
                                 "precision": precision, "construction": label, "path": filename,
                                 "bytes": written["bytes"], "prefix_fingerprint": row_a["prefix_fingerprint"],
                                 "cache_fingerprint": written["cache_fingerprint"],
                                 "live_fingerprint_match": rebuild.match[r]})
    log.info("dump %s (%s items): %d files, %d bytes written", s.revision, s.items, len(rows), total)
    base = (job.provenance("dump_caches", config_of(s)) if job else
            {**software_versions(), "stage": "dump_caches", "config": config_of(s)})
    prov = {**base, "files": len(rows), "bytes_written": total, "batch_plan": None if plan is None else plan.record()}
    write_parquet(pd.DataFrame(rows, columns=DUMP_SCHEMA.names), manifest_path, prov, DUMP_SCHEMA)
    return total


def transplant_caches(selection_path: str, baseline_path: str, out_path: str, s: TransplantSettings) -> pd.DataFrame:
    """Bidirectional transplants of every selected item of this shard's batches, for every transplant the sweeps
    ask for, each in the item's recorded batch and layout."""
    selection = read_parquet(selection_path)
    baseline = read_parquet(baseline_path)
    check_fingerprint_scheme(baseline_path)
    pair = baseline_pair(baseline_path, s.constructions)
    pairs = baseline_rows(baseline, s.precision, pair)
    by_index = {int(p["item_index"]): p for p in pairs.to_dict("records")}
    missing = [int(i) for i in selection["item_index"] if int(i) not in by_index]
    if missing:
        raise ValueError(f"items {missing} of the selection have no baseline rows at {s.precision}; rerun the "
                         "selection")
    job = load_as_recorded(s, s.precision, baseline_path)
    settings = job.decode_settings()
    specs = enumerate_sweeps(s.sweeps, int(job.loaded.model.config.num_hidden_layers))
    chosen = {int(i) for i in selection["item_index"]}
    plan, batches = batches_with(baseline_path, baseline, s.precision, chosen, s.shard, s.n_shards)
    packing = Packing(s.pack, job.decoder)
    rows = []
    for batch in progress(batches, f"transplant_caches {s.revision}/{s.precision} shard {s.shard}", enabled=s.progress):
        wanted = {r for r, it in enumerate(batch.items) if int(it["item_index"]) in chosen}
        rebuild = Rebuild(job, batch, by_index, pair, settings, keep=wanted)
        done = transplant_batch(job.decoder, rebuild.prompts, rebuild.stages, settings, rebuild.own, sorted(wanted),
                                specs, labels=rebuild.names, pack=packing.on(len(batch.items)))
        for r in sorted(wanted):
            item = batch.items[r]
            fps = {rebuild.names[r][name]: (rebuild.own[name][r].fingerprints[0], rebuild.own[name][r].suffix_ids)
                   for name in pair}
            for row in done[r]:
                donor, recipient = row["donor"], row["recipient"]
                rows.append({"item_index": int(item["item_index"]), "item_id": item["item_id"],
                             "revision": s.revision, "precision": s.precision, **row,
                             "donor_suffix_fingerprint": fingerprint_ids(fps[donor][1]),
                             "recipient_suffix_fingerprint": fingerprint_ids(fps[recipient][1]),
                             "donor_cache_fingerprint": fps[donor][0],
                             "recipient_cache_fingerprint": fps[recipient][0],
                             "live_fingerprint_match": rebuild.match[r]})
    df = pd.DataFrame(rows, columns=TRANSPLANT_SCHEMA.names).astype(
        {c: "object" for c in ("first_divergence_donor", "first_divergence_recipient", "live_fingerprint_match",
                               "placebo_first_divergence_donor", "placebo_first_divergence_recipient")})
    df = df.sort_values(["item_index"], kind="stable").reset_index(drop=True)
    all_rows = df[(df["layer_set"] == "all") & (df["component"] == "kv") & (df["positions"] == "all") & df["divergent"]]
    log.info("transplant %s/%s: %d rows; all-layer K/V transplants of divergent items following their donor: %d / %d",
             s.revision, s.precision, len(df), int((all_rows["outcome"] == "donor").sum()), len(all_rows))
    prov = job.provenance("transplant_caches", config_of(s), selection=read_provenance(selection_path).get("selection"),
                          batch_plan=None if plan is None else plan.record(), packing=packing.record())
    write_parquet(df, out_path, prov, TRANSPLANT_SCHEMA)
    return df
