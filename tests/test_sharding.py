"""Results do not depend on the shard count: 1 shard and 3 shards give byte-identical gathered files."""

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
