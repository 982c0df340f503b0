"""Per-layer cache differences: byte-level verdicts, magnitudes and the seeded measurement on a tiny model."""

import copy

import pandas as pd
import pytest

from stagereplay.models import compat
from stagereplay.cache_differences import layer_differences, measure_cache_differences, sample_items
from stagereplay.engine import Decoder, build_cache
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.stages import PREFIX_SCHEMA

PROMPT, STAGE = [5, 9, 12, 7, 3, 20, 14], [8, 15, 4, 19, 11, 6]  # ids within the toy vocabulary (21)


def test_a_cache_against_itself_is_bit_identical(loaded_fp32):
    decoder = Decoder(loaded_fp32.model)
    cache = build_cache(decoder, "prefill", PROMPT, STAGE)
    rows = layer_differences(cache, copy.deepcopy(cache))
    assert len(rows) == 2 * loaded_fp32.model.config.num_hidden_layers
    assert all(r["bit_equal"] and r["max_abs"] == 0.0 and r["first_position_differs"] is None for r in rows)
    assert {r["n_positions"] for r in rows} == {len(PROMPT) + len(STAGE) - 1}


def test_a_perturbed_position_is_found_at_its_layer_component_and_position(loaded_fp32):
    decoder = Decoder(loaded_fp32.model)
    cache = build_cache(decoder, "prefill", PROMPT, STAGE)
    other = copy.deepcopy(cache)
    values = compat.cache_layers(other)[1][1].clone()  # (batch, kv_heads, seq, head_dim)
    values[0, 1, 4, 2] += 0.25
    compat.set_cache_layer(other, 1, values=values)
    rows = {(r["layer"], r["component"]): r for r in layer_differences(cache, other)}
    changed = rows.pop((1, "v"))
    assert not changed["bit_equal"] and changed["first_position_differs"] == 4
    assert changed["max_abs"] == pytest.approx(0.25, rel=1e-6)
    assert changed["rms"] == pytest.approx(changed["max_abs"] / values.numel() ** 0.5, rel=1e-9)
    assert all(r["bit_equal"] for r in rows.values())


def test_signed_zeros_differ_in_bytes_though_not_in_value(loaded_bf16):
    decoder = Decoder(loaded_bf16.model)
    cache = build_cache(decoder, "prefill", PROMPT, STAGE)
    a, b = copy.deepcopy(cache), copy.deepcopy(cache)
    keys = compat.cache_layers(a)[0][0].clone()
    keys[0, 0, 2, 0] = 0.0
    compat.set_cache_layer(a, 0, keys=keys)
    keys[0, 0, 2, 0] = -0.0
    compat.set_cache_layer(b, 0, keys=keys)
    row = layer_differences(a, b)[0]
    assert (row["layer"], row["component"]) == (0, "k")
    assert not row["bit_equal"] and row["max_abs"] == 0.0 and row["first_position_differs"] == 2


def test_sample_is_seeded_and_skips_items_without_a_boundary():
    prefixes = pd.DataFrame({"item_index": range(10), "status": ["ok"] * 9 + ["boundary_missing"]})
    first = sample_items(prefixes, 4, seed=1)
    assert first["item_index"].tolist() == sample_items(prefixes, 4, seed=1)["item_index"].tolist()
    assert len(first) == 4 and 9 not in first["item_index"].tolist()
    assert first["item_index"].is_monotonic_increasing
    assert sample_items(prefixes, 50, seed=1)["item_index"].tolist() == list(range(9))


def test_measure_cache_differences_on_a_tiny_model(tiny_model_dir, tmp_path):
    rows = [{"item_index": i, "item_id": f"item-{i}", "revision": "model", "precision": "bf16",
             "status": "ok" if i != 2 else "boundary_missing", "prompt_ids": PROMPT[: 4 + i],
             "stage_ids": STAGE if i != 2 else [], "prefix_fingerprint": "", "gold_answer": "1"} for i in range(4)]
    prefixes = tmp_path / "prefixes.parquet"
    write_parquet(pd.DataFrame(rows), prefixes, {"stage": "test"}, PREFIX_SCHEMA)
    out = tmp_path / "cache_differences.parquet"
    measure_cache_differences(str(prefixes), str(out), model=str(tiny_model_dir.parent), revision="model",
                              revision_slug="model", precisions=["bf16", "fp32"], n_items=2, seed=0,
                              device="cpu")
    df = read_parquet(out)
    layers = 3  # conftest's tiny model
    assert len(df) == 2 * 2 * layers * 2  # precisions x items x layers x (K, V)
    assert set(df["precision"]) == {"bf16", "fp32"} and 2 not in set(df["item_index"])
    assert (df["n_positions"] == df["prompt_length"] + len(STAGE) - 1).all()
    assert (df.loc[df["bit_equal"], "max_abs"] == 0).all()
    prov = read_provenance(out)
    assert prov["config"]["prefix_precision"] == "bf16" and len(prov["items"]) == 2
    with pytest.raises(ValueError, match="prefix_precision 'fp32'"):
        measure_cache_differences(str(prefixes), str(out), model=str(tiny_model_dir.parent), revision="model",
                                  revision_slug="model", precisions=["fp32"], device="cpu")
