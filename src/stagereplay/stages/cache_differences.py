"""Stage ``measure_cache_differences``: per-layer differences between two constructions' boundary caches over
identical prefix ids, for a seeded sample of items, at every precision; each cache rebuilt in its recorded batch."""

from __future__ import annotations

import logging

import pandas as pd
import pyarrow as pa

from stagereplay.decode.plans import BatchPlan, batches_of
from stagereplay.experiments.cache_differences import layer_differences, sample_items
from stagereplay.experiments.recipe import DecodeSettings, run
from stagereplay.experiments.transplant_specs import rebuilt_as
from stagereplay.io.keys import ITEM_FIELDS
from stagereplay.io.parquet import read_parquet, write_parquet
from stagereplay.io.provenance import recorded_batch_plan, software_versions
from stagereplay.stages.jobs import config_of, load_as_recorded
from stagereplay.stages.progress import progress
from stagereplay.stages.settings import CacheDifferenceSettings

log = logging.getLogger("stagereplay")

CACHE_DIFFERENCE_SCHEMA = pa.schema([
    *ITEM_FIELDS,
    ("construction_a", pa.string()),
    ("construction_b", pa.string()),
    ("layer", pa.int32()),
    ("component", pa.string()),  # k | v
    ("bit_equal", pa.bool_()),
    ("max_abs", pa.float64()),
    ("rms", pa.float64()),
    ("first_position_differs", pa.int32()),  # null when bit-identical
    ("n_positions", pa.int32()),
    ("prompt_length", pa.int32()),
])


def measure_cache_differences(prefixes_path: str, out_path: str, s: CacheDifferenceSettings) -> pd.DataFrame:
    """Prefix ids come from ``prefixes_path`` at ``prefix_precision`` (the first of ``precisions`` by default), so
    every precision sees the same token ids, as in the fixed-prefix 2x2."""
    prefix_precision = s.prefix_precision or s.precisions[0]
    prefixes = read_parquet(prefixes_path)
    available = sorted(prefixes["precision"].unique())
    if prefix_precision not in available:
        raise ValueError(f"cache_differences.prefix_precision {prefix_precision!r}: {prefixes_path} holds prefixes "
                         f"for {available} only; pick one of those or add it to precisions")
    mine = prefixes[prefixes["precision"] == prefix_precision]
    chosen = sample_items(mine, s.n_items, s.seed)
    wanted = {int(i) for i in chosen["item_index"]}
    plan = BatchPlan.from_record(recorded_batch_plan(prefixes_path))
    batches = [b for b in batches_of(mine.to_dict("records"), plan, s.shard, s.n_shards, source=prefixes_path)
               if any(int(it["item_index"]) in wanted for it in b.items)]
    a, b = s.constructions
    rows, infos = [], []
    # n_items 0: an empty table, no model loaded; else every shard loads it, so that their parts record one provenance
    for precision in s.precisions if wanted else []:
        job = load_as_recorded(s, precision, prefixes_path)
        infos.append(job.loaded.info)
        settings = DecodeSettings(None, 1, s.chunk_size)  # only the boundary caches: no suffix (below)
        for batch in progress(batches, f"measure_cache_differences {s.revision_slug}/{precision} shard {s.shard}",
                              enabled=s.progress,
                              items=lambda b: sum(int(it["item_index"]) in wanted for it in b.items)):
            prompts = [[int(i) for i in it["prompt_ids"]] for it in batch.items]
            stages = [[int(i) for i in it["stage_ids"]] or None for it in batch.items]
            keep = {r for r, it in enumerate(batch.items) if int(it["item_index"]) in wanted}
            caches = {c: run(job.decoder, rebuilt_as(c), prompts, settings, stages=stages, keep=keep,
                             max_new_tokens=0) for c in (a, b)}
            for r in sorted(keep):
                it = batch.items[r]
                for row in layer_differences(caches[a][r].layers, caches[b][r].layers):
                    rows.append({"item_index": int(it["item_index"]), "item_id": it["item_id"],
                                 "revision": s.revision_slug, "precision": precision, "construction_a": a,
                                 "construction_b": b, **row, "prompt_length": len(prompts[r])})
        log.info("cache differences %s/%s: %d items", s.revision_slug, precision, len(wanted))
        del job
    df = pd.DataFrame(rows, columns=CACHE_DIFFERENCE_SCHEMA.names)
    prov = {**software_versions(), "models": infos, "stage": "measure_cache_differences", "seed": s.seed,
            "config": config_of(s), "items": [str(i) for i in chosen["item_id"]],
            "batch_plan": None if plan is None else plan.record()}
    write_parquet(df, out_path, prov, CACHE_DIFFERENCE_SCHEMA)
    return df

