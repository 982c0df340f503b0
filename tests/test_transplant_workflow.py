"""End to end: the dump and transplant stages in the workflow, rerun triggers, and the later-revision command."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from stagereplay.io import cache_dumps
from stagereplay.io.parquet import read_provenance, write_text_atomic
from stagereplay.stages.integrity import verify_results
from stagereplay.stages.transplant import TRANSPLANT_SCHEMA

from workflow_runner import snakemake

# The documented command that runs the transplant stage at the later revision (README, "Transplants").
LATER = ["--config", "transplant={revisions: [primary, later]}"]


def snapshot(root):
    """Bytes and mtime of every file under ``root``."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def jobs_planned(workdir, *args, configfile=None):
    """Rule names a dry run would execute."""
    out = snakemake(workdir, "-n", "--cores", "1", *args, configfile=configfile).stdout
    table = out.split("Job stats:", 1)[1].split("\n\n", 1)[0] if "Job stats:" in out else ""
    rows = [line.split() for line in table.splitlines() if line.strip()]
    return {row[0] for row in rows if len(row) == 2 and row[1].isdigit() and row[0] != "total"}


@pytest.mark.slow
def test_transplant_stage_reruns_alone_and_at_a_later_revision(shared_tiny_run, tmp_path):
    # The whole workflow at four items, transplants of two sampled items in (all, k_only), every item's caches
    # dumped (workflow_runner.SHARED_TINY, run once for this file and test_controls_workflow.py): a copy, rerun here.
    run = shutil.copytree(shared_tiny_run, tmp_path / "run", symlinks=True)
    # a copy's files lie in other inodes: their hash records refreshed, as the copy's first run would, so the run
    # at the later revision below starts from the state the original run left
    verify_results(run / "results/tiny")
    res = run / "results/tiny"

    df = pd.read_parquet(res / "primary/transplant.parquet")
    assert list(df.columns) == TRANSPLANT_SCHEMA.names
    # 2 items x 2 directions x (all, k_only)
    assert len(df) == 8 and set(df["layer_set"]) == {"all"} and set(df["component"]) == {"kv", "k"}
    assert set(df["direction"]) == {"live->prefill", "prefill->live"}  # rebuilt caches equal the ledger's live ones
    assert df["live_fingerprint_match"].all()
    whole = df[df["component"] == "kv"]
    assert (whole["outcome"] == "donor").all() and (whole["cache_fingerprint"] == whole["donor_cache_fingerprint"]).all()
    selection = pd.read_parquet(res / "primary/transplant_selection.parquet")
    assert len(selection) == 2 and set(selection["item_index"]) == set(df["item_index"])
    assert read_provenance(res / "primary/transplant_selection.parquet")["selection"]["rule"] == "sample:2"
    manifest = pd.read_parquet(res / "primary/caches.parquet")
    # one file per item x precision x construction (two constructions)
    assert manifest["bytes"].sum() > 0 and len(manifest) == 2 * len(manifest[["item_index", "precision"]].drop_duplicates())
    ledger = pd.read_parquet(res / "primary/ledger.parquet")
    live = ledger[(ledger["construction"] == "live") & (ledger["replica"] == 1)].set_index(["item_index", "precision"])
    for row in manifest.itertuples():
        dump = cache_dumps.load_cache(res / "primary/caches" / row.path)  # every layer's bytes checked on load
        assert dump.meta["cache_fingerprint"] == row.cache_fingerprint
        if row.construction == "live":  # the dumped cache is the ledger's live cache, byte for byte
            assert row.cache_fingerprint == live.loc[(row.item_index, row.precision), "cache_fingerprint"]
    report = (res / "report/report.md").read_text()
    assert "### Transplants" in report and "24 / 24" in report

    # a changed transplant setting reruns transplants (and the report and figures) only, never generation
    assert jobs_planned(run, "--config", "transplant={sweeps: [all, v_only]}") == {
        "transplant_caches", "gather_transplants", "plot_figures", "build_report", "build_item_browser", "all"}
    assert jobs_planned(run, "--config", "transplant={select: 'sample:3'}") == {
        "select_transplant_items", "transplant_caches", "gather_transplants", "find_minimal_transplants",
        "gather_minimal_transplants", "plot_figures", "build_report", "build_item_browser", "all"}
    assert jobs_planned(run, "--config", "dump={items: none}") == {"dump_caches", "gather_caches", "all"}
    # the same config with the keys of dataset: and boundary: in another order reruns nothing (params are compared
    # by their repr), nor does another chunk_size where no construction is chunked
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert list(config["dataset"]) == sorted(config["dataset"])  # as the run was made
    reordered = dict(config, dataset=dict(reversed(config["dataset"].items())),
                     boundary=dict(reversed(config["boundary"].items())))
    (run / "reordered.yaml").write_text(yaml.safe_dump(reordered, sort_keys=False))
    assert jobs_planned(run, configfile=run / "reordered.yaml") == set()
    # another chunk_size reruns the one stage with a chunked construction (fidelity's, in the default config) and what
    # reads it, nothing else
    chunked = jobs_planned(run, "--config", "chunk_size=5")
    assert {"measure_fidelity", "gather_fidelity"} <= chunked <= {
        "measure_fidelity", "gather_fidelity", "plot_figures", "build_report", "build_item_browser", "all"}, chunked

    # the later revision: its own constructions of the primary's prefixes; nothing already done is touched
    before = snapshot(res)
    snakemake(run, "--cores", "2", *LATER)
    after = snapshot(res)
    for path, state in before.items():
        if not path.startswith("report/"):
            assert after[path] == state, f"{path} changed"
    later = pd.read_parquet(res / "later/transplant.parquet")
    assert set(later["revision"]) == {"later"} and set(later["direction"]) == {"incremental->prefill",
                                                                              "prefill->incremental"}
    assert later["live_fingerprint_match"].isna().all()
    baseline = pd.read_parquet(res / "later/replay_baseline.parquet")
    prefixes = pd.read_parquet(res / "primary/prefixes.parquet")
    ok = prefixes[(prefixes["status"] == "ok") & (prefixes["precision"] == "bf16")]  # the transplant precision
    assert sorted(baseline["prefix_fingerprint"].unique()) == sorted(ok["prefix_fingerprint"])
    report = (res / "report/report.md").read_text()
    assert "## Revision `later`" in report and "### Transplants" in report.split("## Revision `later`")[1]
    assert not (res / "later/ledger.parquet").exists()  # no generation at the later revision

    # a store entry gone (removed to free disk, or damaged): the check says so before any job, and a transplant-only
    # edit plans the transplants alone, never prepare_model or the generation (the run prepares the entry again
    # before its first job, byte for byte the recorded snapshot: tests/test_model_store.py). The run's records point at a store
    # of their own here, so that the shared one keeps its entries.
    store = tmp_path / "store"
    record_path = res / "models/primary.json"
    record = json.loads(record_path.read_text())
    for snapshot_record in record["snapshots"].values():
        shutil.copytree(Path(record["store"]) / snapshot_record["key"], store / snapshot_record["key"], symlinks=True)
    mtime = record_path.stat().st_mtime_ns
    write_text_atomic(record_path, json.dumps(dict(record, store=str(store)), indent=1, sort_keys=True) + "\n")
    os.utime(record_path, ns=(mtime, mtime))  # the record as it was written, in another store
    shutil.rmtree(store / record["snapshots"]["bf16"]["key"])
    sweeps = ["--config", "transplant={sweeps: [all, v_only]}"]
    dry = snakemake(run, "-n", "--cores", "1", *sweeps)
    out = dry.stdout + dry.stderr
    assert "the bf16 snapshot of" in out and "is gone in the model store" in out, out[-3000:]
    assert jobs_planned(run, *sweeps) == {"transplant_caches", "gather_transplants", "plot_figures", "build_report",
                                          "build_item_browser", "all"}
