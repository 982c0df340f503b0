"""The report's numbers against counts recomputed here from the ledger, and its handling of absent inputs."""

import json

import numpy as np
import pytest

from report_data import (synthetic_audit, synthetic_bridge, synthetic_cache_differences, synthetic_ledger,
                         synthetic_transplant, write)
from stagereplay.analysis import tables as analysis
from stagereplay.engine import first_divergence as engine_first_divergence
from stagereplay.analysis.report import build_report, compare_constructions


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    ledger = synthetic_ledger("primary")
    paths = {"ledger": write(ledger, d / "ledger.parquet"),
             "bridge": write(synthetic_bridge("primary", not_exact=(4,)), d / "bridge.parquet"),
             "audit": write(synthetic_audit(ledger, failing=(7, 9)), d / "audit.parquet"),
             "transplant": write(synthetic_transplant("primary"), d / "transplant.parquet"),
             "cache_differences": write(synthetic_cache_differences("primary"), d / "cache_differences.parquet")}
    inputs = {kind: {"primary": path} for kind, path in paths.items() if kind != "ledger"}
    build_report({"primary": paths["ledger"]}, str(d / "report.md"), str(d / "stats.json"), "t", seed=3,
                 inputs=inputs, figures={"fig1_disagreement": str(d / "figures/fig1_disagreement.png")})
    return ledger, (d / "report.md").read_text(), json.loads((d / "stats.json").read_text())


def recount(ledger, experiment, a, b, precision):
    """Disagreements, label flips and accuracies by plain loops over the ledger's replica-1 rows."""
    rows = ledger[(ledger["experiment"] == experiment) & (ledger["precision"] == precision)
                  & (ledger["replica"] == 1)]
    n = disagree = flips = right_a = right_b = 0
    for _, item in rows.groupby("item_index"):
        by = {r["construction"]: r for _, r in item.iterrows()}
        if a not in by or b not in by or by[a]["status"] != "ok" or by[b]["status"] != "ok":
            continue
        n += 1
        disagree += list(by[a]["suffix_ids"]) != list(by[b]["suffix_ids"])
        flips += bool(by[a]["correct"]) != bool(by[b]["correct"])
        right_a += bool(by[a]["correct"])
        right_b += bool(by[b]["correct"])
    return n, disagree, flips, right_a, right_b


@pytest.mark.parametrize("experiment, a, b, precision", [("matched", "live", "prefill", "bf16"),
                                                         ("fixed_prefix", "incremental", "prefill", "bf16"),
                                                         ("fixed_prefix", "incremental", "prefill", "fp32")])
def test_report_numbers_equal_those_recomputed_from_the_ledger(built, experiment, a, b, precision):
    ledger, report, stats_json = built
    n, disagree, flips, right_a, right_b = recount(ledger, experiment, a, b, precision)
    numbers = stats_json["revisions"]["primary"][experiment][precision]
    assert (numbers["suffix_disagreements"]["k"], numbers["suffix_disagreements"]["n"]) == (disagree, n)
    assert (numbers["label_flips"]["k"], numbers["label_flips"]["n"]) == (flips, n)
    assert numbers["accuracy_difference"]["accuracy_a"] == pytest.approx(right_a / n)
    assert numbers["accuracy_difference"]["difference"] == pytest.approx((right_a - right_b) / n)
    assert numbers["accuracy_difference"]["seed"] == 3
    assert f"{disagree} / {n} (" in report and f"{flips} / {n} (" in report
    if precision == "fp32":
        assert disagree == 0  # the synthetic ledger's shape, as in the study


def test_report_counts_bridge_audit_transplant_and_exclusions(built):
    ledger, report, stats_json = built
    numbers = stats_json["revisions"]["primary"]
    assert (numbers["bridge"]["bit_exact"]["k"], numbers["bridge"]["bit_exact"]["n"]) == (11, 12)
    assert numbers["bridge"]["not_bit_exact_items"] == ["item-4"]
    assert "| `item-4` | bf16 | 2 | k | 7 |" in report
    assert (numbers["audit"]["reproduced"]["k"], numbers["audit"]["reproduced"]["n"]) == (len(ledger) - 2, len(ledger))
    assert f"| {len(ledger) - 2} / {len(ledger)} |" in report
    follow = numbers["transplant"]["all_layers"]["bf16"]
    assert {d: (f["donor"], f["n"]) for d, f in follow.items()} == {"incremental->prefill": (6, 6),
                                                                    "prefill->incremental": (6, 6)}
    excluded = {(i["item_id"], i["experiment"]): i["reason"] for i in numbers["excluded"]["items"]}
    assert set(excluded) == {("item-3", "matched"), ("item-5", "matched")}
    assert excluded[("item-3", "matched")].startswith("boundary_missing")
    assert excluded[("item-5", "matched")].startswith("nonfinite (prefill)")
    assert "| `item-5` | matched | bf16 | nonfinite (prefill)" in report
    assert "166 / 200" in report and "12 / 12" in report and "24 / 24" in report and "1.88%" in report
    assert "![fig1_disagreement](figures/fig1_disagreement.png)" in report


def test_every_statistic_carries_n_method_and_seed(built):
    _, _, stats_json = built
    found = []

    def walk(node, seed=None):
        if isinstance(node, dict):
            if "method" in node:
                # A statistic nested in another (follows_donor in a follow rate) takes the enclosing one's seed.
                seed = node.get("seed", seed)
                found.append((node, seed))
            for value in node.values():
                walk(value, seed)
        elif isinstance(node, list):
            for value in node:
                walk(value, seed)

    walk(stats_json["revisions"])
    assert len(found) > 20
    for stat, seed in found:
        assert "n" in stat and stat["method"], stat
        assert seed == 3, stat


def test_absent_inputs_are_skipped_with_a_note(tmp_path):
    ledger = write(synthetic_ledger("primary", n_items=8), tmp_path / "ledger.parquet")
    inputs = {"bridge": {"primary": str(tmp_path / "missing_bridge.parquet")}}
    result = build_report({"primary": ledger}, str(tmp_path / "r.md"), str(tmp_path / "s.json"), "t",
                          inputs=inputs)
    report = (tmp_path / "r.md").read_text()
    for kind in ("bridge", "audit", "transplant", "cache_differences"):
        assert result["revisions"]["primary"][kind] == {"skipped": f"absent input: {kind}"}
        assert f"_Skipped: no {kind}.parquet" in report
    assert result["revisions"]["primary"]["matched"]["bf16"]["n_compared"] == 6


def test_pair_table_agrees_with_compare_constructions():
    ledger = synthetic_ledger("primary")
    mine = analysis.pair_table(ledger, "matched", "live", "prefill").set_index("item_index").sort_index()
    kept = compare_constructions(ledger, "matched", "live", "prefill").set_index("item_index").sort_index()
    assert list(mine.index) == list(kept.index)
    assert (mine["disagree"] == kept["disagree"]).all()
    assert mine["first_divergence"].astype(float).fillna(-1).tolist() == kept["first_divergence"].astype(float).fillna(-1).tolist()
    assert mine["margin_a"].astype(float).fillna(-1).tolist() == kept["margin_live"].astype(float).fillna(-1).tolist()
    assert (mine["label_differs"] == kept["label_differs"]).all()


def test_first_divergence_agrees_with_the_engine():
    rng = np.random.default_rng(0)
    for _ in range(300):
        a = rng.integers(0, 3, size=rng.integers(0, 6)).tolist()
        b = rng.integers(0, 3, size=rng.integers(0, 6)).tolist()
        assert analysis.first_divergence(a, b) == engine_first_divergence(a, b), (a, b)


def test_replica_agreement_counts_a_differing_replica():
    ledger = synthetic_ledger("primary", n_items=6)
    i = ledger.index[(ledger["construction"] == "prefill") & (ledger["experiment"] == "matched")
                     & (ledger["replica"] == 2)][0]
    ledger.loc[i, "suffix_fingerprint"] = "0" * 64
    rep = analysis.replica_agreement(ledger)
    row = rep[(rep["experiment"] == "matched") & (rep["construction"] == "prefill")].iloc[0]
    assert row["identical"] == row["n"] - 1


def test_figure_tables_carry_the_reports_numbers(built):
    ledger, _, stats_json = built
    pairs = analysis.all_pairs(ledger)
    cells = analysis.disagreement_cells(pairs)
    accuracy = analysis.accuracy_differences(pairs, seed=3)
    for experiment in ("matched", "fixed_prefix"):
        for precision, numbers in stats_json["revisions"]["primary"][experiment].items():
            cell = cells[(cells["experiment"] == experiment) & (cells["precision"] == precision)].iloc[0]
            assert (cell["k"], cell["n"]) == (numbers["suffix_disagreements"]["k"], numbers["suffix_disagreements"]["n"])
            acc = accuracy[(accuracy["experiment"] == experiment) & (accuracy["precision"] == precision)].iloc[0]
            for key in ("difference", "bootstrap_low", "bootstrap_high", "mcnemar_p"):
                assert acc[key] == numbers["accuracy_difference"][key], (experiment, precision, key)
