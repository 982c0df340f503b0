"""Results do not depend on the shard count: 1, 2 and 3 shards give byte-identical gathered files."""

import hashlib

import pandas as pd
import pytest

from stagereplay.io.parquet import read_provenance
from workflow_runner import snakemake, tiny_config


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_one_shard_and_three_shards_give_byte_identical_ledgers(tmp_path):
    outputs = {}
    for shards in (1, 3):
        workdir = tmp_path / f"shards{shards}"
        # one precision: the shards split items, not precisions (each precision's jobs are sharded alike)
        tiny_config(workdir, shards=shards, n_items=5, max_new_tokens=6, max_stage_tokens=16,
                    precisions=["bf16"], reference_precision="bf16")
        snakemake(workdir, "--cores", "2", "results/tiny/primary/ledger.parquet")
        res = workdir / "results/tiny/primary"
        assert len(list((res / "parts").glob("matched_bf16_*.parquet"))) == shards
        outputs[shards] = res
    ledger = pd.read_parquet(outputs[3] / "ledger.parquet")
    assert sorted(ledger["item_index"].unique()) == list(range(5))  # every item, once per shard count
    for name in ("ledger.parquet", "prefixes.parquet"):
        assert sha256(outputs[1] / name) == sha256(outputs[3] / name), name
    # the shards really split the items: each part holds its own every-third item
    part = pd.read_parquet(outputs[3] / "parts/matched_bf16_1.parquet")
    assert sorted(part["item_index"].unique()) == [1, 4]
    assert read_provenance(outputs[3] / "parts/matched_bf16_1.parquet")["config"]["shard"] == 1


# The later model stages, each split by shard (every precision in one job) and gathered: their tables and the
# caches folder. At batch_size 2 a row's bits depend on its batch, so a shard that rebuilt a row outside its recorded
# batch would change bytes here.
LATER_TABLES = ["transplant", "minimal_transplant", "divergence_onset", "batch_invariance", "cache_differences",
                "caches", "fidelity"]
PART_NAMES = {"fidelity": "fidelity_bf16"}  # a stage that splits by precision too (SPLIT runs bf16 alone)
SPLIT = dict(n_items=6, batch_size=2, decode_regime="static", max_new_tokens=4, max_stage_tokens=16,
             precisions=["bf16"], reference_precision="bf16", dump={"items": "all"},
             transplant={"select": "sample:4", "sweeps": ["all"]}, cache_differences={"n_items": 4},
             batch_invariance={"sample": 4, "seed": 0})


def batches_of_part(path, plan) -> set[int]:
    """The plan's batches whose items a part's rows hold."""
    where = {item_id: j for j, batch in enumerate(plan["batches"]) for item_id in batch}
    return {where[i] for i in pd.read_parquet(path)["item_id"]}


@pytest.mark.slow
def test_every_model_stage_splits_by_whole_batches_with_the_same_bytes(tmp_path):
    results = {}
    for shards in (1, 2, 3):
        workdir = tmp_path / f"shards{shards}"
        tiny_config(workdir, shards=shards, **SPLIT)
        snakemake(workdir, "--cores", "2")
        results[shards] = workdir / "results/tiny/primary"
    plan = read_provenance(results[1] / "parts/matched_bf16_0.parquet")["batch_plan"]
    assert [len(b) for b in plan["batches"]] == [2, 2, 2]
    for name in LATER_TABLES:
        one = sha256(results[1] / f"{name}.parquet")
        if name not in ("minimal_transplant", "divergence_onset"):  # rows of divergent items only: none here
            assert len(pd.read_parquet(results[1] / f"{name}.parquet")) > 0, name  # a comparison of something
        for shards in (2, 3):
            assert sha256(results[shards] / f"{name}.parquet") == one, (name, shards)
    dumps = {shards: {f.name: sha256(f) for f in (res / "caches").iterdir() if f.name != ".snakemake_timestamp"}
             for shards, res in results.items()}
    assert len(dumps[1]) == 12 and dumps[2] == dumps[1] and dumps[3] == dumps[1]  # 6 items x 2 constructions
    # the parts really split: shard k holds the rows of the plan's batches k, k + n, ... and no other
    for shards in (2, 3):
        for name in LATER_TABLES:
            held = set()
            for k in range(shards):
                part = results[shards] / f"parts/{PART_NAMES.get(name, name)}_{k}.parquet"
                assert read_provenance(part)["config"]["shard"] == k
                mine = batches_of_part(part, plan)
                assert all(j % shards == k for j in mine), (name, shards, k, mine)
                held |= mine
            assert held == batches_of_part(results[1] / f"{name}.parquet", plan), (name, shards)
        sizes = [len(list((results[shards] / f"parts/caches_{k}").glob("*.safetensors"))) for k in range(shards)]
        assert sizes == {2: [8, 4], 3: [4, 4, 4]}[shards], sizes  # batches 0 and 2 on shard 0 of 2
