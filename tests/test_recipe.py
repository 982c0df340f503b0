"""The recipe below the ledger: decode settings only, and the replica check the ledger and the library API share."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.greedy import RowResult
from stagereplay.decode.plans import Batch
from stagereplay.experiments.recipe import DecodeSettings, ReplicaMismatchError, replica_difference
from stagereplay.experiments.rows import RunSettings, replicated

from conftest import REPO

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]
STAGE = [5, 6, 14, 7, 3]


def test_the_recipe_and_the_api_import_nothing_of_the_ledger():
    code = ("import sys\nimport stagereplay.api\n"
            "ledger = [m for m in ('stagereplay.experiments.rows', 'stagereplay.data.answers') if m in sys.modules]\n"
            "assert not ledger, ledger\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {f.name for f in dataclasses.fields(DecodeSettings)} == {"max_stage_tokens", "max_new_tokens", "chunk_size"}
    assert RunSettings("r", "bf16", 4, 6, chunk_size=3).decode == DecodeSettings(4, 6, 3)


def test_replica_difference_names_the_first_ledger_column_that_differs():
    a = RowResult([3, 4], [5, 6], [1.0, 2.0], "eos", 0, 10, ("c", ["k0", "k1"], ["v0", "v1"]))
    assert replica_difference(a, dataclasses.replace(a)) is None
    assert replica_difference(a, dataclasses.replace(a, margins=[1.0, 3.0])) is None  # as the ledger: not compared
    assert replica_difference(a, dataclasses.replace(a, stage_ids=[], fingerprints=None)) == "status"
    assert replica_difference(a, dataclasses.replace(a, stage_ids=[3, 5])) == "stage_ids"
    assert replica_difference(a, dataclasses.replace(a, fingerprints=("d", ["k0", "kx"], ["v0", "v1"]))) == (
        "cache_fingerprint (K differs from layer 1)")
    assert replica_difference(a, dataclasses.replace(a, suffix_ids=[5])) == "suffix_ids"
    assert replica_difference(a, dataclasses.replace(a, position=11)) == "layout_position"


class _SecondBuildPerturbed(EagerDecoder):
    """An eager decoder whose second cache build writes one value into layer 1's K (a replica that is not exact)."""

    builds = 0

    def build(self, prompts, cached, segments):
        batch = super().build(prompts, cached, segments)
        type(self).builds += 1
        if type(self).builds == 2:
            with torch.inference_mode():
                self.row_layers(batch, 0, len(cached[0]))[1][0][..., 0] += 1
        return batch


def test_the_ledger_stops_on_replicas_that_are_not_bit_exact(loaded_fp32):
    decoder = _SecondBuildPerturbed(loaded_fp32.model)
    item = {"item_index": 0, "item_id": "x", "gold_answer": "1"}
    with pytest.raises(ReplicaMismatchError, match=r"item 'x': prefill replicas 1 and 2 at fp32 differ in "
                                                   r"cache_fingerprint \(K differs from layer 1\)"):
        replicated(decoder, "fixed_prefix", "prefill", Batch(None, (item,)), [PROMPT],
                   RunSettings("r", "fp32", None, 4), loaded_fp32.tokenizer, stages=[STAGE])
