"""The report's sections on what the reference study did not measure: the margins at the first divergence
(figure 3), the per-layer differences between the constructions' boundary caches (figure 4), and batch
invariance (batching as a construction factor)."""

from __future__ import annotations

import pandas as pd

from stagereplay.analysis import stats
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.report_format import (NOT_RECORDED, count_true, format_percent, format_proportion,
                                                join_words, table_head, table_row)
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.analysis.row_keys import check_unique


def margins_section(data: RevisionData) -> tuple[list[str], dict]:
    """Beyond the study: are first divergences near-ties? One paired value per item, tested across items."""
    skip = {(revision, "fixed_prefix", precision) for revision, precision in data.coinciding}
    margins = analysis.margin_pairs(data.ledger, data.pairs, skip=skip)
    if margins.empty:
        return ["_No disagreeing suffixes: no margin at a first divergence to report._", ""], {}
    lines = ["Per disagreeing item, the baseline construction's (live or incremental) top-2 logit margin at the "
             "first divergence against the median of its margins at the other decode steps of the same suffix (the "
             "divergence step left out). Items are the unit: one paired value each, tested across items with an "
             "exact one-sided sign test (figure 3).", "",
             *table_head("experiment", "precision", "items", "median margin at divergence",
                         "median of the items' other-step medians", "items below their own median",
                         "median within-item percentile", "sign test p (divergence < item median)")]
    out: dict = {}
    for (experiment, precision), g in margins.groupby(["experiment", "precision"], sort=True):
        test = stats.divergence_margin_test(list(zip(g["margin_divergence"], g["other_margins"])))
        out.setdefault(experiment, {})[precision] = test
        if not test["n"]:
            continue
        p = "—" if test["sign_test_p_less"] is None else f"{test['sign_test_p_less']:.3g}"
        lines.append(table_row(experiment, precision, test["n"], f"{test['median_divergence']:.3g}",
                               f"{test['median_of_item_medians']:.3g}",
                               f"{test['below_item_median']} / {test['n']} ({test['n_ties']} ties)",
                               f"{format_percent(test['median_within_item_percentile'])}%", p))
    dropped = sorted({p for _, p in data.coinciding})
    if dropped:
        lines += ["", f"Fixed-prefix {join_words(dropped)} is not tested again: its rows are the matched rows "
                  "(see the fixed-prefix 2x2)."]
    return lines + [""], out


def cache_differences_section(data: RevisionData) -> tuple[list[str], dict]:
    """Beyond the study: where in the cache the constructions differ (figure 4)."""
    profile = analysis.cache_difference_profile(data.frame("cache_differences"))
    if profile.empty:
        return ["_cache_differences.parquet holds no rows._", ""], {}
    lines = ["Incremental vs prefill boundary caches rebuilt from identical prefix ids for a seeded sample of "
             "items (figure 4).", "",
             *table_head("precision", "component", "items", "layers bit-identical in every item",
                         "first layer that differs", "items whose last layer differs", "largest max-abs difference",
                         "median RMS at the last layer, items that differ")]
    out: dict = {}
    for (precision, component), g in profile.groupby(["precision", "component"], sort=True):
        g = g.sort_values("layer")
        same = g[g["n_differ"] == 0]["layer"].tolist()
        differs = g[g["n_differ"] > 0]["layer"].tolist()
        last = g.iloc[-1]
        out.setdefault(precision, {})[component] = {
            "n": int(g["n"].max()), "layers_bit_identical": [int(x) for x in same],
            "first_layer_differs": int(differs[0]) if differs else None, "max_abs": float(g["max_abs_max"].max()),
            "items_differing_per_layer": [int(x) for x in g["n_differ"]],
            "rms_median_of_differing_per_layer": [None if pd.isna(x) else float(x) for x in g["rms_median"]],
            "method": "per-layer byte comparison, max-abs and RMS of the difference (fp64) over a seeded item sample"}
        rms = "—" if pd.isna(last["rms_median"]) else f"{last['rms_median']:.3g}"
        lines.append(table_row(precision, component.upper(), int(g["n"].max()), f"{len(same)} / {len(g)}",
                               differs[0] if differs else "—", f"{int(last['n_differ'])} / {int(last['n'])}",
                               f"{g['max_abs_max'].max():.3g}", rms))
    return lines + [""], out


def _filled(frame: pd.DataFrame, column: str) -> pd.Series:
    if column not in frame.columns:
        return pd.Series(False, index=frame.index)
    return frame[column].notna() & (frame[column].astype(str) != "")


def batch_invariance_section(data: RevisionData) -> tuple[list[str], dict]:
    """Batching as a construction factor (beyond the study): sampled items rerun alone against their batched rows.

    Only rows with something to compare are counted: cache comparisons need a boundary-cache fingerprint on both
    sides, suffix and label comparisons status ``ok`` on both; the rows that had not are counted apart."""
    table = data.frame("batch_invariance")
    check_unique(table, "batch_invariance")
    prov = data.job_record("batch_invariance")
    control = prov.get("batch_invariance") or {}
    if control.get("status") == "not_applicable" or table.empty:
        reason = control.get("reason", "the control compared no rows")
        return [f"_Nothing to compare: {reason}._", ""], {"status": control.get("status", "empty"), "reason": reason}
    plan = prov.get("batch_plan") or {}
    lines = [f"A seeded sample of {table['item_index'].nunique()} items, each rerun alone (batch 1, the same decode "
             f"regime and precision) against its row in the recorded batch plan (batch size "
             f"{plan.get('batch_size', NOT_RECORDED)}, plan seed {plan.get('seed', NOT_RECORDED)}). Batch "
             "composition is a construction factor: a difference is a finding, not an error. Only rows with "
             "something to compare are counted: boundary caches where both sides have one, ids and labels where "
             "both sides have status ok.", "",
             *table_head("precision", "construction", "rows", "boundary caches identical",
                         "rows with no cache on a side", "stage + suffix ids identical", "labels identical",
                         "rows not ok on a side", "first divergence (median [IQR])")]
    out: dict = {"status": "compared", "batch_size": plan.get("batch_size"), "plan_seed": plan.get("seed")}
    for precision in analysis.sort_precisions(table["precision"]):
        for construction in sorted(table.loc[table["precision"] == precision, "construction"].unique()):
            g = table[(table["precision"] == precision) & (table["construction"] == construction)]
            with_cache = g[_filled(g, "cache_fingerprint_batched") & _filled(g, "cache_fingerprint_alone")]
            if {"status_batched", "status_alone"} <= set(g.columns):
                both_ok = g[(g["status_batched"] == "ok") & (g["status_alone"] == "ok")]
            else:
                both_ok = g
            counts = {"cache_equal": stats.proportion(count_true(with_cache, "cache_equal"), len(with_cache)),
                      "suffix_equal": stats.proportion(count_true(both_ok, "suffix_equal"), len(both_ok)),
                      "label_equal": stats.proportion(count_true(both_ok, "label_equal"), len(both_ok))}
            fd = stats.first_divergence_summary([int(x) for x in both_ok["first_divergence"].dropna()])
            out.setdefault(precision, {})[construction] = {
                **counts, "first_divergence": fd, "n": len(g), "n_without_cache": len(g) - len(with_cache),
                "n_not_ok": len(g) - len(both_ok)}
            fd_text = f"{fd['median']:g} [{fd['q1']:g}, {fd['q3']:g}] (n={fd['n']})" if fd["n"] else "—"
            lines.append(table_row(precision, construction, len(g), format_proportion(counts["cache_equal"]),
                                   len(g) - len(with_cache), format_proportion(counts["suffix_equal"]),
                                   format_proportion(counts["label_equal"]), len(g) - len(both_ok), fd_text))
    return lines + [""], out
