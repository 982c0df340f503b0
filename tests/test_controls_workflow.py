"""End to end on a tiny config: the 2x2, the bridge and the audit; a tampered ledger fails the pipeline and names
the rows; two runs (--cores 1 and --cores 2) write byte-identical ledgers."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from stagereplay.experiments.rows import LEDGER_SCHEMA
from stagereplay.io.parquet import read_provenance, write_parquet
from workflow_runner import SHARED_TINY as TINY
from workflow_runner import snakemake, tiny_config


@pytest.fixture(scope="module")
def run_a(shared_tiny_run):
    """The whole workflow on TINY (four items, both precisions, a three-row bridge), run once for this file and
    tests/test_transplant_workflow.py; read only (a test that changes it works on a copy)."""
    return shared_tiny_run


@pytest.mark.slow
def test_controls_end_to_end(run_a):
    res = run_a / "results/tiny/primary"
    ledger = pd.read_parquet(res / "ledger.parquet")
    ok_items = set(ledger[(ledger["experiment"] == "matched") & (ledger["precision"] == "bf16")
                          & (ledger["stage_ids"].map(len) > 0)]["item_index"])
    fixed = ledger[ledger["experiment"] == "fixed_prefix"]
    assert len(fixed) == 2 * 4 * len(ok_items)  # precisions x (constructions x replicas) x items with a prefix
    reference = ledger[(ledger["experiment"] == "matched") & (ledger["construction"] == "live")
                       & (ledger["precision"] == "bf16")].set_index(["item_index", "replica"])
    for row in fixed.to_dict("records"):
        assert list(row["stage_ids"]) == list(reference.loc[(row["item_index"], 1), "stage_ids"])
    provs = {(p["stage"], p["dtype"]) for p in read_provenance(res / "ledger.parquet")["parts"]}
    assert provs == {(s, d) for s in ("reconstruct_prefixes", "generate_fixed_prefix")
                     for d in ("bfloat16", "float32")}

    bridge = pd.read_parquet(res / "bridge.parquet")
    assert len(bridge) == 3 * 2 and set(bridge["precision"]) == {"bf16", "fp32"}
    ok = bridge[bridge["status"] == "ok"]
    assert ok["bit_exact"].all() and ok["suffix_equal"].all()
    assert (ok["live_cache_fingerprint"] == ok["incremental_cache_fingerprint"]).all()
    # the bridge's live fingerprint is the ledger's live replica-1 cache fingerprint
    for row in ok.to_dict("records"):
        assert row["live_cache_fingerprint"] == ledger[
            (ledger["experiment"] == "matched") & (ledger["construction"] == "live") & (ledger["replica"] == 1)
            & (ledger["precision"] == row["precision"]) & (ledger["item_index"] == row["item_index"])
        ]["cache_fingerprint"].item()

    audit = pd.read_parquet(res / "audit.parquet")
    assert len(audit) == len(ledger) and audit["reproduced"].all()
    assert json.loads((res / "audit_check.json").read_text())["reproduced"] == len(ledger)
    report = (run_a / "results/tiny/report/report.md").read_text()
    assert f"| ledger rows reproduced (trajectories and fingerprints) | — (not counted in rows) | {len(ledger)} / {len(ledger)} |" in report
    n_items = ledger["item_index"].nunique()
    line = next(x for x in report.splitlines() if x.startswith("| retained trajectories reproduced (bf16"))
    assert line.endswith(f"| {n_items} / {n_items} |")  # this run's count, beside the study's
    assert "Fixed-prefix 2x2" in report and "same chunks" in report
    stats = json.loads((run_a / "results/tiny/report/stats.json").read_text())["revisions"]["primary"]
    assert set(stats["fixed_prefix"]) == {"bf16", "fp32"} and stats["audit"]["reproduced"]["k"] == len(ledger)


@pytest.mark.slow
def test_ledger_is_byte_identical_across_core_counts(run_a, tmp_path):
    tiny_config(tmp_path, **TINY)
    snakemake(tmp_path, "--cores", "1", "results/tiny/primary/ledger.parquet")
    rel = "results/tiny/primary/ledger.parquet"
    assert (tmp_path / rel).read_bytes() == (run_a / rel).read_bytes()


@pytest.mark.slow
def test_corrupted_ledger_fails_the_pipeline_and_names_the_rows(run_a, tmp_path):
    """Tampers with a copy of run_a, so that no other test depends on running before it."""
    run_a = Path(shutil.copytree(run_a, tmp_path / "run", symlinks=True))
    path = run_a / "results/tiny/primary/ledger.parquet"
    ledger = pd.read_parquet(path)
    prov = read_provenance(path)
    flip = ledger.index[(ledger["experiment"] == "fixed_prefix") & (ledger["precision"] == "fp32")
                        & (ledger["construction"] == "prefill") & (ledger["replica"] == 2)][0]
    suffix = list(ledger.at[flip, "suffix_ids"])
    suffix[1] = (suffix[1] + 1) % 21  # a flipped token; the stored fingerprint is left as it was
    ledger.at[flip, "suffix_ids"] = suffix
    wrong = ledger.index[(ledger["experiment"] == "matched") & (ledger["precision"] == "bf16")
                         & (ledger["construction"] == "live") & (ledger["replica"] == 2)][-1]
    ledger.at[wrong, "cache_fingerprint"] = "f" * 64
    write_parquet(ledger, path, prov, LEDGER_SCHEMA)

    proc = snakemake(run_a, "--cores", "2", check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "AUDIT FAILED" in out and "2 ledger row(s) did not reproduce" in out
    for index in (flip, wrong):
        row = ledger.loc[index]
        assert (f"item {row['item_id']!r} (item_index {row['item_index']}), primary "
                f"{row['experiment']}/{row['precision']}/{row['construction']} replica {row['replica']}") in out
    assert "suffix_ids differ at index 1" in out and "cache_fingerprint" in out
    # the findings stay on disk; the flag file of a passing audit does not
    audit = pd.read_parquet(run_a / "results/tiny/primary/audit.parquet")
    assert (~audit["reproduced"]).sum() == 2
    assert not (run_a / "results/tiny/primary/audit_check.json").exists()


@pytest.mark.slow
def test_reference_precision_must_be_a_run_precision(tmp_path):
    tiny_config(tmp_path, precisions=["bf16"], reference_precision="fp32")
    proc = snakemake(tmp_path, "--dry-run", check=False)
    assert proc.returncode != 0
    assert "reference_precision: 'fp32' is not one of precisions ['bf16']" in proc.stdout + proc.stderr
