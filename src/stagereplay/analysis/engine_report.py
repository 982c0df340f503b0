"""The report's section on a serving engine's replays (``engines: [<name>]``), one per engine of the catalogue
(:data:`stagereplay.catalogue.ENGINES`); llama.cpp's below stands for any.

Two families of rows, told apart by their ``stage_source`` column:

- ``engine``: llama.cpp's own stage. ``live`` is llama.cpp's greedy generation of the stage and the state it
  retained; ``incremental``, ``prefill``, ``prompt_cache`` and ``chunked`` rebuild that state from llama.cpp's own
  ids. Their splits against ``live`` answer a llama.cpp user's question: cut llama.cpp's trajectory at the stage,
  prefill it again in llama.cpp, is the continuation llama.cpp's? ``live`` against ``incremental`` (the same
  forwards over the same ids) checks the schedule: their caches should be byte-identical.
- ``reference``: this pipeline's stage ids (the reference precision's). ``incremental`` is the reference there, not
  ``live``: no engine generated these ids. Their splits are set beside this pipeline's own ``prefill`` and
  ``prefix_cached`` against ``incremental`` on the same items and ids, and per item in a cross-table whose base
  rates (both marginals, the count expected under independence, the odds ratio with Fisher's exact test) say whether
  the two split on the same items more often than chance would.

Also counted: the items on which llama.cpp's own stage differs from the pipeline's (or one of them missed the
boundary). Reads the engine's ledger rows (results/<run>/<revision>/engine_<name>.parquet) and the revision's
ledger; imports no engine code: what it says of an engine (its label, its header) is the catalogue's.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from stagereplay.analysis import stats
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.cross_table import cross_table, odds_ratio_text
from stagereplay.analysis.report_format import table_head, table_row
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.catalogue import Engine

# (stage_source, its reference construction, words for a table after the engine's label)
FAMILIES = (("engine", "live", "its own stage"), ("reference", "incremental", "reference ids"))
PIPELINE_PAIRS = (("incremental", "prefill"), ("incremental", "prefix_cached"))
CROSSED = ("incremental", "prefill")  # the pair set side by side per item, on both sides, over the same ids
STAGE_COLUMNS = (("same", "same stage ids"), ("differs", "stage ids differ"),
                 ("engine_missing", "{engine} missed the boundary"),
                 ("reference_missing", "pipeline missed the boundary"), ("both_missing", "both missed"))


def table(columns: list[str], rows: list[list]) -> list[str]:
    return table_head(*columns) + [table_row(*row) for row in rows]


def _interval(cell: dict) -> str:
    if not cell["n"]:
        return "0 / 0"
    return (f"{cell['k']} / {cell['n']} ({100 * cell['rate']:.1f}%, Wilson "
            f"[{100 * cell['wilson_low']:.1f}%, {100 * cell['wilson_high']:.1f}%])")


def family(engine: pd.DataFrame, source: str) -> pd.DataFrame:
    """The rows over ``source``'s stage ids."""
    return engine[engine["stage_source"] == source]


def _split_items(frame: pd.DataFrame, a: str, b: str, precision: str) -> dict[int, bool]:
    if frame.empty:
        return {}
    pairs = analysis.pair_table(frame, frame["experiment"].iloc[0], a, b)
    pairs = pairs[pairs["precision"] == precision]
    return {int(r.item_index): bool(r.disagree) for r in pairs.itertuples(index=False)}


def _fixed_prefix(ledger: pd.DataFrame | None, items: set[int]) -> pd.DataFrame:
    if ledger is None:
        return pd.DataFrame(columns=["experiment", "construction", "precision", "item_index"])
    fixed = ledger[ledger["experiment"] == "fixed_prefix"]
    return fixed[fixed["item_index"].astype(int).isin(items)]


def split_counts(engine: pd.DataFrame, ledger: pd.DataFrame | None, label: str) -> pd.DataFrame:
    """One row per (side, precision, construction pair): items whose suffix ids differ, of those compared, with
    Wilson intervals. The engine's families (side ``label``) against their own reference (``live``,
    ``incremental``); this pipeline's fixed-prefix pairs on the items of the engine's reference-ids rows."""
    rows = []
    for source, reference, words in FAMILIES:
        side = f"{label}, {words}"
        rows_of = family(engine, source)
        for precision in analysis.sort_precisions(rows_of["precision"]):
            for other in sorted(set(rows_of["construction"]) - {reference}):
                split = _split_items(rows_of, reference, other, precision)
                rows.append({"side": side, "precision": precision, "construction_a": reference,
                             "construction_b": other, **stats.proportion(sum(split.values()), len(split))})
    fixed = _fixed_prefix(ledger, set(family(engine, "reference")["item_index"].astype(int)))
    for precision in analysis.sort_precisions(fixed["precision"]):
        for a, b in PIPELINE_PAIRS:
            if {a, b} <= set(fixed["construction"]):
                split = _split_items(fixed, a, b, precision)
                rows.append({"side": "stagereplay", "precision": precision, "construction_a": a,
                             "construction_b": b, **stats.proportion(sum(split.values()), len(split))})
    return pd.DataFrame(rows)


def stage_agreement(engine: pd.DataFrame) -> pd.DataFrame:
    """Per KV type: items by how llama.cpp's own stage compares with the pipeline's (``stage_comparison`` of the
    own stage's ``live`` replica 1)."""
    live = family(engine, "engine")
    live = live[(live["construction"] == "live") & (live["replica"] == 1)]
    rows = []
    for precision in analysis.sort_precisions(live["precision"]):
        counts = live[live["precision"] == precision]["stage_comparison"].value_counts()
        rows.append({"precision": precision, "items": int(counts.sum()),
                     **{key: int(counts.get(key, 0)) for key, _ in STAGE_COLUMNS}})
    return pd.DataFrame(rows)


def schedule_check(engine: pd.DataFrame) -> pd.DataFrame:
    """Per KV type, on llama.cpp's own stage: items whose ``live`` and ``incremental`` boundary caches are
    byte-identical (the same forwards over the same ids), of those with both."""
    own = family(engine, "engine")
    own = own[(own["replica"] == 1) & (own["status"] == "ok")]
    rows = []
    for precision in analysis.sort_precisions(own["precision"]):
        at = own[own["precision"] == precision]
        fp = at.pivot_table(index="item_index", columns="construction", values="cache_fingerprint", aggfunc="first")
        if not {"live", "incremental"} <= set(fp.columns):
            continue
        fp = fp.dropna(subset=["live", "incremental"])
        rows.append({"precision": precision, "n": len(fp), "identical": int((fp["live"] == fp["incremental"]).sum())})
    return pd.DataFrame(rows, columns=["precision", "n", "identical"])


def crossed(engine: pd.DataFrame, ledger: pd.DataFrame | None) -> pd.DataFrame:
    """Per (engine KV type, pipeline precision), on the same items and reference ids: where llama.cpp's
    ``prefill`` splits from its ``incremental`` (A) and where this pipeline's does (B), as a cross-table with both
    marginals, the count expected under independence, the odds ratio and Fisher's exact test."""
    theirs_rows = family(engine, "reference")
    fixed = _fixed_prefix(ledger, set(theirs_rows["item_index"].astype(int)))
    if theirs_rows.empty or fixed.empty or not set(CROSSED) <= set(fixed["construction"]):
        return pd.DataFrame()
    rows = []
    for kv in analysis.sort_precisions(theirs_rows["precision"]):
        theirs = _split_items(theirs_rows, *CROSSED, kv)
        for precision in analysis.sort_precisions(fixed["precision"]):
            cell = cross_table(theirs, _split_items(fixed, *CROSSED, precision))
            rows.append({"engine_precision": kv, "precision": precision, **cell})
    return pd.DataFrame(rows)


def _header(first, entry: Engine) -> list[str]:
    """The engine's own words over its first row's provenance (booleans read on / off), then what its families
    mean."""
    values = {key: ("on" if value else "off") if isinstance(value, (bool, np.bool_)) else value
              for key, value in first.items()}
    label = entry.words
    own = entry.report_header.format(**values) + " " if entry.report_header else ""
    return [own + f"Over its own stage, `live` is {label}'s own greedy generation and the state it retained, and "
            f"the other constructions rebuild that state from {label}'s ids; over this pipeline's stage ids (the "
            "reference precision's), `incremental` is the reference.", ""]


def _stage_lines(engine: pd.DataFrame, label: str, word: str) -> tuple[list[str], pd.DataFrame]:
    agreement = stage_agreement(engine)
    if agreement.empty:
        return [], agreement
    lines = ["", f"{label}'s own stage against this pipeline's (the reference precision's generation, the same "
             "prompts, boundary rule and budget), per item:", ""]
    words = [w.format(engine=label) for _, w in STAGE_COLUMNS]
    lines += table([f"{label} {word}", "items", *words],
                   [[r["precision"], r["items"], *[r[key] for key, _ in STAGE_COLUMNS]]
                    for r in agreement.to_dict("records")])
    schedule = schedule_check(engine)
    if not schedule.empty:
        lines += ["", f"On {label}'s own stage, `live` and `incremental` boundary caches byte-identical: " + ", ".join(
            f"{r.precision} {r.identical} / {r.n}" for r in schedule.itertuples(index=False)) + "."]
    return lines, agreement


def _cross_lines(cross: pd.DataFrame, label: str, word: str) -> list[str]:
    if cross.empty:
        return []
    lines = ["", f"Where {label}'s `prefill` splits from its `incremental` (A), does this pipeline's `prefill` split "
             "from `incremental` (B), on the same items and stage ids? Both marginals, the items on which both "
             "would split were A and B independent, and Fisher's exact test:", ""]
    return lines + table(
        [f"{label} {word}", "stagereplay precision", "items", "A splits", "B splits", "both", "both if independent",
         "neither", "odds ratio", "Fisher p"],
        [[r["engine_precision"], r["precision"], r["n"], r["a_splits"], r["b_splits"], r["both"],
          "-" if r["expected_both"] is None else f"{r['expected_both']:.2f}", r["neither"], odds_ratio_text(r),
          "-" if r["fisher_p"] is None else f"{r['fisher_p']:.3g}"] for r in cross.to_dict("records")])


def engine_section(data: RevisionData, entry: Engine) -> tuple[list[str], dict]:
    """The section of the catalogue's engine ``entry``: its rows (``engine_<name>``) and audit."""
    label = entry.words
    engine = data.frame(f"engine_{entry.name}")
    if engine is None or engine.empty:
        return ["The engine replayed no item (no prompt at the reference precision).", ""], {"n_rows": 0}
    ledger = data.ledger if data.has("ledger") else None
    lines = _header(engine.iloc[0], entry)
    stage_lines, agreement = _stage_lines(engine, label, entry.precision_word)
    lines += stage_lines
    replicas = analysis.replica_agreement(engine)
    sources = dict(zip(engine["experiment"], engine["stage_source"]))
    lines += ["", "Replicas bit-identical (stage and suffix ids, margins' float32 bytes checked when written; stage "
              "ids, suffix and cache fingerprints here):", ""]
    lines += table(["stage ids", "precision", "construction", "identical / items"],
                   [[sources[r.experiment], r.precision, f"`{r.construction}`", f"{r.identical} / {r.n}"]
                    for r in replicas.itertuples(index=False)])
    counts = split_counts(engine, ledger, label)
    lines += ["", f"Items whose suffix differs from the reference construction's ({label}'s own stage: `live`; the "
              "reference ids: `incremental`):", ""]
    lines += table(["side", "precision", "pair", "split"],
                   [[r["side"], r["precision"], f"`{r['construction_a']}` vs `{r['construction_b']}`", _interval(r)]
                    for r in counts.to_dict("records")])
    cross = crossed(engine, ledger)
    lines += _cross_lines(cross, label, entry.precision_word)
    numbers = {"n_rows": len(engine), "stage_agreement": agreement.to_dict("records"),
               "schedule_check": schedule_check(engine).to_dict("records"), "replicas": replicas.to_dict("records"),
               "splits": counts.to_dict("records"), "crossed": cross.to_dict("records")}
    audit_kind = f"engine_{entry.name}_audit"
    audit = data.frame(audit_kind) if data.has(audit_kind) else None
    if audit is not None:
        reproduced = int(audit["reproduced"].sum())
        lines += ["", f"Engine audit: {reproduced} / {len(audit)} rows recomputed from scratch reproduced every "
                  "column (rule audit_engine).", ""]
        numbers["audit"] = {"reproduced": reproduced, "rows": len(audit)}
    else:
        lines += [""]
    return lines, numbers
