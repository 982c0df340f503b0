"""The report's numbers against counts recomputed here from the ledger, and its handling of absent inputs."""

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from report_data import (synthetic_audit, synthetic_bridge, synthetic_cache_differences, synthetic_ledger,
                         synthetic_transplant, write)
from stagereplay.analysis import stats
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.report import build_report
from stagereplay.analysis.row_keys import DuplicateRowsError
from stagereplay.io.keys import LEDGER_KEY


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


def test_every_statistic_carries_n_and_method_and_a_seed_only_where_it_resamples(built):
    _, _, stats_json = built
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "method" in node:
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(stats_json["revisions"])
    assert len(found) > 20
    resampled = [stat for stat in found if "bootstrap" in stat["method"]]
    assert resampled and len(resampled) < len(found)
    for stat in found:
        assert "n" in stat and stat["method"], stat
        # the report's seed (3 here) goes with the bootstrap results alone: a count or an exact test uses none
        assert stat.get("seed") == (3 if stat in resampled else None), stat


def test_absent_inputs_are_skipped_with_a_note(tmp_path):
    """A declared input not on disk yet: its section says it is skipped; an input never declared for the revision:
    one line names what the run does not produce, and no section pretends it is coming."""
    ledger = write(synthetic_ledger("primary", n_items=8), tmp_path / "ledger.parquet")
    inputs = {"bridge": {"primary": str(tmp_path / "missing_bridge.parquet")}}
    result = build_report({"primary": ledger}, str(tmp_path / "r.md"), str(tmp_path / "s.json"), "t",
                          inputs=inputs)
    report = (tmp_path / "r.md").read_text()
    assert result["revisions"]["primary"]["bridge"] == {"skipped": "absent input: bridge"}
    assert "_Skipped: no bridge.parquet" in report
    for kind in ("audit", "transplant", "cache_differences"):
        assert kind not in result["revisions"]["primary"]
        assert f"_Skipped: no {kind}.parquet" not in report
    assert "Not produced for this revision" in report and "transplant" in result["revisions"]["primary"][
        "not_produced"]
    assert result["revisions"]["primary"]["matched"]["bf16"]["n_compared"] == 6


def plain_first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_first_divergence_agrees_with_a_plain_loop():
    rng = np.random.default_rng(0)
    for _ in range(300):
        a = rng.integers(0, 3, size=rng.integers(0, 6)).tolist()
        b = rng.integers(0, 3, size=rng.integers(0, 6)).tolist()
        assert analysis.first_divergence(a, b) == plain_first_divergence(a, b), (a, b)


def test_the_analysis_layer_imports_no_engine_code():
    """report, figures and tables import only stagereplay.io, the version and the catalogue (pure data; and so no
    torch), never the engine layers."""
    allowed = "('stagereplay.analysis', 'stagereplay.io', 'stagereplay.version', 'stagereplay.catalogue')"
    code = ("import sys, stagereplay.analysis.report, stagereplay.analysis.figures; "
            "bad = sorted(m for m in sys.modules if m.startswith('stagereplay.') and not "
            f"m.startswith({allowed}) or m == 'torch'); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


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


# --- every pairing refuses duplicate keys -------------------------------------------------------------------------

def _duplicated(ledger: pd.DataFrame) -> pd.DataFrame:
    row = ledger[(ledger["experiment"] == "matched") & (ledger["construction"] == "prefill")
                 & (ledger["replica"] == 1)].iloc[[0]]
    return pd.concat([ledger, row.assign(suffix_ids=[[99, 99]])], ignore_index=True)


@pytest.mark.parametrize("pairing", [
    lambda l: analysis.pair_table(l, "matched", "live", "prefill"),
    analysis.all_pairs,
    analysis.replica_agreement,
    analysis.exclusions,
    analysis.coinciding_comparisons,
    lambda l: analysis.margin_pairs(l, analysis.all_pairs(l.drop_duplicates(list(LEDGER_KEY)))),
])
def test_every_ledger_pairing_refuses_a_duplicate_key(pairing):
    ledger = _duplicated(synthetic_ledger("primary", n_items=6))
    with pytest.raises(DuplicateRowsError, match=r"ledger: 1 key\(s\).*\(0, primary, matched, bf16, "
                                                          r"prefill, 1\) x2"):
        pairing(ledger)


def test_transplant_and_cache_difference_tables_refuse_duplicate_keys():
    transplant = synthetic_transplant()
    with pytest.raises(DuplicateRowsError, match="transplant"):
        analysis.transplant_matrix(pd.concat([transplant, transplant.iloc[[0]]]))
    differences = synthetic_cache_differences()
    with pytest.raises(DuplicateRowsError, match="cache_differences"):
        analysis.cache_difference_profile(pd.concat([differences, differences.iloc[[3]]]))


def test_report_refuses_duplicate_audit_rows(tmp_path):
    ledger = synthetic_ledger("primary", n_items=4)
    audit = synthetic_audit(ledger)
    paths = {"audit": {"primary": write(pd.concat([audit, audit.iloc[[2]]]), tmp_path / "audit.parquet")}}
    with pytest.raises(DuplicateRowsError, match="audit"):
        build_report({"primary": write(ledger, tmp_path / "ledger.parquet")}, str(tmp_path / "r.md"),
                     str(tmp_path / "s.json"), "t", inputs=paths)


def test_findings_lead_the_report_and_say_where_the_study_holds(built):
    ledger, report, stats_json = built
    assert report.index("## Findings") < report.index("## What produced this run") < report.index("## Revision")
    findings = {f["claim"]: f for f in stats_json["findings"]}
    numbers = stats_json["revisions"]["primary"]
    # the synthetic run: one bridge row and two audited rows fail, every replica pair is exact
    assert findings["bridge: incremental cache bit-exact with the live cache"]["holds"] == "no"
    assert findings["bridge: incremental cache bit-exact with the live cache"]["this_run"] == "11 / 12"
    assert findings["saved-ledger audit: every row reproduced"]["holds"] == "no"
    assert findings["replicas on both sides bit-exact"]["holds"] == "yes"
    n, disagree, *_ = recount(ledger, "matched", "live", "prefill", "bf16")
    matched = findings["bf16 live vs prefill of identical tokens: suffixes differ"]
    assert matched["this_run"].startswith(f"{disagree} / {n} (") and matched["reference_study"] == "166 / 200"
    assert matched["holds"] == ("yes" if disagree else "no")
    fp32 = findings["fixed-prefix fp32, incremental vs prefill: suffixes differ"]
    assert fp32["this_run"].startswith("0 / ") and fp32["holds"] == "yes"
    acc = numbers["matched"]["bf16"]["accuracy_difference"]
    # what was shown, from the exact interval and the equivalence test, never "yes" from an interval on 0
    shown = stats.accuracy_equivalence(acc["discordant_a_only"], acc["discordant_b_only"], acc["n"], 0.05)
    assert findings["bf16: accuracy difference live − prefill, points"]["holds"] == {
        "difference": "no", "equivalent": "yes", "undecided": "not shown"}[shown["verdict"]]
    assert findings["all-layer transplant: divergent continuations follow their cache donor"]["holds"] == "yes"
    assert "| bridge: incremental cache bit-exact with the live cache | 12 / 12 | 11 / 12 | **no** |" in report


def test_a_split_in_fp32_is_a_finding_against_the_study(tmp_path):
    ledger = synthetic_ledger("primary")
    fp32 = (ledger["experiment"] == "fixed_prefix") & (ledger["precision"] == "fp32") & (
        ledger["construction"] == "prefill") & (ledger["item_index"] == 0)
    ledger.loc[fp32, "suffix_ids"] = ledger.loc[fp32, "suffix_ids"].map(lambda ids: [99, *list(ids)[1:]])
    path = write(ledger, tmp_path / "ledger.parquet")
    build_report({"primary": path}, str(tmp_path / "report.md"), str(tmp_path / "stats.json"), "t")
    findings = {f["claim"]: f for f in json.loads((tmp_path / "stats.json").read_text())["findings"]}
    row = findings["fixed-prefix fp32, incremental vs prefill: suffixes differ"]
    assert row["this_run"].startswith("1 / ") and row["holds"] == "no"


def build_section(ledger, tmp_path_factory=None) -> str:
    """The fixed-prefix section of a report built from ``ledger`` alone."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    path = write(ledger, folder / "ledger.parquet")
    build_report({"primary": path}, str(folder / "report.md"), str(folder / "stats.json"), "t")
    return (folder / "report.md").read_text().split("### Fixed-prefix 2x2")[1].split("\n### ")[0]


def test_fp32_accuracy_in_the_two_tables_is_explained_and_no_column_repeats_the_interval(built):
    _, report, _ = built
    section = report.split("### Fixed-prefix 2x2")[1].split("\n### ")[0]
    assert "Wilson 95% upper bound |" not in section  # the interval beside each count already ends there
    # the synthetic ledger: every row of an item has one prefix, so the two tables count the same prefixes
    assert "Other prefixes than the matched rows'" not in section
    ledger = synthetic_ledger("primary")
    own = ledger[ledger["experiment"] == "matched"].assign(precision="fp32")  # fp32 generating its own prefixes
    own["prefix_fingerprint"] = own["prefix_fingerprint"].where(own["item_index"] % 4 != 0, "other")
    text = build_section(pd.concat([ledger, own], ignore_index=True))
    n = len(set(own["item_index"]) & set(ledger.loc[ledger["experiment"] == "fixed_prefix", "item_index"]))
    k = len({i for i in own["item_index"] if i % 4 == 0} & set(ledger.loc[ledger["experiment"] == "fixed_prefix",
                                                                          "item_index"]))
    assert f"at fp32, {k} of {n} items' fixed-prefix rows continue other prefix ids than its matched rows" in text
    assert "at bf16" not in text


def test_a_transplant_with_no_divergent_item_is_not_measured_in_the_findings():
    from stagereplay.analysis.findings import findings_section

    numbers = {"primary": {"transplant": {"all_layers": {"bf16": {"live->prefill": {"n": 0, "donor": 0}}}}}}
    _, record = findings_section(numbers)
    assert [(r["this_run"], r["holds"]) for r in record] == [("no divergent item", "not measured")]
