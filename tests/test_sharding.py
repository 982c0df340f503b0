"""Results do not depend on the shard count: 1, 2 and 3 shards give byte-identical gathered files, every model stage
split by shard, and a gather that misses a part is caught by the same comparison."""

import hashlib
import json
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from stagereplay.data.datasets import choose_items, load_synthetic
from stagereplay.io.parquet import read_provenance
from stagereplay.stages.gather import gather_caches, gather_ledger, gather_transplants
from toy_divergence import DEFAULT_BOUNDARY, toy_items
from workflow_runner import REPO, snakemake, tiny_config

SHARDS = (1, 2, 3)
# Not compared: the parts (what differs by shard), the report (it renders the tables compared here), the run's
# records of its model store entries (not results of a stage).
NOT_RESULTS = ("parts", "report", "models")


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def results_bytes(results) -> dict:
    """{path: sha256} of every results file of a run but its parts, report and model records: the gathered tables,
    the selections, the dumps and their manifests, the audit's check."""
    return {str(p.relative_to(results)): sha256(p) for p in sorted(results.rglob("*"))
            if p.is_file() and not p.name.startswith(".")  # .snakemake_timestamp, the hash caches (inodes)
            and not set(p.relative_to(results).parts) & set(NOT_RESULTS)}


def runs(tmp_path, **config) -> dict:
    """The whole workflow at each shard count of SHARDS: {shards: results/tiny}."""
    out = {}
    for shards in SHARDS:
        workdir = tmp_path / f"shards{shards}"
        if (tmp_path / "items.jsonl").exists():
            workdir.mkdir(parents=True, exist_ok=True)
            shutil.copy(tmp_path / "items.jsonl", workdir / "items.jsonl")
        tiny_config(workdir, shards=shards, **config)
        snakemake(workdir, "--cores", "2")
        out[shards] = workdir / "results/tiny"
    return out


def assert_same_bytes(results: dict) -> dict:
    """Every results file of every shard count byte-identical to the one-shard run's; returns those."""
    one = results_bytes(results[1])
    for shards in SHARDS[1:]:
        other = results_bytes(results[shards])
        assert sorted(other) == sorted(one), (shards, sorted(set(other) ^ set(one)))
        differ = sorted(path for path in one if other[path] != one[path])
        assert not differ, (shards, differ)
    return one


def items_file(path, indexes):
    """The default selection's items ``indexes`` (of the default config's dataset), in this order, as a JSONL
    dataset: its item_index is the line."""
    chosen = choose_items(load_synthetic(5000, 0), 200, 0).set_index("item_index")
    with open(path, "w") as f:
        for index in indexes:
            row = chosen.loc[index]
            f.write(json.dumps({"question": row["question"], "answer": f"#### {row['gold_answer']}"}) + "\n")


# At batch_size 1 (eager, the default regime) the toy's bf16 live and prefill rows split on some items
# (tests/toy_divergence.py), so the minimal search and the onset have rows; the shards split items (every N-th).
# The static regime of the batched run below splits no item on the CPU (none of the default selection's first 44
# at 48 new tokens, 2026-12-02), so its minimal-search and onset tables are empty there.
N_NEW = 8


@pytest.mark.slow
def test_every_table_of_a_divergent_run_is_the_same_at_one_two_and_three_shards(tmp_path):
    divergent, agreeing = toy_items(N_NEW, want=3)
    # items 0 and 3 on shard 0 of 3 (two items in one part), the agreeing item alone on shard 2 (a part of the
    # minimal search and of the onset with no rows)
    items_file(tmp_path / "items.jsonl", [divergent[0], divergent[1], agreeing, divergent[2]])
    results = runs(tmp_path, n_items=4, max_new_tokens=N_NEW, precisions=["bf16"], reference_precision="bf16",
                   dataset={"source": "jsonl", "path": "items.jsonl"}, boundary=DEFAULT_BOUNDARY,
                   bridge={"n_rows": 2, "seed": 0}, cache_differences={"n_items": 2, "precisions": ["bf16"]},
                   transplant={"select": "divergent", "sweeps": ["all"], "minimal": {"budget": 4}})
    same = assert_same_bytes(results)
    res = results[1] / "primary"
    for name in ("ledger", "transplant", "minimal_transplant", "divergence_onset", "cache_differences", "caches",
                 "audit", "bridge"):
        assert f"primary/{name}.parquet" in same
        assert len(pd.read_parquet(res / f"{name}.parquet")) > 0, name  # a comparison of something
    minimal = pd.read_parquet(res / "minimal_transplant.parquet")
    assert sorted(minimal["item_index"].unique()) == [0, 1, 3]  # the divergent items, both directions each
    assert len(minimal) == 2 * 3
    assert pd.read_parquet(res / "divergence_onset.parquet")["item_index"].nunique() == 3
    assert len([p for p in same if p.startswith("primary/caches/")]) == 2 * 3  # both caches of each divergent item
    # the parts really split: at batch 1 shard k of n holds the items k, k + n, ...
    for shards in SHARDS[1:]:
        assert len(list((results[shards] / "primary/parts").glob("matched_bf16_*.parquet"))) == shards
        for name in ("matched_bf16", "minimal_transplant", "divergence_onset", "transplant"):
            for k in range(shards):
                part = pd.read_parquet(results[shards] / f"primary/parts/{name}_{k}.parquet")
                assert all(i % shards == k for i in part["item_index"]), (name, shards, k)
    assert pd.read_parquet(results[3] / "primary/parts/minimal_transplant_2.parquet").empty


# The later model stages at batch_size 2, each split by shard (every precision in one job) and gathered, and a later
# revision's replayed baseline and transplants: a row's bits depend on its batch, so a shard that rebuilt a row
# outside its recorded batch would change bytes here.
LATER_TABLES = ["transplant", "minimal_transplant", "divergence_onset", "batch_invariance", "cache_differences",
                "caches", "fidelity"]
PART_NAMES = {"fidelity": "fidelity_bf16"}  # a stage that splits by precision too (SPLIT runs bf16 alone)
SPLIT = dict(n_items=6, batch_size=2, decode_regime="static", max_new_tokens=4, max_stage_tokens=16,
             precisions=["bf16"], reference_precision="bf16", dump={"items": "all"},
             transplant={"select": "sample:4", "sweeps": ["all"], "revisions": ["primary", "later"]},
             cache_differences={"n_items": 4}, batch_invariance={"sample": 4, "seed": 0})
# a later revision's tables, each of its own model stage and gather
LATER_REVISION = ["replay_baseline", "transplant", "caches"]


def batches_of_part(path, plan) -> set[int]:
    """The plan's batches whose items a part's rows hold."""
    where = {item_id: j for j, batch in enumerate(plan["batches"]) for item_id in batch}
    return {where[i] for i in pd.read_parquet(path)["item_id"]}


def compare_tables(old, new) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts/compare_tables.py"), str(old), str(new)],
                          capture_output=True, text=True)


@pytest.mark.slow
def test_every_model_stage_splits_by_whole_batches_with_the_same_bytes(tmp_path):
    results = runs(tmp_path, **SPLIT)
    same = assert_same_bytes(results)
    plan = read_provenance(results[1] / "primary/parts/matched_bf16_0.parquet")["batch_plan"]
    assert [len(b) for b in plan["batches"]] == [2, 2, 2]
    for revision, names in (("primary", LATER_TABLES), ("later", LATER_REVISION)):
        for name in names:
            assert f"{revision}/{name}.parquet" in same, (revision, name)
            if name not in ("minimal_transplant", "divergence_onset"):  # divergent items only: none in this regime
                assert len(pd.read_parquet(results[1] / f"{revision}/{name}.parquet")) > 0, (revision, name)
    for revision in ("primary", "later"):  # 6 items x 2 constructions
        assert len([p for p in same if p.startswith(f"{revision}/caches/")]) == 12
    assert compare_tables(results[1], results[3]).returncode == 0
    # the parts really split: shard k holds the rows of the plan's batches k, k + n, ... and no other
    for shards in SHARDS[1:]:
        for revision, names in (("primary", LATER_TABLES), ("later", LATER_REVISION)):
            res = results[shards] / revision
            for name in names:
                held = set()
                for k in range(shards):
                    part = res / f"parts/{PART_NAMES.get(name, name)}_{k}.parquet"
                    assert read_provenance(part)["config"]["shard"] == k
                    mine = batches_of_part(part, plan)
                    assert all(j % shards == k for j in mine), (revision, name, shards, k, mine)
                    held |= mine
                assert held == batches_of_part(results[1] / f"{revision}/{name}.parquet", plan), (name, shards)
        sizes = [len(list((results[shards] / f"primary/parts/caches_{k}").glob("*.safetensors")))
                 for k in range(shards)]
        assert sizes == {2: [8, 4], 3: [4, 4, 4]}[shards], sizes  # batches 0 and 2 on shard 0 of 2

    # The negative control: the same comparison catches a gather that misses a part or takes one twice, and the
    # parts' order does not matter (a gather puts the rows in one job's order whatever order they come in).
    parts = results[3] / "primary/parts"
    out = tmp_path / "control"
    (out / "reordered/primary").mkdir(parents=True)
    (out / "missing/primary").mkdir(parents=True)
    transplant = [str(parts / f"transplant_{k}.parquet") for k in range(3)]
    gather_transplants(transplant[::-1], str(out / "reordered/primary/transplant.parquet"))
    assert sha256(out / "reordered/primary/transplant.parquet") == same["primary/transplant.parquet"]
    gather_transplants(transplant[:2], str(out / "missing/primary/transplant.parquet"))
    assert sha256(out / "missing/primary/transplant.parquet") != same["primary/transplant.parquet"]
    shutil.copy(results[1] / "primary/transplant.parquet", out / "reordered/primary/transplant.parquet")
    differs = compare_tables(out / "reordered", out / "missing")
    assert differs.returncode == 1 and "primary/transplant.parquet: DIFFERS" in differs.stdout, differs.stdout
    later = results[3] / "later/parts"
    gather_ledger([str(later / f"replay_baseline_{k}.parquet") for k in (0, 1, 1)], str(out / "twice.parquet"))
    assert sha256(out / "twice.parquet") != same["later/replay_baseline.parquet"]
    with pytest.raises(FileExistsError, match="the parts overlap"):
        gather_caches([str(parts / "caches_0.parquet")] * 2, [str(parts / "caches_0")] * 2, str(out / "caches"),
                      str(out / "caches.parquet"))
