"""Stage functions of the cache-dump and transplant stages, taking paths and plain values (what rule scripts call).

Every stage works on one revision R and one precision P, over *fixed prefixes*: the primary revision's prefix ids.
Its two constructions, and each one's own continuation, come from a *baseline* file:

- at the primary revision, the ledger's matched experiment (``live`` and ``prefill``, replica 1);
- at any other revision, ``replay_baseline.parquet``, written by :func:`replay_fixed_prefixes`: R's ``incremental``
  and ``prefill`` caches built on the primary revision's prefix ids and continued (two replicas each, bit-exact).

A live cache cannot cross a process boundary. Where the baseline's construction is ``live``, the stage rebuilds
the ``incremental`` cache (the live run's own schedule) and compares its whole-cache fingerprint with the ledger's
live fingerprint: equal means the rebuilt cache *is* the live cache, byte for byte, and it is called ``live`` in the
outputs; otherwise it is called ``incremental`` (the row's ``live_fingerprint_match`` is false and a warning is
logged). Every other rebuilt cache and every own continuation is a replica of the baseline's and must match it
exactly, or the stage stops (:class:`~stagereplay.experiment.ReplicaMismatchError`).

A batched baseline (a ``batch_plan`` in its provenance, the primary revision's ledger at ``batch_size`` > 1) is
rebuilt batch by batch (:class:`BatchRebuild`): both constructions for the row's whole recorded batch, and every
transplanted continuation runs inside that batch. Replaying prefixes at another revision is not batched yet.

None of this knows Snakemake.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pyarrow as pa
from tqdm import tqdm

from stagereplay.io import cache_dumps as cache_io
from stagereplay.models import compat
from stagereplay.engine import Decoder, build_cache, continue_greedy
from stagereplay.experiment import LEDGER_SCHEMA, ReplicaMismatchError, Settings, _row, check_replicas
from stagereplay.io.fingerprints import check_fingerprint_scheme, fingerprint_ids, fingerprint_layers
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.io.provenance import software_versions
from stagereplay.models.gpus import claim_gpu
from stagereplay.fastdecode import (
    construct_batch,
    continue_in_batch,
    decoder_from_record,
    plan_record,
    recorded_plan,
    recorded_regime,
    regime_info,
)
from stagereplay.models.invariant import recorded_numerics
from stagereplay.models.loading import eos_token_ids, load_model, resolve_source, set_determinism
from stagereplay.transplant import enumerate_sweeps, run_transplants, select_items

log = logging.getLogger("stagereplay")

BASELINE_EXPERIMENT = "transplant_baseline"

SELECTION_SCHEMA = pa.schema([
    ("item_index", pa.int32()),
    ("item_id", pa.string()),
    ("revision", pa.string()),
    ("precision", pa.string()),
    ("divergent", pa.bool_()),  # the two constructions' own suffix ids differ
    ("first_divergence", pa.int32()),
])

DUMP_SCHEMA = pa.schema([
    ("item_index", pa.int32()),
    ("item_id", pa.string()),
    ("revision", pa.string()),
    ("precision", pa.string()),
    ("construction", pa.string()),
    ("path", pa.string()),  # relative to the manifest's folder
    ("bytes", pa.int64()),
    ("prefix_fingerprint", pa.string()),
    ("cache_fingerprint", pa.string()),
    ("live_fingerprint_match", pa.bool_()),  # null where the baseline has no live row
])

TRANSPLANT_SCHEMA = pa.schema([
    ("item_index", pa.int32()),
    ("item_id", pa.string()),
    ("revision", pa.string()),
    ("precision", pa.string()),
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
    ("cache_fingerprint", pa.string()),  # of the transplanted boundary cache
    ("donor_suffix_fingerprint", pa.string()),
    ("recipient_suffix_fingerprint", pa.string()),
    ("donor_cache_fingerprint", pa.string()),
    ("recipient_cache_fingerprint", pa.string()),
    ("live_fingerprint_match", pa.bool_()),  # null where the baseline has no live row
])


def _load_decoder(model, revision, precision, device, attn_implementation, threads, trust_remote_code,
                  allow_pickle, offline, base_dir, regime_from):
    """Model and decoder, the decoder in the regime recorded in ``regime_from`` (the generation's own)."""
    flags = set_determinism(threads)
    gpu = claim_gpu(device)  # a GPU of this job's own when several are visible; held until the job ends
    loaded = load_model(resolve_source(model, revision, base_dir), precision, gpu.device, attn_implementation,
                        trust_remote_code, allow_pickle, offline, numerics=recorded_numerics(regime_from))
    decoder = decoder_from_record(loaded.model, eos_token_ids(loaded), recorded_regime(regime_from))
    loaded.info.update(regime_info(decoder), gpu_slot=gpu.record())  # recorded with the model in every output's provenance
    return loaded, decoder, flags


def _provenance(loaded, flags, stage, config_slice):
    return {**software_versions(), **(loaded.info if loaded else {}), "numerics": flags, "stage": stage,
            "config": config_slice}


def construction_pairs(baseline: pd.DataFrame, precision: str) -> pd.DataFrame:
    """One row per item whose two baseline constructions both ran (status ok) at ``precision``.

    Columns: item_index, item_id, construction_a (``live`` or ``incremental``), row_a, row_p (the replica-1 rows as
    dicts), suffix_a, suffix_b (their suffix ids).
    """
    rep1 = baseline[(baseline["replica"] == 1) & (baseline["precision"] == precision)
                    & baseline["experiment"].isin(["matched", BASELINE_EXPERIMENT])]
    if rep1.empty:
        raise ValueError(f"the baseline has no rows at precision {precision!r}; transplant.precision must be one of "
                         f"the precisions the baseline ran ({sorted(baseline['precision'].unique())})")
    rows = []
    for item_index, group in rep1.groupby("item_index", sort=True):
        by = {r["construction"]: r for r in group.to_dict("records")}
        a = by.get("live") or by.get("incremental")
        p = by.get("prefill")
        if a is None or p is None or a["status"] != "ok" or p["status"] != "ok":
            continue
        rows.append({"item_index": int(item_index), "item_id": a["item_id"], "construction_a": a["construction"],
                     "row_a": a, "row_p": p, "suffix_a": list(a["suffix_ids"]), "suffix_b": list(p["suffix_ids"])})
    return pd.DataFrame(rows, columns=["item_index", "item_id", "construction_a", "row_a", "row_p", "suffix_a",
                                       "suffix_b"])


def _label(row_a: dict, row_p: dict, inc_fp: str, prefill_fp: str) -> tuple[str, bool | None]:
    """Check rebuilt fingerprints against the baseline's: the name of the ``live``/``incremental`` cache, and
    whether it is the ledger's live cache byte for byte (None where the baseline has no live row)."""
    item = row_a["item_id"]
    if prefill_fp != row_p["cache_fingerprint"]:
        raise ReplicaMismatchError(
            f"item {item!r}: the rebuilt prefill cache at {row_p['precision']} differs from the baseline's "
            "(a replica that is not bit-exact): check that the model, precision, device, threads, attention "
            "implementation and batch plan are the ones the baseline ran with")
    if row_a["construction"] == "live":
        match = inc_fp == row_a["cache_fingerprint"]
        if not match:
            log.warning("item %r: the rebuilt incremental cache is not bit-exact with the ledger's live cache; it is "
                        "labelled 'incremental', not 'live'", item)
        return ("live" if match else "incremental"), match
    if inc_fp != row_a["cache_fingerprint"]:
        raise ReplicaMismatchError(f"item {item!r}: the rebuilt incremental cache differs from the baseline's")
    return "incremental", None


def rebuild_constructions(decoder: Decoder, row_a: dict, row_p: dict) -> tuple[dict, bool | None]:
    """The two boundary caches of an item, rebuilt from its ids and checked against the baseline's fingerprints.

    Returns ({name: cache}, live_fingerprint_match) with the ``live``/``incremental`` cache first.
    """
    item = row_a["item_id"]
    prompt, stage = list(row_a["prompt_ids"]), list(row_a["stage_ids"])
    if prompt != list(row_p["prompt_ids"]) or stage != list(row_p["stage_ids"]):
        raise ValueError(f"item {item!r}: the baseline's two constructions do not share their prefix ids")
    incremental = build_cache(decoder, "incremental", prompt, stage)
    prefill = build_cache(decoder, "prefill", prompt, stage)
    name, match = _label(row_a, row_p, fingerprint_layers(compat.cache_layers(incremental))[0],
                         fingerprint_layers(compat.cache_layers(prefill))[0])
    return {name: incremental, "prefill": prefill}, match


class BatchRebuild:
    """One recorded batch of a batched baseline, both constructions rebuilt for the whole batch as the experiment
    decoded it (:func:`stagereplay.fastdecode.construct_batch`); rows are then taken, checked and continued in it."""

    def __init__(self, decoder, model, baseline: pd.DataFrame, precision: str, batch_index: int,
                 max_new_tokens: int):
        members = baseline[(baseline["replica"] == 1) & (baseline["precision"] == precision)
                           & (baseline["batch_index"] == batch_index)
                           & baseline["experiment"].isin(["matched", BASELINE_EXPERIMENT])
                           & baseline["construction"].isin(["live", "incremental"])]
        members = members.sort_values("batch_row").to_dict("records")
        if not members or [int(m["batch_row"]) for m in members] != list(range(int(members[0]["batch_rows"]))):
            raise ValueError(f"batch {batch_index} at {precision}: the baseline does not hold one live or incremental "
                             "row for every row of the recorded batch; rerun the generation")
        self.decoder, self.model, self.max_new_tokens = decoder, model, max_new_tokens
        self.prompts = [[int(i) for i in m["prompt_ids"]] for m in members]
        self.stages = [[int(i) for i in m["stage_ids"]] or None for m in members]
        self.built = {c: construct_batch(decoder, c, self.prompts, self.stages, max_new_tokens)
                      for c in ("incremental", "prefill")}

    def constructions(self, row_a: dict, row_p: dict) -> tuple[dict, dict, bool | None]:
        """({name: cache}, {name: own continuation}, live_fingerprint_match) of one row, checked against the
        baseline; the caches are copies (DynamicCache) of the row's boundary cache in its batch."""
        r = int(row_a["batch_row"])
        inc, pre = self.built["incremental"][r], self.built["prefill"][r]
        name, match = _label(row_a, row_p, fingerprint_layers(inc.cache_layers)[0],
                             fingerprint_layers(pre.cache_layers)[0])
        caches = {name: compat.cache_from_tensors(self.model, inc.cache_layers),
                  "prefill": compat.cache_from_tensors(self.model, pre.cache_layers)}
        return caches, {name: inc, "prefill": pre}, match

    def continue_row(self, row: int, recipient: str, cache):
        """The row's continuation in its batch with ``cache`` (a transplant) as its boundary cache."""
        construction = "prefill" if recipient == "prefill" else "incremental"
        return continue_in_batch(self.decoder, construction, self.prompts, self.stages, row,
                                 compat.cache_layers(cache), self.max_new_tokens)


class _Batches:
    """The batch rebuild of the row at hand, one batch held at a time (callers go batch by batch)."""

    def __init__(self, decoder, model, baseline, precision, max_new_tokens):
        self.args = (decoder, model, baseline, precision)
        self.max_new_tokens = max_new_tokens
        self.current: tuple[int, BatchRebuild] | None = None

    def of(self, row_a: dict) -> BatchRebuild:
        j = int(row_a["batch_index"])
        if self.current is None or self.current[0] != j:
            self.current = (j, BatchRebuild(*self.args, j, self.max_new_tokens))
        return self.current[1]


def _in_batch_order(pairs: pd.DataFrame, plan) -> pd.DataFrame:
    if plan is None or pairs.empty:
        return pairs
    return pairs.assign(_batch=[int(r["batch_index"]) for r in pairs["row_a"]]).sort_values(
        ["_batch", "item_index"], kind="stable").drop(columns="_batch")


def replay_fixed_prefixes(prefixes_path: str, out_path: str, *, model: str, revision: str, precision: str,
                          max_new_tokens: int, device: str = "auto", attn_implementation: str = "sdpa",
                          threads: int = 1, answer_format: str = "last_number", stage_end: str | None = "</think>",
                          trust_remote_code: bool = False, allow_pickle: bool = False, offline: bool = True,
                          base_dir: str = ".", progress: bool = True) -> None:
    """The baseline of a non-primary revision: its incremental and prefill constructions on the primary revision's
    prefix ids (``prefixes_path``, rows at ``precision`` with status ok), each continued, two replicas each."""
    config_slice = dict(model=model, revision=revision, precision=precision, max_new_tokens=max_new_tokens,
                        attn_implementation=attn_implementation, threads=threads, prefixes=str(prefixes_path))
    if recorded_plan(prefixes_path) is not None:
        raise NotImplementedError(
            f"{prefixes_path} was decoded with batch_size > 1: replaying its prefixes at revision {revision!r} would "
            "need that revision's own batched rows, which the replay does not build yet. Transplant at the primary "
            "revision only (transplant.revisions), or run with batch_size: 1")
    prefixes = read_parquet(prefixes_path)
    prefixes = prefixes[(prefixes["precision"] == precision) & (prefixes["status"] == "ok")]
    loaded, decoder, flags = _load_decoder(model, revision, precision, device, attn_implementation, threads,
                                           trust_remote_code, allow_pickle, offline, base_dir, prefixes_path)
    settings = Settings(revision, precision, None, max_new_tokens, answer_format, stage_end,
                        regime_info(decoder)["decode_regime"], numerics=loaded.info["numerics_regime"]["numerics"])
    rows = []
    for item in tqdm(prefixes.to_dict("records"), desc=f"baseline {revision}/{precision}", disable=not progress,
                     mininterval=2):
        prompt, stage = list(item["prompt_ids"]), list(item["stage_ids"])
        for construction in ("incremental", "prefill"):
            replicas = []
            for replica in (1, 2):
                cache = build_cache(decoder, construction, prompt, stage)
                whole, ks, vs = fingerprint_layers(compat.cache_layers(cache))
                cont = continue_greedy(decoder, cache, stage[-1], max_new_tokens, copy_cache=False)
                status = "nonfinite" if cont.stop_reason == "nonfinite" else "ok"
                replicas.append(_row(item, settings, BASELINE_EXPERIMENT, construction, replica, status, prompt, stage,
                                     {"cache_fingerprint": whole, "cache_k_fingerprints": ks,
                                      "cache_v_fingerprints": vs},
                                     cont.suffix_ids, cont.margins, cont.stop_reason, loaded.tokenizer))
            check_replicas(replicas, item["item_id"])
            rows += replicas
    write_parquet(pd.DataFrame(rows, columns=LEDGER_SCHEMA.names), out_path,
                  _provenance(loaded, flags, "replay_fixed_prefixes", config_slice), LEDGER_SCHEMA)


def select_transplant_items(baseline_path: str, out_path: str, *, revision: str, precision: str, select,
                            seed: int = 0) -> pd.DataFrame:
    """Write the outcome-blind transplant selection (before any transplant runs), with its rule and seed."""
    pairs = construction_pairs(read_parquet(baseline_path), precision)
    chosen = select_items(pairs[["item_index", "item_id", "suffix_a", "suffix_b"]], select, seed)
    chosen["revision"] = revision
    chosen["precision"] = precision
    n_divergent = sum(a != b for a, b in zip(pairs["suffix_a"], pairs["suffix_b"]))
    prov = {**software_versions(), "stage": "select_transplant_items",
            "selection": {"rule": select, "seed": seed, "decided_from": "suffix token ids of the two constructions "
                          "(replica 1); never correctness or transplant outcomes",
                          "n_candidates": int(len(pairs)), "n_divergent": int(n_divergent),
                          "n_selected": int(len(chosen))},
            "baseline": {"path": str(baseline_path), "stage": read_provenance(baseline_path).get("stage")},
            "config": {"revision": revision, "precision": precision, "select": select, "seed": seed}}
    chosen = chosen.astype({"first_divergence": "object"}).where(chosen.notna(), None)
    write_parquet(chosen[SELECTION_SCHEMA.names], out_path, prov, SELECTION_SCHEMA)
    log.info("selected %d of %d candidate items (%d divergent) by %r", len(chosen), len(pairs), n_divergent, select)
    return chosen


def dump_caches(baseline_path: str, out_dir: str, manifest_path: str, *, items: str, model: str, revision: str,
                device: str = "auto", attn_implementation: str = "sdpa", threads: int = 1,
                trust_remote_code: bool = False, allow_pickle: bool = False, offline: bool = True,
                base_dir: str = ".", progress: bool = True, max_new_tokens: int | None = None) -> int:
    """Dump both constructions' boundary caches of the chosen items (``divergent``, ``all`` or ``none``) at every
    precision of the baseline; returns the bytes written (also logged and recorded in the manifest).

    A batched baseline's caches are rebuilt in their recorded batch (which continues its rows: ``max_new_tokens``,
    the generation's, is then needed)."""
    if items not in ("divergent", "all", "none"):
        raise ValueError(f"dump.items must be divergent, all or none, got {items!r}")
    baseline = read_parquet(baseline_path)
    check_fingerprint_scheme(baseline_path)  # rebuilt caches are matched to its rows by cache fingerprint
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = recorded_plan(baseline_path)
    if plan is not None and max_new_tokens is None:
        raise ValueError(f"{baseline_path} is batched: dump_caches needs max_new_tokens (the generation's) to rebuild "
                         "its rows in their batch")
    config_slice = dict(model=model, revision=revision, items=items, attn_implementation=attn_implementation,
                        threads=threads, max_new_tokens=max_new_tokens)
    rows, total, loaded, flags = [], 0, None, {}
    for precision in ([] if items == "none" else sorted(baseline["precision"].unique())):
        pairs = construction_pairs(baseline, precision)
        if items == "divergent":
            pairs = pairs[[a != b for a, b in zip(pairs["suffix_a"], pairs["suffix_b"])]]
        if pairs.empty:
            continue
        loaded, decoder, flags = _load_decoder(model, revision, precision, device, attn_implementation, threads,
                                               trust_remote_code, allow_pickle, offline, base_dir, baseline_path)
        file_prov = {**_provenance(loaded, flags, "dump_caches", config_slice), "batch_plan": plan_record(plan)}
        batches = _Batches(decoder, loaded.model, baseline, precision, max_new_tokens) if plan else None
        for pair in tqdm(_in_batch_order(pairs, plan).to_dict("records"), desc=f"dump {revision}/{precision}",
                         disable=not progress):
            if batches is None:
                caches, match = rebuild_constructions(decoder, pair["row_a"], pair["row_p"])
            else:
                caches, _, match = batches.of(pair["row_a"]).constructions(pair["row_a"], pair["row_p"])
            row_a = pair["row_a"]
            for construction, cache in caches.items():
                name = cache_io.dump_filename(pair["item_index"], precision, construction)
                written = cache_io.save_cache(out / name, cache, {
                    "item_index": pair["item_index"], "item_id": pair["item_id"], "revision": revision,
                    "precision": precision, "construction": construction,
                    "prefix_fingerprint": row_a["prefix_fingerprint"], "prompt_len": len(row_a["prompt_ids"]),
                    "pending_id": int(row_a["stage_ids"][-1]), "live_fingerprint_match": match,
                    "provenance": file_prov})
                total += written["bytes"]
                rows.append({"item_index": pair["item_index"], "item_id": pair["item_id"], "revision": revision,
                             "precision": precision, "construction": construction, "path": name,
                             "bytes": written["bytes"], "prefix_fingerprint": row_a["prefix_fingerprint"],
                             "cache_fingerprint": written["cache_fingerprint"], "live_fingerprint_match": match})
    log.info("dump %s (%s items): %d files, %d bytes written", revision, items, len(rows), total)
    prov = {**_provenance(loaded, flags, "dump_caches", config_slice), "files": len(rows), "bytes_written": total,
            "batch_plan": plan_record(plan)}
    write_parquet(pd.DataFrame(rows, columns=DUMP_SCHEMA.names), manifest_path, prov, DUMP_SCHEMA)
    return total


def transplant_items(selection_path: str, baseline_path: str, out_path: str, *, sweeps: list[str], model: str,
                     revision: str, precision: str, max_new_tokens: int, device: str = "auto",
                     attn_implementation: str = "sdpa", threads: int = 1, trust_remote_code: bool = False,
                     allow_pickle: bool = False, offline: bool = True, base_dir: str = ".",
                     progress: bool = True) -> pd.DataFrame:
    """Bidirectional transplants of every selected item, for every transplant the sweeps ask for."""
    config_slice = dict(model=model, revision=revision, precision=precision, sweeps=list(sweeps),
                        max_new_tokens=max_new_tokens, attn_implementation=attn_implementation, threads=threads)
    selection = read_parquet(selection_path)
    baseline = read_parquet(baseline_path)
    check_fingerprint_scheme(baseline_path)  # rebuilt caches are matched to its rows by cache fingerprint
    plan = recorded_plan(baseline_path)
    pairs = construction_pairs(baseline, precision).set_index("item_index")
    loaded, decoder, flags = _load_decoder(model, revision, precision, device, attn_implementation, threads,
                                           trust_remote_code, allow_pickle, offline, base_dir, baseline_path)
    specs = enumerate_sweeps(sweeps, int(loaded.model.config.num_hidden_layers))
    batches = _Batches(decoder, loaded.model, baseline, precision, max_new_tokens) if plan else None
    missing = [i for i in selection["item_index"] if i not in pairs.index]
    if missing:
        raise ValueError(f"items {missing} of the selection have no baseline rows at {precision}; rerun the "
                         "selection")
    if plan is not None:  # one rebuild per batch: the selected items batch by batch
        order = [int(pairs.loc[i, "row_a"]["batch_index"]) for i in selection["item_index"]]
        selection = selection.assign(_batch=order).sort_values(["_batch", "item_index"], kind="stable")
    rows = []
    for item in tqdm(selection.to_dict("records"), desc=f"transplant {revision}/{precision}", disable=not progress):
        pair = pairs.loc[item["item_index"]]
        row_a, row_p = pair["row_a"], pair["row_p"]
        continue_with, own = None, {}
        if batches is None:
            caches, match = rebuild_constructions(decoder, row_a, row_p)
        else:  # a batched row: rebuilt, continued and transplanted inside its recorded batch
            rebuild = batches.of(row_a)
            caches, own, match = rebuild.constructions(row_a, row_p)
            row = int(row_a["batch_row"])
            continue_with = lambda recipient, cache, rebuild=rebuild, row=row: rebuild.continue_row(  # noqa: E731
                row, recipient, cache)
        expected = {row_a["construction"]: row_a, "prefill": row_p}
        suffixes, cache_fps, suffix_fps = {}, {}, {}
        for name, cache in caches.items():
            cont = own.get(name) or continue_greedy(decoder, cache, int(row_a["stage_ids"][-1]), max_new_tokens)
            # A rebuilt cache that is bit-exact with the baseline's must continue exactly as it did there; an
            # incremental cache standing in for a live one it does not equal has no baseline continuation.
            if name in expected and list(cont.suffix_ids) != list(expected[name]["suffix_ids"]):
                raise ReplicaMismatchError(
                    f"item {item['item_id']!r}: the {name} continuation rebuilt here differs from the baseline's "
                    "although the caches are bit-exact")
            suffixes[name] = cont.suffix_ids
            cache_fps[name] = fingerprint_layers(compat.cache_layers(cache))[0]
            suffix_fps[name] = fingerprint_ids(cont.suffix_ids)
        for row in run_transplants(decoder, caches, suffixes, int(row_a["stage_ids"][-1]), len(row_a["prompt_ids"]),
                                   specs, max_new_tokens, continue_with=continue_with):
            rows.append({"item_index": int(item["item_index"]), "item_id": item["item_id"], "revision": revision,
                         "precision": precision, **row,
                         "donor_suffix_fingerprint": suffix_fps[row["donor"]],
                         "recipient_suffix_fingerprint": suffix_fps[row["recipient"]],
                         "donor_cache_fingerprint": cache_fps[row["donor"]],
                         "recipient_cache_fingerprint": cache_fps[row["recipient"]],
                         "live_fingerprint_match": match})
    df = pd.DataFrame(rows, columns=TRANSPLANT_SCHEMA.names).astype(
        {"first_divergence_donor": "object", "first_divergence_recipient": "object", "live_fingerprint_match": "object"})
    all_rows = df[(df["layer_set"] == "all") & (df["component"] == "kv") & (df["positions"] == "all") & df["divergent"]]
    log.info("transplant %s/%s: %d rows; all-layer K/V transplants of divergent items following their donor: %d / %d",
             revision, precision, len(df), int((all_rows["outcome"] == "donor").sum()), len(all_rows))
    prov = {**_provenance(loaded, flags, "transplant_caches", config_slice),
            "selection": read_provenance(selection_path).get("selection"), "batch_plan": plan_record(plan)}
    write_parquet(df, out_path, prov, TRANSPLANT_SCHEMA)
    return df
