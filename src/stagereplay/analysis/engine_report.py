"""The report's section on a serving engine's replays (engines: [llama_cpp]): the engine's replicas, its split
counts per KV type and construction against its own token-by-token ``live``, and, on the same items and prefix ids,
this pipeline's fixed-prefix splits (``prefill`` and ``prefix_cached`` against ``incremental``), with Wilson
intervals; then per item whether the pipeline's ``prefill`` splits where the engine's does.

Reads the engine's ledger rows (results/<run>/<revision>/engine_llama_cpp.parquet, the ledger's columns) and the
revision's ledger; imports no engine code.
"""

from __future__ import annotations

import pandas as pd

from stagereplay.analysis import stats
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.report_format import table_head, table_row
from stagereplay.analysis.revision_data import RevisionData

ENGINE_KIND = "engine_llama_cpp"
AUDIT_KIND = "engine_llama_cpp_audit"
REFERENCE = "live"  # the engine's token-by-token schedule: its own generation's cache
PIPELINE_PAIRS = (("incremental", "prefill"), ("incremental", "prefix_cached"))
CROSSED = ("prefill", "prefill")  # (engine construction, pipeline construction) set side by side per item


def table(columns: list[str], rows: list[list]) -> list[str]:
    return table_head(*columns) + [table_row(*row) for row in rows]


def _interval(cell: dict) -> str:
    if not cell["n"]:
        return "0 / 0"
    return (f"{cell['k']} / {cell['n']} ({100 * cell['rate']:.1f}%, Wilson "
            f"[{100 * cell['wilson_low']:.1f}%, {100 * cell['wilson_high']:.1f}%])")


def _split_items(frame: pd.DataFrame, experiment: str, a: str, b: str, precision: str) -> dict[int, bool]:
    pairs = analysis.pair_table(frame, experiment, a, b)
    pairs = pairs[pairs["precision"] == precision]
    return {int(r.item_index): bool(r.disagree) for r in pairs.itertuples(index=False)}


def split_counts(engine: pd.DataFrame, ledger: pd.DataFrame | None) -> pd.DataFrame:
    """One row per (side, precision, construction pair): items whose suffix ids differ, of those compared, on the
    engine's items only, with Wilson intervals."""
    experiment = engine["experiment"].iloc[0]
    items = set(engine["item_index"].astype(int))
    rows = []
    for precision in analysis.sort_precisions(engine["precision"]):
        for other in sorted(set(engine["construction"]) - {REFERENCE}):
            split = _split_items(engine, experiment, REFERENCE, other, precision)
            rows.append({"side": "llama.cpp", "precision": precision, "construction_a": REFERENCE,
                         "construction_b": other, **stats.proportion(sum(split.values()), len(split))})
    fixed = None if ledger is None else ledger[ledger["experiment"] == "fixed_prefix"]
    if fixed is not None and not fixed.empty:
        fixed = fixed[fixed["item_index"].astype(int).isin(items)]
        for precision in analysis.sort_precisions(fixed["precision"]):
            for a, b in PIPELINE_PAIRS:
                if not {a, b} <= set(fixed["construction"]):
                    continue
                split = _split_items(fixed, "fixed_prefix", a, b, precision)
                rows.append({"side": "stagereplay", "precision": precision, "construction_a": a,
                             "construction_b": b, **stats.proportion(sum(split.values()), len(split))})
    return pd.DataFrame(rows)


def crossed(engine: pd.DataFrame, ledger: pd.DataFrame | None) -> pd.DataFrame:
    """Per (engine KV type, pipeline precision): items where the engine's live-vs-prefill splits, and of those how
    many the pipeline's incremental-vs-prefill splits too; both ways round."""
    if ledger is None:
        return pd.DataFrame()
    experiment = engine["experiment"].iloc[0]
    fixed = ledger[ledger["experiment"] == "fixed_prefix"]
    rows = []
    for kv in analysis.sort_precisions(engine["precision"]):
        theirs = _split_items(engine, experiment, REFERENCE, CROSSED[0], kv)
        for precision in analysis.sort_precisions(fixed["precision"]):
            ours = _split_items(fixed, "fixed_prefix", "incremental", CROSSED[1], precision)
            common = sorted(set(theirs) & set(ours))
            both = sum(theirs[i] and ours[i] for i in common)
            engine_splits = sum(theirs[i] for i in common)
            ours_splits = sum(ours[i] for i in common)
            rows.append({"engine_precision": kv, "precision": precision, "n": len(common),
                         "engine_splits": engine_splits, "pipeline_splits": ours_splits, "both": both,
                         "neither": sum(not theirs[i] and not ours[i] for i in common),
                         "pipeline_given_engine": stats.proportion(both, engine_splits)})
    return pd.DataFrame(rows)


def engine_section(data: RevisionData) -> tuple[list[str], dict]:
    engine = data.frame(ENGINE_KIND)
    if engine is None or engine.empty:
        return ["The engine replayed no item (no prefix reached the boundary at the reference precision).", ""], {
            "n_rows": 0}
    ledger = data.ledger if data.has("ledger") else None
    first = engine.iloc[0]
    lines = [f"llama.cpp through llama-cpp-python {first['binding_version']} (llama.cpp "
             f"`{first['llama_cpp_commit']}`, ggml {first['ggml_version']}), n_ctx {first['n_ctx']}, n_batch "
             f"{first['n_batch']}, n_ubatch {first['n_ubatch']}, {first['n_threads']} thread(s), "
             f"{first['n_gpu_layers']} layer(s) offloaded, flash attention {'on' if first['flash_attn'] else 'off'}, "
             f"chunk {first['chunk_size']}; built with `{first['system_info']}`. It replays the reference precision's "
             "prefix ids; its precision is the KV cache type (weights and activations are the GGUF's and "
             "llama.cpp's). `live` is its token-by-token schedule over the stage ids.", ""]
    replicas = analysis.replica_agreement(engine)
    lines += ["Replicas bit-identical (token ids, margins' float32 bytes checked when written; suffix and cache "
              "fingerprints here):", ""]
    lines += table(["precision", "construction", "identical / items"],
                   [[r.precision, f"`{r.construction}`", f"{r.identical} / {r.n}"]
                    for r in replicas.itertuples(index=False)])
    counts = split_counts(engine, ledger)
    lines += ["", "Items whose suffix differs from the reference construction's, on the same items and prefix ids:",
              ""]
    lines += table(["side", "precision", "pair", "split"],
                   [[r["side"], r["precision"], f"`{r['construction_a']}` vs `{r['construction_b']}`", _interval(r)]
                    for r in counts.to_dict("records")])
    cross = crossed(engine, ledger)
    if not cross.empty:
        lines += ["", "Where llama.cpp's `prefill` splits from its `live`, does this pipeline's `prefill` split from "
                  "`incremental` too (same items)?", ""]
        lines += table(["llama.cpp KV", "stagereplay precision", "items", "llama.cpp splits", "stagereplay splits",
                        "both", "neither", "stagereplay splits where llama.cpp does"],
                       [[r["engine_precision"], r["precision"], r["n"], r["engine_splits"], r["pipeline_splits"],
                         r["both"], r["neither"], _interval(r["pipeline_given_engine"])]
                        for r in cross.to_dict("records")])
    numbers = {"n_rows": len(engine), "replicas": replicas.to_dict("records"),
               "splits": counts.to_dict("records"), "crossed": cross.to_dict("records")}
    audit = data.frame(AUDIT_KIND) if data.has(AUDIT_KIND) else None
    if audit is not None:
        reproduced = int(audit["reproduced"].sum())
        lines += ["", f"Engine audit: {reproduced} / {len(audit)} rows recomputed from scratch reproduced every "
                  "column (rule audit_llama_cpp).", ""]
        numbers["audit"] = {"reproduced": reproduced, "rows": len(audit)}
    else:
        lines += [""]
    return lines, numbers
