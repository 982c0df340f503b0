"""The Findings say what was shown: an interval on 0 is never "holds", pooled counts say so, a split count names
its token budget, byte-identical constructions are named once, and the "Beyond the study" table sets each of
this run's numbers beside its control (the placebo named as not run where the transplant file has none)."""

from __future__ import annotations

import pandas as pd

from report_data import synthetic_ledger, synthetic_transplant
from stagereplay.analysis import separation, stats, tables
from stagereplay.analysis.claims import fixed_prefix_section
from stagereplay.analysis.findings import beyond_study_section, findings_section, revision_rows
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.analysis.transplant_report import transplant_section


def _accuracy(a_only: int, b_only: int, n: int) -> dict:
    right = [True] * (n - a_only - b_only)
    a = right + [True] * a_only + [False] * b_only
    b = right + [False] * a_only + [True] * b_only
    return stats.paired_accuracy_difference(a, b, n_boot=200)


def _accuracy_row(acc: dict, margin: float = 0.05) -> tuple:
    numbers = {"matched": {"bf16": {"suffix_disagreements": stats.proportion(3, acc["n"]),
                                    "label_flips": stats.proportion(0, acc["n"]), "accuracy_difference": acc,
                                    "max_new_tokens": 128}}}
    rows = revision_rows("primary", numbers, named=False, margin=margin)
    return next(r for r in rows if r[0].startswith("bf16: accuracy"))


def test_an_interval_on_zero_never_reads_holds():
    """0 vs 0 discordant pairs of 64: the bootstrap's interval is [+0.0, +0.0]; that shows nothing."""
    acc = _accuracy(0, 0, 64)
    assert acc["bootstrap_low"] == acc["bootstrap_high"] == 0.0
    _, _, figure, verdict = _accuracy_row(acc)
    assert verdict.startswith("not shown") and "equivalence within ±5 points not shown" in verdict
    assert "exact 95% interval [-6.6, +6.6]" in figure and "0 vs 0 discordant pairs" in figure
    assert "exact McNemar p = 1" in figure


def test_equivalence_and_a_difference_are_said_as_such():
    assert _accuracy_row(_accuracy(0, 0, 400))[3].startswith("yes (equivalent within ±5 points: TOST")
    assert _accuracy_row(_accuracy(0, 0, 400), margin=0.005)[3].startswith("not shown")  # the margin is the config's
    assert _accuracy_row(_accuracy(30, 2, 200))[3].startswith("**no** (a difference shown")


def test_the_split_row_names_its_token_budget():
    rows = revision_rows("primary", {"matched": {"bf16": {
        "suffix_disagreements": stats.proportion(3, 10), "label_flips": stats.proportion(0, 10),
        "max_new_tokens": 128}}}, named=False)
    assert rows[0][0] == "bf16 live vs prefill of identical tokens: suffixes differ, max_new_tokens 128"


def test_pooled_transplant_counts_say_they_are_pooled():
    follow = {"live->prefill": stats.follow_rate(["donor"] * 12), "prefill->live": stats.follow_rate(["donor"] * 12)}
    lines, record = findings_section({"primary": {"transplant": {"all_layers": {"bf16": follow}}}})
    assert record[0]["this_run"] == "24 / 24, pooled over 2 directions: 12 / 12 + 12 / 12"
    assert record[0]["holds"] == "yes"


def _with_chunked(ledger: pd.DataFrame, same_as: str) -> pd.DataFrame:
    """The ledger's fixed-prefix rows plus a ``chunked`` construction whose caches are ``same_as``'s bytes."""
    twin = ledger[(ledger["experiment"] == "fixed_prefix") & (ledger["construction"] == same_as)]
    return pd.concat([ledger, twin.assign(construction="chunked")], ignore_index=True)


def test_byte_identical_constructions_are_named_once():
    ledger = _with_chunked(synthetic_ledger("primary"), "prefill")
    found = tables.identical_caches(ledger)
    assert found[("primary", "bf16")][0]["constructions"] == ["prefill", "chunked"]
    data = RevisionData("primary", {}, 0)
    data._frames["ledger"] = ledger
    lines, numbers = fixed_prefix_section(data)
    text = "\n".join(lines).split("Each replay construction")[1].split("Replicas of each cell")[0]
    assert "| bf16 | prefill = chunked |" in text and "| bf16 | chunked |" not in text
    n = found[("primary", "bf16")][0]["n"]
    assert f"bf16: `prefill` = `chunked`, byte-identical on all {n} items" in text
    _, beyond = beyond_study_section({"primary": {"fixed_prefix": numbers}})
    rows = [r for r in beyond if r["finding"].startswith("`prefill` = `chunked`")]
    assert [r["this_run"] for r in rows] == [f"byte-identical boundary caches on all {n} items"] * len(rows)
    other = synthetic_ledger("primary")
    assert tables.identical_caches(other) == {}  # incremental and prefill differ on some item


def test_the_localisation_row_says_the_placebo_was_not_run_without_it():
    frame = synthetic_transplant().drop(columns=["placebo_outcome", "noop"])
    data = RevisionData("primary", {}, 0)
    data._frames["transplant"] = frame
    _, numbers = transplant_section(data)
    _, beyond = beyond_study_section({"primary": {"transplant": numbers}}, {"primary": data})
    row = next(r for r in beyond if r["finding"].startswith("parts of the cache that carry"))
    assert row["control"].startswith("placebo not run") and row["this_run"].endswith("donor arm only")


def test_the_localisation_row_counts_rows_beyond_their_placebo_against_chance():
    frame = synthetic_transplant()
    carried = (frame["layer_set"] == "0-1") & (frame["direction"] == "incremental->prefill")
    frame.loc[carried, "outcome"] = "donor"  # six of six items follow the donor, no placebo does: p 2/64
    frame.loc[carried, "placebo_outcome"] = "recipient"
    data = RevisionData("primary", {}, 0)
    data._frames["transplant"] = frame
    _, numbers = transplant_section(data)
    _, beyond = beyond_study_section({"primary": {"transplant": numbers}}, {"primary": data})
    row = next(r for r in beyond if r["finding"].startswith("parts of the cache that carry"))
    tested = len(numbers["sweep"])
    assert row["this_run"].startswith(f"1 of {tested} row(s)")
    assert f"{0.05 * tested:.1f} row(s) expected by chance" in row["control"]


def test_the_beyond_table_leads_with_the_engine_and_sets_each_number_beside_its_control():
    engine = {"splits": [{"side": "llama.cpp", "precision": "f16", "construction_a": "live",
                          "construction_b": "prefill", **stats.proportion(9, 64)},
                         {"side": "stagereplay", "precision": "f16", "construction_a": "incremental",
                          "construction_b": "prefill", **stats.proportion(4, 64)}],
              "replicas": [{"precision": "f16", "construction": "live", "n": 64, "identical": 64}]}
    association = {"cases": 4, "controls": 35, "split_at_boundary_step": 1,
                   "margin_boundary": separation.auc_delong([0.1, 0.2, 0.3, 2.0], [1.0, 2.0, 3.0] * 11 + [0.05, 0.4]),
                   "suffix_length": separation.auc_delong([10, 12, 30, 40], [20, 30] * 17 + [25])}
    fidelity = {"bf16": {
        "live_vs_prefill": {"bit_identical": False, "kl_forward_median": 1e-3, "items_split": stats.proportion(5, 40),
                            "same_readouts_as": ["chunked"], "split_predictors": association},
        "live_vs_chunked": {"bit_identical": False, "kl_forward_median": 1e-3, "items_split": stats.proportion(5, 40),
                            "same_readouts_as": ["prefill"], "split_predictors": association},
        "live_vs_prefix_cached": {"bit_identical": True, "kl_forward_median": 0.0,
                                  "items_split": stats.proportion(0, 40), "same_readouts_as": []}}}
    lines, rows = beyond_study_section({"primary": {"engine_llama_cpp": engine, "fidelity": fidelity}})
    assert lines[0] == "## Beyond the study" and rows[0]["finding"].startswith("llama.cpp live vs prefill (f16 KV)")
    assert rows[0]["this_run"].startswith("9 / 64") and "engine replicas bit-identical: 64 / 64" in rows[0]["control"]
    assert "incremental vs prefill: 4 / 64" in rows[0]["control"]
    fid = next(r for r in rows if r["finding"].startswith("fidelity to live along the suffix, bf16"))
    assert fid["this_run"].count("prefill") == 1 and "`prefill` = `chunked`" in fid["this_run"]
    assert fid["control"].startswith("`prefix_cached` byte-equal with live")
    associated = [r for r in rows if r["finding"].startswith("split associated")]
    assert [r["finding"] for r in associated] == [
        "split associated with a small live margin before it, bf16 live vs prefill = chunked"]  # named once
    assoc = associated[0]
    assert assoc["this_run"].startswith("AUC 0.") and "at the boundary" in assoc["this_run"] and "1 split at step 0 left out" in assoc["this_run"]
    assert assoc["control"].startswith("suffix length, scored the same way: AUC")
    assert "not a prediction" in assoc["reading"]


def test_pooled_replica_counts_say_they_are_pooled():
    replicas = {"live": {"n": 10, "identical": 10}, "prefill": {"n": 10, "identical": 10}}
    cell = {"replicas": replicas, "suffix_disagreements": stats.proportion(1, 10),
            "label_flips": stats.proportion(0, 10)}
    rows = revision_rows("primary", {"matched": {"bf16": cell}}, named=False)
    assert rows[0][2] == "20 / 20 replica pairs, pooled over 2 cells (experiment x precision x construction)"
