"""End to end: the minimal-transplant search and the divergence onset in the workflow, on items whose constructions
diverge on the embedded toy, and what a change of their settings or a later revision reruns."""

import json

import pandas as pd
import pytest

from stagereplay.data.datasets import load_synthetic
from stagereplay.stages.divergence_onset import ONSET_SCHEMA
from stagereplay.stages.minimal_transplant import MINIMAL_TRANSPLANT_SCHEMA

from test_minimal_transplant import N_NEW
from test_transplant_workflow import jobs_planned
from toy_divergence import DEFAULT_BOUNDARY, toy_items
from workflow_runner import snakemake, tiny_config


def three_items(path, divergent, agreeing):
    """The questions of the default selection's items ``divergent`` and ``agreeing``, as a GSM8K-style file."""
    from stagereplay.data.datasets import choose_items

    chosen = choose_items(load_synthetic(5000, 0), 200, 0).set_index("item_index")
    with open(path, "w") as f:
        for index in (*divergent, agreeing):
            row = chosen.loc[index]
            f.write(json.dumps({"question": row["question"], "answer": f"#### {row['gold_answer']}"}) + "\n")


@pytest.mark.slow
def test_minimal_transplants_and_onset_in_the_workflow(tmp_path):
    divergent, agreeing = toy_items(N_NEW)  # which items split depends on the CPU (tests/toy_divergence.py)
    three_items(tmp_path / "items.jsonl", divergent, agreeing)
    tiny_config(tmp_path, n_items=3, max_new_tokens=N_NEW, precisions=["bf16"], dataset={"source": "jsonl", "path": "items.jsonl"},
                cache_differences={"n_items": 1, "precisions": ["bf16"]}, transplant={"sweeps": ["all"]},
                boundary=DEFAULT_BOUNDARY)  # toy_items' boundary
    snakemake(tmp_path, "--cores", "2")
    res = tmp_path / "results/tiny"

    minimal = pd.read_parquet(res / "primary/minimal_transplant.parquet")
    assert list(minimal.columns) == MINIMAL_TRANSPLANT_SCHEMA.names
    assert len(minimal) == 2 * len(divergent), "the workflow's prompt or settings differ from toy_items'"
    assert minimal["full_sufficient"].all() and (minimal["runs"] <= 24).all()
    onset = pd.read_parquet(res / "primary/divergence_onset.parquet")
    assert list(onset.columns) == ONSET_SCHEMA.names and onset["item_index"].nunique() == len(divergent)
    report = (res / "report/report.md").read_text()
    assert "### Minimal sufficient transplants (beyond the study)" in report and "not a global minimum" in report
    assert "### Where the caches of divergent items first differ (beyond the study)" in report
    stats = json.loads((res / "report/stats.json").read_text())["revisions"]["primary"]
    assert stats["minimal_transplant"]["budget"] == 24
    assert stats["divergence_onset"]["bf16"]["n"] == len(divergent)
    for name in ("fig7_minimal_transplant", "fig8_divergence_onset"):
        assert (res / f"report/figures/{name}.png").stat().st_size > 1000
        assert f"![{name}]" in report

    # the search's budget reruns the search (and the report) alone; a later revision runs only the transplant stages
    assert jobs_planned(tmp_path, "--config", "transplant={minimal: {budget: 8}}") == {
        "find_minimal_transplants", "gather_minimal_transplants", "plot_figures", "build_report", "all"}
    assert jobs_planned(tmp_path, "--config", "transplant={revisions: [primary, later]}") == {
        "prepare_model", "replay_fixed_prefixes", "gather_replay_baseline", "select_transplant_items", "dump_caches",
        "gather_caches", "transplant_caches", "gather_transplants", "find_minimal_transplants",
        "gather_minimal_transplants", "measure_divergence_onset", "gather_divergence_onset", "plot_figures",
        "build_report", "build_item_browser", "all"}
