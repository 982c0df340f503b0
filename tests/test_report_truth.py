"""The report tells only the truth, and says whose run it is: one test (at least) per defect of that issue."""

import json
import re
from pathlib import Path

import pandas as pd

from report_data import (part_provenance, synthetic_audit, synthetic_batch_invariance, synthetic_bridge,
                         synthetic_ledger, synthetic_transplant, write, write_with)
from stagereplay.analysis import figures
from stagereplay.analysis import report as report_module
from stagereplay.analysis import stats as stats_module
from stagereplay.analysis import study
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.report import build_report
from stagereplay.analysis.report_format import format_proportion

REPO = Path(__file__).resolve().parents[1]


def run(tmp_path, ledger=None, inputs=None, results_dir=None, name="r", **kwargs):
    """Build a report; return (its text, stats.json)."""
    md, js = tmp_path / f"{name}.md", tmp_path / f"{name}.json"
    ledgers = {} if ledger is None else {"primary": ledger}
    stats = build_report(ledgers, str(md), str(js), "t", inputs=inputs or {}, results_dir=results_dir, **kwargs)
    return md.read_text(), stats


def coinciding_ledger(n_items=12):
    """A ledger whose fixed-prefix bf16 rows are its matched bf16 rows again (incremental = live), as at the
    precision that generated the prefixes; fp32 fixed-prefix rows of its own."""
    ledger = synthetic_ledger("primary", n_items=n_items, missing=(), nonfinite=())
    matched = ledger[ledger["experiment"] == "matched"]
    again = matched.assign(experiment="fixed_prefix",
                           construction=matched["construction"].replace({"live": "incremental"}))
    rest = ledger[(ledger["experiment"] == "fixed_prefix") & (ledger["precision"] != "bf16")]
    return pd.concat([matched, again, rest], ignore_index=True)


# --- 2. the margin test -------------------------------------------------------------------------------------------

def test_margin_pairs_leave_the_divergence_step_out():
    ledger = synthetic_ledger("primary", n_items=10)
    pairs = analysis.all_pairs(ledger)
    margins = analysis.margin_pairs(ledger, pairs)
    assert len(margins) == int(pairs["disagree"].sum())
    for r in margins.itertuples(index=False):
        row = ledger[(ledger["experiment"] == r.experiment) & (ledger["precision"] == r.precision)
                     & (ledger["replica"] == 1) & (ledger["item_index"] == r.item_index)
                     & ledger["construction"].isin(["live", "incremental"])].iloc[0]
        full = list(row["margins"])
        assert r.margin_divergence == full[r.first_divergence]
        assert r.other_margins == full[:r.first_divergence] + full[r.first_divergence + 1:]


def test_shared_rows_are_tested_and_shown_once(tmp_path):
    ledger = coinciding_ledger()
    assert set(analysis.coinciding_comparisons(ledger)) == {("primary", "bf16")}
    text, stats = run(tmp_path, write(ledger, tmp_path / "ledger.parquet"))
    margins = stats["revisions"]["primary"]["margins"]
    assert set(margins) == {"matched"}  # fixed-prefix bf16 is the matched data: not a second test
    assert "sign test" in margins["matched"]["bf16"]["method"] and "mann_whitney_p_less" not in json.dumps(stats)
    assert "| fixed_prefix | bf16 |" not in text and "| matched | bf16 |" in text
    assert "Fixed-prefix bf16 is not tested again" in text
    assert stats["revisions"]["primary"]["fixed_prefix"]["bf16"]["same_rows_as_matched"] is True
    assert "| bf16 (= matched) |" in text
    assert stats["revisions"]["primary"]["fixed_prefix"]["fp32"]["same_rows_as_matched"] is False


def test_different_rows_are_not_merged():
    ledger = synthetic_ledger("primary", n_items=12)  # fixed-prefix bf16 diverges on its own items
    assert analysis.coinciding_comparisons(ledger) == {}


# --- 3. no fixed text posing as a finding ------------------------------------------------------------------------

def bridge_rows(prefill_exact: bool, precision="bf16", n=12):
    return synthetic_bridge("primary", n=n).assign(precision=precision, status="ok", prefill_bit_exact=prefill_exact)


def test_bridge_reading_is_built_from_the_run(tmp_path):
    ledger = write(synthetic_ledger("primary", n_items=12), tmp_path / "ledger.parquet")
    # A regime where prefill equals live on every row (bf16) and on none (fp32).
    bridge = pd.concat([bridge_rows(True, "bf16"), bridge_rows(False, "fp32")], ignore_index=True)
    text, _ = run(tmp_path, ledger, {"bridge": {"primary": write(bridge, tmp_path / "bridge.parquet")}})
    section = text.split("### Bridge")[1].split("\n### ")[0]
    assert "H200" not in text and "bench/RESULTS.md" not in text
    assert "in general not the live one" not in text
    assert "equals the live cache on every row in bf16" in section
    assert "differs from the live cache on every row in fp32" in section
    assert "12 / 12 rows in bf16 and 12 / 12 rows in fp32" in section  # the run's incremental counts
    # the study's 12 / 12 sits in the reference column, labelled as the study's
    assert "| | reference study | bf16 | fp32 |" in section
    assert "| rows bit-exact (every layer's K and V bytes) | 12 / 12 | 12 / 12 | 12 / 12 |" in section


def test_bridge_reading_follows_a_failing_row(tmp_path):
    ledger = write(synthetic_ledger("primary", n_items=12), tmp_path / "ledger.parquet")
    bridge = bridge_rows(False).assign(bit_exact=[i != 4 for i in range(12)])
    text, _ = run(tmp_path, ledger, {"bridge": {"primary": write(bridge, tmp_path / "bridge.parquet")}})
    assert "11 / 12 rows in bf16" in text and "are not `live` cells in this run" in text
    assert "may stand in for `live`" not in text


# --- 4. the study's numbers in one place --------------------------------------------------------------------------

STUDY_LITERALS = ["166", "1.88", "24 / 24", "43 / 43", "20 / 200", "0.035", "0.055", "-3.5", "+5.5", "12 / 12"]


def test_the_study_numbers_live_only_in_study_py():
    folder = REPO / "src/stagereplay/analysis"
    for path in folder.glob("*.py"):
        if path.name == "study.py":
            continue
        code = path.read_text()
        for literal in STUDY_LITERALS:
            assert literal not in code, f"{path.name} writes down the study's {literal!r}: take it from study.py"
    source = (folder / "study.py").read_text()
    assert '"the reference study"' in source.lower() or "the reference study" in source
    assert "docs/STUDY.md" in source


def test_docs_state_every_number_of_study_py_and_the_sign_convention():
    docs = (REPO / "docs/STUDY.md").read_text()
    numbers = [str(study.MATCHED_DISAGREEMENTS["bf16"]), str(study.MATCHED_LABEL_FLIPS["bf16"]),
               str(study.BRIDGE_BIT_EXACT), str(study.FIXED_PREFIX_DISAGREEMENTS["fp32"]),
               f"{100 * study.FIXED_PREFIX_FP32_WILSON_HIGH:.2f}%", "24 / 24", "43 / 43", "[-3.5, +5.5]",
               str(study.AUDIT_TRAJECTORIES), "src/stagereplay/analysis/study.py"]
    for number in numbers:
        assert number in docs, number
    assert "live - prefill" in docs and "11" in docs and "9" in docs


def test_the_report_takes_the_study_numbers_from_study_py(tmp_path, monkeypatch):
    monkeypatch.setitem(study.MATCHED_DISAGREEMENTS, "bf16", study.Count(77, 200))
    monkeypatch.setattr(study, "BRIDGE_BIT_EXACT", study.Count(5, 9))
    ledger = write(synthetic_ledger("primary", n_items=8), tmp_path / "ledger.parquet")
    text, stats = run(tmp_path, ledger, {"bridge": {"primary": write(bridge_rows(True), tmp_path / "b.parquet")}})
    assert "| bf16 | 77 / 200 |" in text and "| 5 / 9 |" in text
    assert stats["reference_study"]["matched_disagreements"]["bf16"] == {"k": 77, "n": 200}


# --- 5. units of the audit ----------------------------------------------------------------------------------------

def test_audit_counts_trajectories_and_rows(tmp_path):
    ledger = synthetic_ledger("primary", n_items=10, missing=(), nonfinite=())
    failing = ledger.index[(ledger["experiment"] == "fixed_prefix") & (ledger["item_index"] == 2)][:1].tolist()
    paths = {"audit": {"primary": write(synthetic_audit(ledger, failing=failing), tmp_path / "audit.parquet")}}
    text, stats = run(tmp_path, write(ledger, tmp_path / "ledger.parquet"), paths)
    audit = stats["revisions"]["primary"]["audit"]
    assert (audit["trajectories"]["bf16"]["k"], audit["trajectories"]["bf16"]["n"]) == (10, 10)
    assert (audit["items"]["k"], audit["items"]["n"]) == (9, 10)
    assert (audit["reproduced"]["k"], audit["reproduced"]["n"]) == (len(ledger) - 1, len(ledger))
    assert f"| retained trajectories reproduced (bf16: matched `live`, replica 1) | {study.AUDIT_TRAJECTORIES} | " \
           "10 / 10 |" in text
    assert f"| ledger rows reproduced (trajectories and fingerprints) | — (not counted in rows) | " \
           f"{len(ledger) - 1} / {len(ledger)} |" in text


# --- 6 and 7. a later revision: shown as it is, never lost --------------------------------------------------------

def later_transplant():
    frame = synthetic_transplant("later").assign(divergent=True, live_fingerprint_match=None)
    return frame.astype({"live_fingerprint_match": "object"})


def results_tree(tmp_path):
    """results/<run>/ after a run at [primary, later] followed by a plain rerun: later/ keeps its transplants."""
    root = tmp_path / "results" / "t"
    ledger = synthetic_ledger("primary", n_items=8)
    write(ledger, root / "primary" / "ledger.parquet")
    write(synthetic_audit(ledger), root / "primary" / "audit.parquet")
    (root / "primary" / "audit_check.json").write_text(json.dumps({"reproduced": len(ledger),
                                                                   "ledger_rows": len(ledger)}))
    write(synthetic_transplant("primary").assign(divergent=True), root / "primary" / "transplant.parquet")
    write(later_transplant(), root / "later" / "transplant.parquet")
    return root


def test_a_revision_without_a_ledger_shows_only_what_applies(tmp_path):
    root = results_tree(tmp_path)
    inputs = {"transplant": {"primary": str(root / "primary/transplant.parquet"),
                             "later": str(root / "later/transplant.parquet")},
              "audit": {"primary": str(root / "primary/audit.parquet")},
              "audit_check": {"primary": str(root / "primary/audit_check.json")}}
    text, stats = run(tmp_path, str(root / "primary/ledger.parquet"), inputs)
    later = text.split("## Revision `later`")[1]
    assert "Skipped" not in later and "yet" not in later
    assert "live cache fingerprint" not in later  # no ledger there: nothing to match, not "0 / 6"
    assert "No ledger for this revision" in later and "transplant.parquet" in later
    assert set(stats["revisions"]["later"]) == {"transplant"}
    assert "live_fingerprint_match" not in stats["revisions"]["later"]["transplant"]


def test_a_plain_rerun_keeps_the_later_revision_on_disk(tmp_path):
    root = results_tree(tmp_path)
    # The plain rerun declares the primary revision's files only.
    inputs = {"transplant": {"primary": str(root / "primary/transplant.parquet")},
              "audit": {"primary": str(root / "primary/audit.parquet")}}
    text, stats = run(tmp_path, str(root / "primary/ledger.parquet"), inputs, results_dir=str(root))
    assert "## Revision `later`" in text and "later" in stats["revisions"]
    assert stats["revisions_found_on_disk_only"] == ["later"]
    assert "Found on disk, not among this invocation's declared inputs" in text
    # and the declared audit_check.json of the primary is found too
    assert stats["audit"]["primary"]["state"] == "passed"


def test_figures_draw_every_revision_on_disk(tmp_path, monkeypatch):
    from stagereplay.analysis import figures

    root = results_tree(tmp_path)
    seen = {}
    monkeypatch.setitem(figures.PLOTTERS, "fig5_transplant",
                        lambda matrix, paths, **kw: seen.setdefault("revisions", set(matrix["revision"])))
    figures.plot_figures({"ledger": {"primary": str(root / "primary/ledger.parquet")},
                          "transplant": {"primary": str(root / "primary/transplant.parquet")}},
                         {"fig5_transplant": {"png": str(tmp_path / "f.png")}}, results_dir=str(root))
    assert seen["revisions"] == {"primary", "later"}


# --- 8. the report is gated by the audit --------------------------------------------------------------------------

def audited(tmp_path, failing=(), check=True, check_count=None):
    ledger = synthetic_ledger("primary", n_items=6)
    inputs = {"audit": {"primary": write(synthetic_audit(ledger, failing=failing), tmp_path / "audit.parquet")}}
    if check:
        path = tmp_path / "audit_check.json"
        path.write_text(json.dumps({"reproduced": len(ledger) if check_count is None else check_count,
                                    "ledger_rows": len(ledger)}))
        inputs["audit_check"] = {"primary": str(path)}
    return write(ledger, tmp_path / "ledger.parquet"), inputs, ledger


def first_paragraph(text: str) -> str:
    return text.split("\n\n")[1]


def test_a_failed_audit_is_the_first_thing_the_report_says(tmp_path):
    ledger, inputs, frame = audited(tmp_path, failing=(3,), check=False)
    text, stats = run(tmp_path, ledger, inputs)
    assert first_paragraph(text).startswith("> **AUDIT FAILED.** Revision `primary`: ")
    assert f"{len(frame) - 1} of {len(frame)} ledger rows reproduced" in first_paragraph(text)
    assert stats["audit"]["primary"]["state"] == "failed"


def test_a_stale_audit_check_does_not_pass(tmp_path):
    ledger, inputs, frame = audited(tmp_path, check_count=3)
    text, stats = run(tmp_path, ledger, inputs)
    assert first_paragraph(text).startswith("> **AUDIT FAILED.**") and "stale" in first_paragraph(text)


def test_an_unchecked_audit_is_said_first(tmp_path):
    ledger, inputs, _ = audited(tmp_path, check=False)
    text, stats = run(tmp_path, ledger, inputs)
    assert first_paragraph(text).startswith("> **Audit not confirmed.**") and stats["audit"]["primary"]["state"] == \
        "unchecked"
    text, stats = run(tmp_path, ledger, {})
    assert first_paragraph(text).startswith("> **Audit not confirmed.**") and "no audit.parquet" in text


def test_a_passed_audit_is_said_first(tmp_path):
    ledger, inputs, frame = audited(tmp_path)
    text, stats = run(tmp_path, ledger, inputs)
    assert first_paragraph(text) == (f"Audit: revision `primary`: all {len(frame)} ledger rows recomputed and "
                                     "reproduced (audit_check.json).")
    assert "AUDIT FAILED" not in text


def test_an_audit_row_without_a_ledger_row_fails_the_audit(tmp_path):
    ledger, inputs, frame = audited(tmp_path)
    audit = synthetic_audit(frame)
    invented = audit.iloc[[0]].assign(item_index=99, item_id="item-99")
    write(pd.concat([audit, invented]), inputs["audit"]["primary"])
    text, stats = run(tmp_path, ledger, inputs)
    assert "AUDIT FAILED" in first_paragraph(text) and "have no ledger row" in first_paragraph(text)


def test_the_report_rule_takes_the_audit_checks():
    rule = (REPO / "workflow/rules/report.smk").read_text().split("rule build_report:")[1].split("output:")[0]
    assert "audit_check.json" in rule
    script = (REPO / "workflow/scripts/build_report.py").read_text()
    assert "results_dir" in script


# --- 9. batch invariance counts rows with something to compare ---------------------------------------------------

def test_batch_invariance_counts_only_comparable_rows(tmp_path):
    ledger = write(synthetic_ledger("primary", n_items=6), tmp_path / "ledger.parquet")
    path = write_with(synthetic_batch_invariance(), tmp_path / "bi.parquet",
                      {"batch_plan": {"batch_size": 4, "seed": 0}, "batch_invariance": {"status": "compared"}})
    text, stats = run(tmp_path, ledger, {"batch_invariance": {"primary": path}})
    live = stats["revisions"]["primary"]["batch_invariance"]["fp32"]["live"]
    assert (live["cache_equal"]["k"], live["cache_equal"]["n"]) == (2, 2)  # not 2 / 4: two rows have no cache
    assert (live["suffix_equal"]["k"], live["suffix_equal"]["n"]) == (2, 2)
    assert (live["n_without_cache"], live["n_not_ok"], live["n"]) == (2, 2, 4)
    assert "| fp32 | live | 4 | 2 / 2 (100.0%" in text and "| 2 |" in text


# --- 10. whose run it is ------------------------------------------------------------------------------------------

def test_the_report_says_what_produced_the_run(tmp_path):
    ledger = synthetic_ledger("primary", n_items=6)
    prov = {"stage": "gather", "parts": [part_provenance("bf16"), part_provenance("fp32")]}
    path = write_with(ledger, tmp_path / "ledger.parquet", prov)
    selection = write_with(pd.DataFrame({"item_index": range(6), "item_id": [f"item-{i}" for i in range(6)]}),
                           tmp_path / "items.parquet",
                           {"stage": "select_items", "seed": 0,
                            "config": {"dataset": {"source": "synthetic", "size": 1000, "seed": 0}, "n_items": 6}})
    text, stats = run(tmp_path, path, selection=selection)
    ident = text.split("## What produced this run")[1].split("\n## ")[0]
    for expected in ("| model | `data/toy` |", "requested `primary`; source `data/toy/primary`",
                     "resolved: not recorded", "| dataset | source `synthetic`, seed 0, size 1000 |",
                     "selected items (items.parquet content sha256): `", "rows as read: not recorded",
                     "| items | 6 selected (config n_items); 6 in the ledger(s) |",
                     "max_stage_tokens 32; max_new_tokens 48", "marker `;`", "| precisions | `bf16`; `fp32` |",
                     "decode_regime `eager`", "stagereplay `0.1.0`, commit `abc123`", "torch `2.13.0`",
                     "transformers `4.99.0`", "device `cpu`", "tf32 False"):
        assert expected in ident, expected
    assert text.index("## What produced this run") < text.index("## Revision `primary`")
    assert stats["identity"]["model"] == ["data/toy"]


def test_identity_says_not_recorded_rather_than_inventing(tmp_path):
    ledger = write(synthetic_ledger("primary", n_items=4), tmp_path / "ledger.parquet")  # provenance: a stage name
    text, _ = run(tmp_path, ledger)
    ident = text.split("## What produced this run")[1].split("\n## ")[0]
    assert "| model | not recorded |" in ident and "| dataset | not recorded (no selection/items.parquet) |" in ident
    assert re.search(r"\| package \| stagereplay not recorded, commit not recorded \|", ident)


def test_the_model_files_and_the_dataset_content_are_named(tmp_path):
    prov = {"stage": "gather", "parts": [part_provenance("bf16", model_sha256="feed" * 16)]}
    ledger = write_with(synthetic_ledger("primary", n_items=4), tmp_path / "ledger.parquet", prov)
    selection = write_with(pd.DataFrame({"item_index": range(4), "item_id": [f"item-{i}" for i in range(4)]}),
                           tmp_path / "items.parquet",
                           {"stage": "select_items", "seed": 0, "dataset_fingerprint": "ab" * 32, "dataset_rows": 9,
                            "dataset_sha256": "cd" * 32,
                            "config": {"dataset": {"source": "jsonl", "path": "d.jsonl"}, "n_items": 4}})
    text, stats = run(tmp_path, ledger, selection=selection)
    assert f"resolved: model files sha256 `{'feed' * 16}`" in text
    assert f"rows as read: `{'ab' * 32}` (9 rows); dataset file sha256 `{'cd' * 32}`" in text
    assert stats["identity"]["dataset_fingerprint"]["file"] == ["cd" * 32]


def test_identity_shows_only_what_applies_once(tmp_path):
    """A jsonl dataset recorded with every schema default, a CPU run's determinism flags, the numerics regime and
    the transplant selection: the keys the source reads, no CUDA-only flag, numerics once, how items were drawn."""
    flags = {"deterministic_algorithms": True, "cublas_workspace_config": ":4096:8", "tf32_matmul": False,
             "tf32_cudnn": False, "float32_matmul_precision": "highest"}
    prov = {"stage": "gather", "parts": [part_provenance("bf16", device="cpu:x86_64 AVX2", numerics=flags)]}
    ledger = write_with(synthetic_ledger("primary", n_items=4), tmp_path / "ledger.parquet", prov)
    dataset = {"source": "jsonl", "size": 5000, "seed": 0, "path": "d.jsonl", "name": None, "subset": None,
               "split": "test", "revision": None, "fields": {"question": "question", "answer": "answer"}}
    selection = write_with(pd.DataFrame({"item_index": range(4), "item_id": [f"item-{i}" for i in range(4)]}),
                           tmp_path / "items.parquet",
                           {"stage": "select_items", "seed": 0, "config": {"dataset": dataset, "n_items": 4}})
    selected = {"rule": "divergent:12", "seed": 0, "n_candidates": 200, "n_divergent": 38, "n_selected": 12,
                "decided_from": "suffix token ids of the two constructions (replica 1); never correctness or "
                                "transplant outcomes"}
    transplant = write_with(synthetic_transplant("primary"), tmp_path / "transplant.parquet",
                            {**part_provenance("bf16", device="cpu:x86_64 AVX2", numerics=flags),
                             "stage": "transplant_caches", "selection": selected,
                             "config": {"sweeps": ["all", "k_only"]}})
    text, _ = run(tmp_path, ledger, {"transplant": {"primary": transplant}}, selection=selection)
    ident = text.split("## What produced this run")[1].split("\n## ")[0]
    row = next(line for line in ident.splitlines() if line.startswith("| dataset |"))
    assert row == "| dataset | source `jsonl`, path `d.jsonl`, fields answer `answer`, question `question` |"
    flags_row = next(line for line in ident.splitlines() if line.startswith("| determinism flags |"))
    assert "deterministic_algorithms True" in flags_row and "float32_matmul_precision `highest`" in flags_row
    assert "cublas" not in flags_row and "tf32" not in flags_row
    regime = next(line for line in ident.splitlines() if line.startswith("| numerics and decode regime |"))
    assert regime == "| numerics and decode regime | numerics `default`; decode_regime `eager`; batch_size 1 |"
    assert ("| transplants `primary` | rule `divergent:12` (seed 0): 12 items drawn from the 38 divergent of 200 "
            "candidates (outcome-blind); sweeps [`all`, `k_only`] |") in ident


def test_a_hub_commit_is_named(tmp_path):
    prov = {"stage": "gather", "parts": [part_provenance("bf16", model_commit="0123abcd", model_source="org/m@main")]}
    ledger = write_with(synthetic_ledger("primary", n_items=4), tmp_path / "ledger.parquet", prov)
    text, _ = run(tmp_path, ledger)
    assert "resolved: hub commit `0123abcd`" in text


# --- the transplant: a consistency check, and the localisation ---------------------------------------------------

def test_transplant_section_calls_the_all_layer_transplant_a_check_and_leads_with_the_localisation(tmp_path):
    frame = synthetic_transplant("primary").assign(divergent=True)
    frame["cache_fingerprint"] = [f"c{i}" for i in range(len(frame))]
    frame["donor_cache_fingerprint"] = frame["cache_fingerprint"].where(
        (frame["layer_set"] == "all") & (frame["component"] == "kv") & (frame["positions"] == "all"), "other")
    lines, numbers = report_module.transplant_section(report_module.RevisionData("primary", {}, _frames={
        "transplant": frame}))
    text = "\n".join(lines)
    assert text.index("#### Localisation") < text.index("#### Claim: bidirectional transplant of all K/V layers")
    assert "consistency check" in text and "not a finding about the model" in text
    assert "| bf16 | incremental->prefill | 6 / 6 | 0 | 0 | 6 / 6 |" in text  # follows donor; cache = donor's
    assert numbers["all_layers"]["bf16"]["incremental->prefill"]["cache_equals_donor"] == {"k": 6, "n": 6}
    # every localisation row beside its placebo, read net of it
    assert "placebo follows donor" in text and "McNemar exact p" in text
    assert "Not separable from its placebo" in text or "Carries beyond its placebo" in text


# --- a fixed-prefix pair other than the study's ---------------------------------------------------------------------

def test_a_fixed_prefix_pair_of_other_constructions_is_named_and_not_set_against_the_study(tmp_path):
    ledger = synthetic_ledger("primary", n_items=6)
    fixed = ledger["experiment"] == "fixed_prefix"
    ledger.loc[fixed & (ledger["construction"] == "prefill"), "construction"] = "prefix_cached"
    assert analysis.fixed_prefix_pair(ledger) == ("incremental", "prefix_cached")
    text, stats = run(tmp_path, write(ledger, tmp_path / "ledger.parquet"))
    section = text.split("### Fixed-prefix 2x2")[1].split("\n### ")[0]
    assert "this run: incremental vs prefix_cached" in section and "(incremental − prefix_cached)" in section
    assert "— (the study compared incremental vs prefill)" in section
    assert study.fixed_prefix_text("fp32") not in section
    assert stats["revisions"]["primary"]["fixed_prefix"]["fp32"]["constructions"] == ["incremental", "prefix_cached"]
    assert not analysis.coinciding_comparisons(ledger)  # prefix_cached is not the matched prefill
    pairs = analysis.all_pairs(ledger)
    assert set(pairs.loc[pairs["experiment"] == "fixed_prefix", "construction_b"]) == {"prefix_cached"}


# --- more than two fixed-prefix constructions: each replay construction against incremental ----------------------

REPLAYS = {"chunked": {"bf16": {0, 4, 7}, "fp32": {7}}, "prefix_cached": {"bf16": set(), "fp32": set()}}


def _recount(ledger, a, b, precision):
    """Items compared and items whose suffix ids / labels differ, by a plain loop over the replica-1 rows."""
    rows = ledger[(ledger["experiment"] == "fixed_prefix") & (ledger["precision"] == precision)
                  & (ledger["replica"] == 1)]
    n = differ = flips = 0
    for _, item in rows.groupby("item_index"):
        by = {r["construction"]: r for _, r in item.iterrows()}
        if a in by and b in by and by[a]["status"] == "ok" and by[b]["status"] == "ok":
            n += 1
            differ += list(by[a]["suffix_ids"]) != list(by[b]["suffix_ids"])
            flips += bool(by[a]["correct"]) != bool(by[b]["correct"])
    return n, differ, flips


def test_each_replay_construction_is_set_against_incremental_per_precision(tmp_path):
    ledger = synthetic_ledger("primary", n_items=12, replays=REPLAYS)
    assert analysis.fixed_prefix_constructions(ledger) == ("incremental", "prefill", "chunked", "prefix_cached")
    assert analysis.fixed_prefix_pair(ledger) == ("incremental", "prefill")
    text, stats = run(tmp_path, write(ledger, tmp_path / "ledger.parquet"))
    section = text.split("### Fixed-prefix 2x2")[1].split("\n### ")[0]
    assert "| precision | construction | suffixes that differ from incremental | labels that differ |" in section
    replays = section.split("suffixes that differ from incremental")[1].split("Replicas of each cell")[0]
    table = [line.split(" | ")[:2] for line in replays.splitlines() if line.startswith(("| bf16 | ", "| fp32 | "))]
    assert table == [[f"| {p}", c] for p in ("bf16", "fp32") for c in ("prefill", "chunked", "prefix_cached")]
    fixed = stats["revisions"]["primary"]["fixed_prefix"]
    for precision in ("bf16", "fp32"):
        against = fixed[precision]["against_reference"]
        assert sorted(against) == ["chunked", "prefill", "prefix_cached"]  # one comparison per replay construction
        for construction, numbers in against.items():
            n, differ, flips = _recount(ledger, "incremental", construction, precision)
            assert numbers["constructions"] == ["incremental", construction] and numbers["n_compared"] == n
            dis = numbers["suffix_disagreements"]
            assert (dis["k"], dis["n"]) == (differ, n) and (numbers["label_flips"]["k"], n) == (flips, n)
            expected = stats_module.proportion(differ, n)
            assert dis["wilson_low"] == expected["wilson_low"] and dis["wilson_high"] == expected["wilson_high"]
            flips = format_proportion(numbers["label_flips"])
            row = f"| {precision} | {construction} | {format_proportion(dis)} | {flips} |"
            assert row in section, row
        # the comparison with prefill is the 2x2's own
        assert against["prefill"]["suffix_disagreements"] == fixed[precision]["suffix_disagreements"]
    assert fixed["bf16"]["against_reference"]["chunked"]["suffix_disagreements"]["k"] == len(
        REPLAYS["chunked"]["bf16"] - {3})  # item 3 never reached its boundary
    assert fixed["fp32"]["against_reference"]["prefix_cached"]["suffix_disagreements"]["k"] == 0


def test_the_2x2_and_figures_read_the_same_with_more_constructions(tmp_path):
    """The pair's numbers do not move when more constructions ran beside it; the figures still draw."""
    two = synthetic_ledger("primary", n_items=12)
    four = synthetic_ledger("primary", n_items=12, replays=REPLAYS)
    pd.testing.assert_frame_equal(analysis.all_pairs(two), analysis.all_pairs(four))
    _, stats_two = run(tmp_path, write(two, tmp_path / "two.parquet"), name="two")
    _, stats_four = run(tmp_path, write(four, tmp_path / "four.parquet"), name="four")
    for precision, numbers in stats_four["revisions"]["primary"]["fixed_prefix"].items():
        numbers = {k: v for k, v in numbers.items() if k not in ("against_reference", "replicas")}
        expected = {k: v for k, v in stats_two["revisions"]["primary"]["fixed_prefix"][precision].items()
                    if k != "replicas"}
        assert numbers == expected
    assert "against_reference" not in json.dumps(stats_two)
    written = figures.plot_figures({"ledger": {"primary": str(tmp_path / "four.parquet")}},
                                   {name: {"png": str(tmp_path / f"{name}.png")} for name in
                                    ("fig1_disagreement", "fig2_first_divergence", "fig3_margins", "fig6_accuracy")})
    assert all(Path(path).stat().st_size > 1000 for path in written)
    assert analysis.replay_cells(two)["construction_b"].tolist() == ["prefill", "prefill"]


def test_a_layer_bit_identical_in_every_divergent_item_is_marked_in_the_minimal_sets(tmp_path):
    from report_data import synthetic_minimal_transplant, synthetic_onset

    minimal = write(synthetic_minimal_transplant(), tmp_path / "minimal.parquet")
    onset = synthetic_onset()
    inputs = {"minimal_transplant": {"primary": minimal}}
    # item 0's difference starts at layer 0 in the synthetic table: no layer is identical everywhere, no mark
    text, stats = run(tmp_path, None, {**inputs, "divergence_onset": {"primary": write(onset, tmp_path / "o.parquet")}})
    assert "layer 0*" not in text and "Bit-identical in both constructions' caches" not in text
    assert stats["revisions"]["primary"]["minimal_transplant"]["layers_bit_identical_in_every_divergent_item"] == {
        p: [] for p in onset["precision"].unique()}
    onset = onset[onset["item_index"] != 0]  # now layer 0 is bit-identical in every divergent item
    assert onset.loc[onset["layer"] == 0, "bit_equal"].astype(bool).all()
    text, _ = run(tmp_path, None, {**inputs, "divergence_onset": {"primary": write(onset, tmp_path / "o.parquet")}},
                  name="again")
    assert "layer 0*: " in text and "layer 1: " in text and "layer 1*" not in text
    assert "Bit-identical in both constructions' caches of every divergent item" in text


def test_a_revisions_own_split_count_is_in_its_transplant_section(tmp_path):
    selected = {"rule": "divergent:12", "seed": 0, "n_candidates": 200, "n_divergent": 41, "n_selected": 12}
    later = write_with(synthetic_transplant("later"), tmp_path / "later_transplant.parquet",
                       {"stage": "transplant_caches", "selection": selected})
    text, stats = run(tmp_path, None, {"transplant": {"later": later}})
    section = text.split("## Revision `later`")[1]
    assert "At revision `later` the two constructions continue differently on 41 of 200 items" in section
    assert stats["revisions"]["later"]["transplant"]["split"] == {"k": 41, "n": 200}


# --- accuracy beside the suffixes cut at max_new_tokens ------------------------------------------------------------

def cut_at_budget(ledger, experiment, precision):
    """Per construction of the cell, by a plain loop over replica 1: (suffixes stopped at max_new_tokens, items
    compared), over the items with status ok on both constructions."""
    rows = ledger[(ledger["experiment"] == experiment) & (ledger["precision"] == precision) & (ledger["replica"] == 1)]
    cut, n = {}, 0
    for _, item in rows.groupby("item_index"):
        if len(item) < 2 or (item["status"] != "ok").any():
            continue
        n += 1
        for r in item.itertuples(index=False):
            cut[r.construction] = cut.get(r.construction, 0) + (r.stop_reason == "max_new_tokens")
    return {construction: (k, n) for construction, k in cut.items()}


def budget_report(tmp_path, truncated):
    ledger = synthetic_ledger("primary", truncated=truncated)
    path = write_with(ledger, tmp_path / "ledger.parquet", part_provenance("bf16"))
    text, stats = run(tmp_path, path, figures={"fig6_accuracy": str(tmp_path / "figures/fig6_accuracy.png")})
    sections = {name: text.split(f"### {name}")[1].split("\n### ")[0]
                for name in ("Matched experiment", "Fixed-prefix 2x2")}
    return ledger, text, stats, sections


def test_the_suffixes_cut_at_max_new_tokens_are_counted_beside_the_accuracies(tmp_path):
    """A real run's report gave its accuracies without saying that 42 of 48 suffixes stopped at max_new_tokens."""
    ledger, text, stats, sections = budget_report(tmp_path, {("matched", "bf16", "live"): range(30),
                                                             ("matched", "bf16", "prefill"): range(28),
                                                             ("fixed_prefix", "fp32", "prefill"): (1, 2)})
    matched = cut_at_budget(ledger, "matched", "bf16")
    assert matched == {"live": (28, 38), "prefill": (26, 38)}  # items 3 and 5 are not compared
    recorded = stats["revisions"]["primary"]["matched"]["bf16"]["suffixes_at_max_new_tokens"]
    assert {c: (p["k"], p["n"]) for c, p in recorded.items()} == matched
    assert ("Compared suffixes that stopped at `max_new_tokens` (48) before EOS: bf16: 28 / 38 live and 26 / 38 "
            "prefill.") in sections["Matched experiment"]
    assert "**Accuracy on truncated answers** at bf16:" in sections["Matched experiment"]
    fp32 = cut_at_budget(ledger, "fixed_prefix", "fp32")
    assert fp32 == {"incremental": (0, 39), "prefill": (2, 39)}
    assert ("bf16: 0 / 39 incremental and 0 / 39 prefill; fp32: 0 / 39 incremental and 2 / 39 prefill."
            in sections["Fixed-prefix 2x2"])
    assert "truncated answers" not in sections["Fixed-prefix 2x2"]  # 2 of 39 is no large share
    caption = next(line for line in text.splitlines() if line.startswith("**Figure 6."))
    assert "`primary` matched bf16: 28 / 38 live and 26 / 38 prefill" in caption
    assert "**Accuracy on truncated answers** at `primary` matched bf16:" in caption
    findings = text.split("## Findings")[1].split("\n## ")[0]
    row = next(line for line in findings.splitlines() if "accuracy difference" in line)
    assert "28 / 38 live and 26 / 38 prefill suffixes cut at max_new_tokens: **accuracy on truncated answers**" in row


def test_no_warning_where_every_suffix_ended_at_eos(tmp_path):
    _, text, stats, sections = budget_report(tmp_path, None)
    assert "truncated answers" not in text
    for name in ("Matched experiment", "Fixed-prefix 2x2"):
        assert "No compared suffix stopped at `max_new_tokens` (48)" in sections[name]
    assert {c: p["k"] for c, p in stats["revisions"]["primary"]["matched"]["bf16"][
        "suffixes_at_max_new_tokens"].items()} == {"live": 0, "prefill": 0}
