"""fixed_prefix.constructions with more than two constructions: all of them built in the one fixed-prefix experiment
(same prefix ids, batches and layout, two replicas each, at every precision), audited row by row, each replay
construction set against incremental in the report, and a transplant pair taken from what ran; a pair that did not
run, one construction or a repeated one are refused before any work."""

import copy
import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from stagereplay.config import check_transplant_pair, schema_file
from stagereplay.experiments.rows import LAYOUT_COLUMNS
from stagereplay.stages.transplant_selection import baseline_rows
from workflow_runner import snakemake, tiny_config

REPO = Path(__file__).resolve().parents[1]
SCHEMA = schema_file()  # the schema the workflow validates with
ALL = ["incremental", "prefill", "chunked", "prefix_cached"]
TINY = dict(n_items=4, max_new_tokens=8, precisions=["bf16", "fp32"], reference_precision="bf16", chunk_size=3,
            bridge={"n_rows": 2, "seed": 0}, fixed_prefix={"constructions": ALL},
            transplant={"select": "sample:2", "sweeps": ["all"], "constructions": ["incremental", "chunked"],
                        "minimal": {"budget": 4}})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("replays")
    tiny_config(workdir, **TINY)
    snakemake(workdir, "--cores", "2")
    return workdir


def _recount(ledger, a, b, precision):
    """Items compared, and items whose suffix ids differ, by a plain loop over the ledger's replica-1 rows."""
    rows = ledger[(ledger["experiment"] == "fixed_prefix") & (ledger["precision"] == precision)
                  & (ledger["replica"] == 1)]
    n = differ = 0
    for _, item in rows.groupby("item_index"):
        by = {r["construction"]: r for _, r in item.iterrows()}
        if by[a]["status"] == "ok" and by[b]["status"] == "ok":
            n += 1
            differ += list(by[a]["suffix_ids"]) != list(by[b]["suffix_ids"])
    return n, differ


@pytest.mark.slow
def test_every_construction_runs_is_audited_and_is_set_against_incremental(run):
    res = run / "results/tiny/primary"
    ledger = pd.read_parquet(res / "ledger.parquet")
    fixed = ledger[ledger["experiment"] == "fixed_prefix"]
    reference = ledger[(ledger["experiment"] == "matched") & (ledger["construction"] == "live")
                       & (ledger["precision"] == "bf16") & (ledger["replica"] == 1)].set_index("item_index")
    ok_items = set(reference.index[reference["stage_ids"].map(len) > 0])
    assert len(fixed) == 2 * len(ALL) * 2 * len(ok_items)  # precisions x constructions x replicas x items
    for (item, precision), cell in fixed.groupby(["item_index", "precision"]):
        assert sorted(cell["construction"].unique()) == sorted(ALL) and set(cell["replica"]) == {1, 2}
        # parity: the same reference prefix ids and the same batch and layout, only the boundary cache differs
        assert {tuple(s) for s in cell["stage_ids"]} == {tuple(reference.loc[item, "stage_ids"])}
        assert len(cell[list(LAYOUT_COLUMNS)].drop_duplicates()) == 1
    audit = pd.read_parquet(res / "audit.parquet")
    assert len(audit) == len(ledger) and audit["reproduced"].all()

    stats = json.loads((run / "results/tiny/report/stats.json").read_text())["revisions"]["primary"]
    report = (run / "results/tiny/report/report.md").read_text()
    assert "| precision | construction | suffixes that differ from incremental |" in report
    for precision in ("bf16", "fp32"):
        against = stats["fixed_prefix"][precision]["against_reference"]
        assert sorted(against) == ["chunked", "prefill", "prefix_cached"]  # one comparison per replay construction
        for construction, numbers in against.items():
            n, differ = _recount(ledger, "incremental", construction, precision)
            dis = numbers["suffix_disagreements"]
            assert (dis["k"], dis["n"]) == (differ, n) and dis["wilson_high"] is not None
            assert any(line.startswith(f"| {precision} | {construction} | {differ} / {n} (")
                       for line in report.splitlines()), (precision, construction)
        assert stats["fixed_prefix"][precision]["constructions"] == ["incremental", "prefill"]  # the 2x2's pair

    # the transplant pair comes from the fixed-prefix rows that ran; figures and browser still build
    transplant = pd.read_parquet(res / "transplant.parquet")
    assert set(transplant["direction"]) == {"incremental->chunked", "chunked->incremental"}
    dumps = pd.read_parquet(res / "caches.parquet")
    assert set(dumps["construction"]) <= {"incremental", "chunked"}
    for name in ("fig1_disagreement", "fig3_margins", "fig6_accuracy"):
        assert (run / f"results/tiny/report/figures/{name}.png").stat().st_size > 1000
    assert (run / "results/tiny/report/items.html").is_file()


def test_baseline_pair_comes_from_one_experiment_and_a_missing_one_is_named():
    def row(experiment, construction, stage, suffix):
        return {"item_index": 0, "item_id": "a", "experiment": experiment, "precision": "fp32",
                "construction": construction, "replica": 1, "status": "ok", "prompt_ids": [1], "stage_ids": stage,
                "suffix_ids": suffix}

    baseline = pd.DataFrame([row("matched", "live", [2], [5]), row("matched", "prefill", [2], [5]),
                             row("fixed_prefix", "incremental", [3], [6]), row("fixed_prefix", "prefill", [3], [7]),
                             row("fixed_prefix", "chunked", [3], [6])])
    pairs = baseline_rows(baseline, "fp32", ("incremental", "prefill"))  # both from the fixed-prefix rows
    assert (pairs["suffix_a"][0], pairs["suffix_b"][0]) == ([6], [7])
    pairs = baseline_rows(baseline, "fp32", ("live", "prefill"))  # both from the matched rows
    assert (pairs["suffix_a"][0], pairs["suffix_b"][0]) == ([5], [5])
    with pytest.raises(ValueError, match=r"the baseline has no \['prefix_cached'\] rows at fp32; add them to "
                                         r"fixed_prefix.constructions"):
        baseline_rows(baseline, "fp32", ("incremental", "prefix_cached"))


def test_a_run_where_no_item_reached_the_boundary_transplants_nothing_and_the_report_says_so_once(tmp_path):
    """max_stage_tokens: 1 (or a marker the model never writes): generation ran, then select_transplant_items,
    dump_caches and measure_divergence_onset failed saying "add them to fixed_prefix.constructions"."""
    from stagereplay.analysis.report import no_boundary_line
    from stagereplay.io.parquet import read_parquet, write_parquet
    from stagereplay.stages.transplant_selection import select_transplant_items

    rows = [{"item_index": i, "item_id": f"toy-{i}", "revision": "primary", "experiment": "matched",
             "precision": "bf16", "construction": "live", "replica": replica, "status": "boundary_missing",
             "prompt_ids": [1, 2], "stage_ids": [3], "suffix_ids": []} for i in range(2) for replica in (1, 2)]
    ledger = pd.DataFrame(rows)
    assert baseline_rows(ledger, "bf16", ("live", "prefill")).empty
    write_parquet(ledger, tmp_path / "ledger.parquet", {"stage": "gather"})
    select_transplant_items(str(tmp_path / "ledger.parquet"), str(tmp_path / "selection.parquet"),
                            revision="primary", precision="bf16", select="divergent")
    assert read_parquet(tmp_path / "selection.parquet").empty
    assert no_boundary_line(ledger) == (
        "**No item reached the stage boundary at this revision** (2 boundary_missing): there are no prefixes, so no "
        "construction was compared and the fixed-prefix, bridge, transplant and divergence stages had nothing to do. "
        "Check `boundary` and `max_stage_tokens` above: the marker must be text the model writes within the stage "
        "budget. Each item is listed under \"Items excluded and why\".")
    reached = pd.DataFrame([dict(rows[0], status="ok")] + rows[1:])
    assert no_boundary_line(reached) is None
    # a pair the experiments did not run is still named where items did reach the boundary
    with pytest.raises(ValueError, match=r"the baseline has no \['prefill'\] rows at bf16; add them to"):
        baseline_rows(reached, "bf16", ("live", "prefill"))


def test_a_transplant_pair_that_did_not_run_is_refused_when_the_workflow_is_parsed(tmp_path):
    check_transplant_pair(["incremental", "chunked"], ALL)
    check_transplant_pair(["live", "prefill"], ["incremental", "prefill"])
    with pytest.raises(ValueError, match=r"\['chunked'\] not built at the primary revision.*add \['chunked'\] to "
                                         r"fixed_prefix.constructions"):
        check_transplant_pair(["live", "chunked"], ["incremental", "prefill"])
    tiny_config(tmp_path, transplant={"constructions": ["incremental", "prefix_cached"]})
    proc = snakemake(tmp_path, "--dry-run", "--no-hooks", check=False)
    assert proc.returncode != 0 and "['prefix_cached'] not built at the primary revision" in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("constructions, words", [
    (["incremental"], "is too short"),
    ([], "is too short"),
    (["incremental", "incremental"], "has non-unique elements"),
    (["incremental", "prefill", "chunked", "prefill"], "has non-unique elements"),
    (["incremental", "live"], "'live' is not one of"),
])
def test_one_construction_or_a_repeated_one_is_refused_by_the_schema(constructions, words):
    cfg = copy.deepcopy(yaml.safe_load((REPO / "config.yaml").read_text()))
    cfg["fixed_prefix"] = {"constructions": constructions}
    with pytest.raises(WorkflowError) as err:
        validate(cfg, SCHEMA, set_default=True)
    assert words in str(err.value) and "['fixed_prefix']" in str(err.value) and "constructions" in str(err.value)


def test_two_or_more_distinct_constructions_are_accepted():
    for constructions in (["incremental", "prefill"], ALL, ["prefix_cached", "chunked", "incremental"]):
        cfg = copy.deepcopy(yaml.safe_load((REPO / "config.yaml").read_text()))
        cfg["fixed_prefix"] = {"constructions": constructions}
        validate(cfg, SCHEMA, set_default=True)
        assert cfg["fixed_prefix"]["constructions"] == constructions
