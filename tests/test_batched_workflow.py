"""End to end at batch_size 4 (decode_regime static, CPU): every stage that rebuilds a batched row rebuilds it in
its recorded batch; the audit reproduces every row; the batch-invariance control; replicas of one plan are
byte-identical; another plan seed records another plan."""

import json

import pandas as pd
import pytest

from stagereplay.io.parquet import read_provenance
from workflow_runner import snakemake, tiny_config

BATCHED = dict(n_items=6, max_new_tokens=8, precisions=["bf16", "fp32"], reference_precision="bf16",
               decode_regime="static", batch_size=4, decode_prefill_group=3, bridge={"n_rows": 3, "seed": 0},
               batch_invariance={"sample": 3, "seed": 0}, dump={"items": "all"},
               transplant={"select": "sample:3", "seed": 0, "sweeps": ["all", "k_only"],
                           "revisions": ["primary", "later"]})
LEDGER = "results/tiny/primary/ledger.parquet"


def ok_items(ledger, precision):
    live = ledger[(ledger["experiment"] == "matched") & (ledger["construction"] == "live")
                  & (ledger["precision"] == precision) & (ledger["replica"] == 1)]
    return set(live[live["status"] == "ok"]["item_index"])


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("batched_a")
    tiny_config(workdir, **BATCHED)
    proc = snakemake(workdir, "--cores", "2")
    return workdir, proc.stdout + proc.stderr


@pytest.mark.slow
def test_batched_run_end_to_end(run_a):
    run, _ = run_a
    res = run / "results/tiny/primary"
    ledger = pd.read_parquet(res / "ledger.parquet")
    plan = read_provenance(res / "ledger.parquet")["parts"][0]["batch_plan"]
    assert plan["batch_size"] == 4 and plan["seed"] == 0 and [len(b) for b in plan["batches"]] == [4, 2]
    # the first batch's prefills ran as rows 0-2, then row 3; every later stage rebuilt them so (the audit below)
    assert read_provenance(res / "ledger.parquet")["parts"][0]["decode_prefill_group"] == 3
    # every part of the ledger (matched and fixed-prefix, both precisions) records the one plan
    parts = read_provenance(res / "ledger.parquet")["parts"]
    assert {p["stage"] for p in parts} == {"reconstruct_prefixes", "generate_fixed_prefix"}
    assert all(p["batch_plan"] == plan for p in parts)
    place = {item: (j, r, len(b)) for j, b in enumerate(plan["batches"]) for r, item in enumerate(b)}
    for row in ledger.to_dict("records"):  # each row, of every experiment, in its item's place of the plan
        assert (row["batch_index"], row["batch_row"], row["batch_rows"]) == place[row["item_id"]]
    assert set(ledger["experiment"]) == {"matched", "fixed_prefix"}

    audit = pd.read_parquet(res / "audit.parquet")
    assert len(audit) == len(ledger) and audit["reproduced"].all()
    assert json.loads((res / "audit_check.json").read_text())["reproduced"] == len(ledger)

    bridge = pd.read_parquet(res / "bridge.parquet")
    assert len(bridge) == 3 * 2
    ok = bridge[bridge["status"] == "ok"]
    assert len(ok) and ok["bit_exact"].all() and ok["suffix_equal"].all()
    live = ledger[(ledger["experiment"] == "matched") & (ledger["construction"] == "live") & (ledger["replica"] == 1)]
    for row in ok.to_dict("records"):  # the bridge's live cache is the ledger's batched live row
        assert row["live_cache_fingerprint"] == live[(live["precision"] == row["precision"])
                                                     & (live["item_index"] == row["item_index"])][
            "cache_fingerprint"].item()

    table = pd.read_parquet(res / "batch_invariance.parquet")
    assert read_provenance(res / "batch_invariance.parquet")["parts"][0]["batch_invariance"]["status"] == "compared"
    assert table["item_index"].nunique() == 3 and set(table["precision"]) == {"bf16", "fp32"}
    matched = ledger[(ledger["experiment"] == "matched") & (ledger["replica"] == 1)].set_index(
        ["item_index", "precision", "construction"])
    for row in table.to_dict("records"):
        stored = matched.loc[(row["item_index"], row["precision"], row["construction"])]
        assert row["cache_fingerprint_batched"] == stored["cache_fingerprint"]
        assert (row["batch_index"], row["batch_row"], row["batch_rows"]) == place[row["item_id"]]
        both = row["cache_fingerprint_batched"] and row["cache_fingerprint_alone"]
        assert row["cache_equal"] == ((row["cache_fingerprint_batched"] == row["cache_fingerprint_alone"]) if both
                                      else None)
        assert row["suffix_equal"] == pd.isna(row["first_divergence"])
        assert row["label_equal"] == (row["correct_batched"] == row["correct_alone"])
    report = (run / "results/tiny/report/report.md").read_text()
    assert "### Batch invariance (beyond the study)" in report and "batch size 4, plan seed 0" in report
    assert "Batched run (batch size 4, plan seed 0): each live row is compared" in report
    # dumps and transplants rebuild each row in its batch: the rebuilt caches are the ledger's, byte for byte
    dumps = pd.read_parquet(res / "caches.parquet")
    assert len(dumps) == 2 * 2 * len(ok_items(ledger, "bf16"))  # precisions x constructions x items
    for row in dumps.to_dict("records"):
        stored = matched.loc[(row["item_index"], row["precision"], "prefill" if row["construction"] == "prefill"
                              else "live")]
        assert row["construction"] in ("live", "prefill") and row["live_fingerprint_match"]
        assert row["cache_fingerprint"] == stored["cache_fingerprint"]
    transplant = pd.read_parquet(res / "transplant.parquet")
    assert transplant["item_index"].nunique() == 3 and len(transplant) == 3 * 2 * 2  # items x directions x sweeps
    assert read_provenance(res / "transplant.parquet")["parts"][0]["batch_plan"] == plan
    for row in transplant.to_dict("records"):
        for side in ("donor", "recipient"):  # each side's cache is the ledger's batched row
            assert row[f"{side}_cache_fingerprint"] == matched.loc[(row["item_index"], "bf16", row[side])][
                "cache_fingerprint"]
        if row["component"] == "kv":  # all layers, all positions: the recipient now holds the donor's cache
            assert row["cache_fingerprint"] == row["donor_cache_fingerprint"]
            # and continues exactly as the donor did, in both directions: layout parity, batched as at batch 1
            assert row["outcome"] == "donor" and row["suffix_fingerprint"] == row["donor_suffix_fingerprint"]
    # every construction of an item was decoded in one layout (the live run's), recorded per row
    ok_rows = ledger[ledger["status"] == "ok"]
    layouts = ok_rows.groupby(["item_index", "precision", "experiment"])[["layout_pad", "layout_position"]].nunique()
    assert (layouts == 1).all().all()
    # a later revision replays the primary's prefixes in the primary's plan and transplants there
    later = pd.read_parquet(run / "results/tiny/later/transplant.parquet")
    assert read_provenance(run / "results/tiny/later/replay_baseline.parquet")["parts"][0]["batch_plan"] == plan
    kv = later[later["component"] == "kv"]
    assert len(kv) == 3 * 2 and (kv["outcome"] == "donor").all()
    assert "### Transplants" in report and "Not run" not in report
    stats = json.loads((run / "results/tiny/report/stats.json").read_text())["revisions"]["primary"]
    assert stats["batch_invariance"]["bf16"]["live"]["suffix_equal"]["n"] == 3


@pytest.mark.slow
def test_same_plan_gives_byte_identical_ledgers(run_a, tmp_path):
    tiny_config(tmp_path, **BATCHED)
    snakemake(tmp_path, "--cores", "1", LEDGER, "results/tiny/primary/bridge.parquet")
    for rel in (LEDGER, "results/tiny/primary/bridge.parquet"):
        assert (tmp_path / rel).read_bytes() == (run_a[0] / rel).read_bytes(), rel


@pytest.mark.slow
def test_another_plan_seed_records_another_plan(run_a, tmp_path):
    tiny_config(tmp_path, **{**BATCHED, "precisions": ["bf16"], "batch_seed": 1})
    part = "results/tiny/primary/parts/matched_bf16_0.parquet"
    snakemake(tmp_path, "--cores", "1", part)
    other = read_provenance(tmp_path / part)["batch_plan"]
    mine = read_provenance(run_a[0] / LEDGER)["parts"][0]["batch_plan"]
    assert other["seed"] == 1 and mine["seed"] == 0 and other["batches"] != mine["batches"]
    assert sorted(sum(other["batches"], [])) == sorted(sum(mine["batches"], []))  # same selection, another plan
    rows = pd.read_parquet(tmp_path / part)
    place = {item: (j, r) for j, b in enumerate(other["batches"]) for r, item in enumerate(b)}
    assert all((r["batch_index"], r["batch_row"]) == place[r["item_id"]] for r in rows.to_dict("records"))


@pytest.mark.slow
def test_batching_refuses_what_cannot_work(tmp_path):
    tiny_config(tmp_path, batch_size=2, decode_regime="eager")
    proc = snakemake(tmp_path, "--dry-run", check=False)
    assert proc.returncode != 0
    assert "set decode_regime: static (any device) or cuda_graph" in proc.stdout + proc.stderr
    tiny_config(tmp_path, decode_regime="eager", decode_prefill_group=2)
    proc = snakemake(tmp_path, "--dry-run", check=False)
    assert proc.returncode != 0
    assert "set decode_regime: static or cuda_graph, or leave them at their defaults" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_audit_of_a_batched_ledger_names_a_tampered_row(run_a, tmp_path):
    """Byte for byte, batch columns included: a row moved to another place of the plan does not reproduce."""
    from stagereplay.experiments.rows import LEDGER_SCHEMA
    from stagereplay.io.parquet import write_parquet
    from stagereplay.stages.controls import audit_ledger
    from stagereplay.stages.settings import ControlSettings
    from workflow_runner import REPO

    run = run_a[0]
    ledger = pd.read_parquet(run / LEDGER)
    moved = ledger.index[(ledger["experiment"] == "fixed_prefix") & (ledger["precision"] == "fp32")][0]
    ledger.at[moved, "batch_row"] = (ledger.at[moved, "batch_row"] + 1) % 4
    write_parquet(ledger, tmp_path / "ledger.parquet", read_provenance(run / LEDGER), LEDGER_SCHEMA)
    cfg = tiny_config(tmp_path / "cfg", **BATCHED)
    settings = ControlSettings(model=str(REPO / cfg["model"]), revision="primary", precision="fp32",
                               reference_precision="bf16", boundary=cfg["boundary"],
                               max_stage_tokens=cfg["max_stage_tokens"], max_new_tokens=cfg["max_new_tokens"],
                               device="cpu", attn_implementation=cfg["attn_implementation"], progress=False,
                               decode_regime="static", batch_size=4, decode_prefill_group=3)
    audit_ledger(str(run / "results/tiny/selection/items.parquet"), str(tmp_path / "ledger.parquet"),
                 str(tmp_path / "audit.parquet"), settings)
    audit = pd.read_parquet(tmp_path / "audit.parquet")
    assert len(audit) == int((ledger["precision"] == "fp32").sum())
    bad = audit[~audit["reproduced"]]
    # the row does not reproduce, and its layout is no longer its item's other constructions' (layout parity)
    assert len(bad) == 1 and list(bad["differed"].iloc[0]) == ["batch_row", "layout_parity"]
    assert bad["item_id"].iloc[0] == ledger.at[moved, "item_id"]
