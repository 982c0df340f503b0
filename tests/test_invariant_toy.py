"""End to end on the shipped toy model: bf16 live-vs-prefill disagreements under the default regime vanish under
the invariant one.

The items are three of the default config's selection (200 items of the synthetic set, seed 0, boundary at the
second ';') whose bf16 live and prefill suffixes disagree in the default regime (sdpa, one CPU thread) on the
machine the test runs on (:func:`toy_divergence.toy_items`: kernel choices differ between CPUs).
"""

from pathlib import Path

import pytest

from stagereplay.analysis.tables import pair_table
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.stages.reconstruct import reconstruct_prefixes
from stagereplay.stages.select import select_items
from stagereplay.stages.settings import ReconstructSettings

from toy_divergence import DEFAULT_BOUNDARY, toy_items

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def selection(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy_invariant")
    items = select_items({"source": "synthetic", "size": 5000, "seed": 0}, 200, 0,
                                str(folder / "selection.parquet"))
    return folder, items


def run_matched(selection, indexes: list[int], numerics: str):
    folder, items = selection
    chosen = folder / "items.parquet"
    write_parquet(items[items["item_index"].isin(indexes)], chosen, {"stage": "test"})
    ledger = folder / f"ledger_{numerics}.parquet"
    reconstruct_prefixes(
        str(chosen), str(ledger), str(folder / f"prefixes_{numerics}.parquet"), str(folder / f"bridge_{numerics}.parquet"),
        ReconstructSettings(model=str(REPO / "data/toy"), revision="primary", precision="bf16",
                            boundary=DEFAULT_BOUNDARY, max_stage_tokens=32,
                            max_new_tokens=48, device="cpu", attn_implementation="sdpa", stage_end="</think>",
                            numerics=numerics, progress=False, bridge={"n_rows": 0, "seed": 0}))
    return read_parquet(ledger), read_provenance(ledger)


def test_invariant_regime_removes_the_bf16_divergence(selection):
    indexes = list(toy_items(48, want=3)[0])
    default, default_prov = run_matched(selection, indexes, "default")
    compared = pair_table(default, "matched", "live", "prefill")
    assert len(compared) == len(indexes)
    assert compared["disagree"].sum() >= 1, "the default regime shows no disagreement: the control has no power"
    assert set(default["numerics"]) == {"default"}
    assert default_prov["numerics_regime"] == {"numerics": "default"}

    exact, prov = run_matched(selection, indexes, "invariant")
    compared = pair_table(exact, "matched", "live", "prefill")
    assert len(compared) == len(indexes)
    assert compared["disagree"].sum() == 0, compared[compared["disagree"]]
    rows = exact[exact["replica"] == 1].set_index(["item_index", "construction"])
    for item in indexes:
        assert rows.loc[(item, "live"), "cache_fingerprint"] == rows.loc[(item, "prefill"), "cache_fingerprint"]
        assert rows.loc[(item, "live"), "suffix_fingerprint"] == rows.loc[(item, "prefill"), "suffix_fingerprint"]
    assert set(exact["numerics"]) == {"invariant"}
    assert prov["numerics_regime"]["numerics"] == "invariant" and prov["config"]["numerics"] == "invariant"
    assert set(exact["status"]) == {"ok"}
