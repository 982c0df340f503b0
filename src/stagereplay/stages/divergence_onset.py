"""Stage ``measure_divergence_onset``: for every divergent item of the transplant pair, at every precision of the
transplant baseline, where its two boundary caches first differ (layer, then position), how far apart they are at
each layer (max-abs and RMS, K and V), and the top-2 margins at the first divergent suffix token.

The caches are the transplant pair's (``live`` rebuilt by its own schedule and named ``live`` only when bit-exact
with the ledger's, as in the transplant stage), rebuilt in the item's recorded batch and checked against the
baseline (:class:`~stagereplay.stages.transplant.Rebuild`); the margins are the baseline's. Unlike figure 4's
seeded sample (``measure_cache_differences``), the items are chosen by divergence: this table describes divergent
items, never the rate at which caches differ.
"""

from __future__ import annotations

import logging

import pandas as pd
import pyarrow as pa

from stagereplay.experiments.cache_differences import layer_differences
from stagereplay.io.fingerprints import check_fingerprint_scheme
from stagereplay.io.ids import first_divergence
from stagereplay.io.keys import ITEM_FIELDS
from stagereplay.io.parquet import read_parquet, write_parquet
from stagereplay.io.provenance import software_versions
from stagereplay.stages.jobs import config_of, load_as_recorded
from stagereplay.stages.progress import progress
from stagereplay.stages.settings import OnsetSettings
from stagereplay.stages.transplant import Rebuild, batches_with
from stagereplay.stages.transplant_selection import baseline_pair, baseline_rows

log = logging.getLogger("stagereplay")

ONSET_SCHEMA = pa.schema([
    *ITEM_FIELDS,
    ("construction_a", pa.string()),  # the pair as the rows name it (live only where bit-exact with the ledger's)
    ("construction_b", pa.string()),
    ("layer", pa.int32()),
    ("component", pa.string()),  # k | v
    ("bit_equal", pa.bool_()),
    ("max_abs", pa.float64()),  # over positions, heads and channels, in fp64 from the cache's dtype
    ("rms", pa.float64()),
    ("first_position_differs", pa.int32()),  # in this layer and component; null when bit-identical
    ("n_positions", pa.int32()),  # boundary-cache positions
    ("prompt_length", pa.int32()),
    # per item, repeated on each of its rows
    ("onset_layer", pa.int32()),  # the first layer whose K or V bytes differ (null: the caches are bit-identical)
    ("onset_position", pa.int32()),  # the first differing position in that layer, K or V
    ("first_divergence", pa.int32()),  # index of the first suffix token that differs
    ("margin_a", pa.float32()),  # construction a's top-2 margin there (null past its suffix's end)
    ("margin_b", pa.float32()),
    ("live_fingerprint_match", pa.bool_()),  # null where the pair has no live construction
])


def onset(rows: list[dict]) -> tuple[int | None, int | None]:
    """The first layer whose K or V differs, and the first differing position in it, from
    :func:`~stagereplay.experiments.cache_differences.layer_differences` rows."""
    differing = [r for r in rows if not r["bit_equal"]]
    if not differing:
        return None, None
    layer = min(r["layer"] for r in differing)
    return layer, min(r["first_position_differs"] for r in differing if r["layer"] == layer)


def _margin(margins, index: int) -> float | None:
    return float(margins[index]) if index < len(margins) else None


def measure_divergence_onset(baseline_path: str, out_path: str, s: OnsetSettings) -> pd.DataFrame:
    """Every divergent item of the pair in this shard's batches, at every precision of the baseline, rebuilt in its
    recorded batch (a precision with a divergent item loads its model on every shard: one provenance for all)."""
    baseline = read_parquet(baseline_path)
    check_fingerprint_scheme(baseline_path)  # rebuilt caches are checked against its rows by cache fingerprint
    pair = baseline_pair(baseline_path, s.constructions)
    rows, infos, plans = [], [], {}
    for precision in sorted(baseline["precision"].unique()):
        pairs = baseline_rows(baseline, precision, pair)
        pairs = pairs[[a != b for a, b in zip(pairs["suffix_a"], pairs["suffix_b"])]]
        if pairs.empty:
            continue
        job = load_as_recorded(s, precision, baseline_path)
        infos.append(job.loaded.info)
        settings = job.decode_settings()
        by_index = {int(p["item_index"]): p for p in pairs.to_dict("records")}
        plan, batches = batches_with(baseline_path, baseline, precision, set(by_index), s.shard, s.n_shards)
        plans[precision] = None if plan is None else plan.record()
        for batch in progress(batches, f"measure_divergence_onset {s.revision}/{precision} shard {s.shard}",
                              enabled=s.progress):
            wanted = {r for r, it in enumerate(batch.items) if int(it["item_index"]) in by_index}
            rebuild = Rebuild(job, batch, by_index, pair, settings, keep=wanted)
            for r in sorted(wanted):
                p = by_index[int(batch.items[r]["item_index"])]
                a, b = pair
                names = rebuild.names[r]
                layers = layer_differences(rebuild.own[a][r].layers, rebuild.own[b][r].layers)
                onset_layer, onset_position = onset(layers)
                fd = first_divergence(p["suffix_a"], p["suffix_b"])
                item = {"item_index": p["item_index"], "item_id": p["item_id"], "revision": s.revision,
                        "precision": precision, "construction_a": names[a], "construction_b": names[b],
                        "prompt_length": len(p["row_a"]["prompt_ids"]), "onset_layer": onset_layer,
                        "onset_position": onset_position, "first_divergence": fd,
                        "margin_a": _margin(p["row_a"]["margins"], fd), "margin_b": _margin(p["row_b"]["margins"], fd),
                        "live_fingerprint_match": rebuild.match[r]}
                rows += [{**item, **layer} for layer in layers]
        log.info("divergence onset %s/%s: %d divergent items (all shards)", s.revision, precision, len(by_index))
        del job
    df = pd.DataFrame(rows, columns=ONSET_SCHEMA.names).astype(
        {c: "object" for c in ("first_position_differs", "onset_layer", "onset_position", "margin_a", "margin_b",
                               "live_fingerprint_match")})
    df = df.sort_values(["precision", "item_index", "layer", "component"], kind="stable").reset_index(drop=True)
    prov = {**software_versions(), "models": infos, "stage": "measure_divergence_onset", "config": config_of(s),
            "batch_plans": plans, "items": "divergent: the pair's replica-1 suffix ids differ (never correctness)"}
    write_parquet(df, out_path, prov, ONSET_SCHEMA)
    return df
