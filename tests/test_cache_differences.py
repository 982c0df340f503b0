"""Per-layer cache differences: byte-level verdicts, magnitudes and the seeded measurement on a tiny model."""

import pandas as pd
import pytest

from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments.cache_differences import layer_differences, sample_items
from stagereplay.experiments.recipe import DecodeSettings, run
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.stages.cache_differences import measure_cache_differences
from stagereplay.stages.gather import PREFIX_SCHEMA
from stagereplay.stages.settings import CacheDifferenceSettings, from_params

PROMPT, STAGE = [5, 9, 12, 7, 3, 20, 14], [8, 15, 4, 19, 11, 6]  # ids within the toy vocabulary (21)


def boundary_layers(loaded, construction="prefill", prompt=PROMPT, stage=STAGE):
    """A copy of one row's boundary cache, built by ``construction`` (no continuation)."""
    decoder = make_decoder(loaded.model, ())
    settings = DecodeSettings(None, 1)
    return run(decoder, construction, [prompt], settings, stages=[stage], keep={0}, max_new_tokens=0)[0].layers


def copy_of(layers):
    return [(k.clone(), v.clone()) for k, v in layers]


def test_a_cache_against_itself_is_bit_identical(loaded_fp32):
    layers = boundary_layers(loaded_fp32)
    rows = layer_differences(layers, copy_of(layers))
    assert len(rows) == 2 * loaded_fp32.model.config.num_hidden_layers
    assert all(r["bit_equal"] and r["max_abs"] == 0.0 and r["first_position_differs"] is None for r in rows)
    assert {r["n_positions"] for r in rows} == {len(PROMPT) + len(STAGE) - 1}


def test_a_perturbed_position_is_found_at_its_layer_component_and_position(loaded_fp32):
    layers = boundary_layers(loaded_fp32)
    other = copy_of(layers)
    values = other[1][1]  # (batch, kv_heads, seq, head_dim)
    values[0, 1, 4, 2] += 0.25
    rows = {(r["layer"], r["component"]): r for r in layer_differences(layers, other)}
    changed = rows.pop((1, "v"))
    assert not changed["bit_equal"] and changed["first_position_differs"] == 4
    assert changed["max_abs"] == pytest.approx(0.25, rel=1e-6)  # a magnitude, not the bit-exact verdict
    assert changed["rms"] == pytest.approx(changed["max_abs"] / values.numel() ** 0.5, rel=1e-9)
    assert all(r["bit_equal"] for r in rows.values())


def test_signed_zeros_differ_in_bytes_though_not_in_value(loaded_bf16):
    layers = boundary_layers(loaded_bf16)
    a, b = copy_of(layers), copy_of(layers)
    a[0][0][0, 0, 2, 0] = 0.0
    b[0][0][0, 0, 2, 0] = -0.0
    row = layer_differences(a, b)[0]
    assert (row["layer"], row["component"]) == (0, "k")
    assert not row["bit_equal"] and row["max_abs"] == 0.0 and row["first_position_differs"] == 2


def test_caches_of_different_prefixes_are_refused_naming_the_layer(loaded_fp32):
    with pytest.raises(ValueError, match="layer 0 K: shapes"):
        layer_differences(boundary_layers(loaded_fp32), boundary_layers(loaded_fp32, stage=STAGE[:-1]))


def test_sample_is_seeded_and_skips_items_without_a_boundary():
    prefixes = pd.DataFrame({"item_index": range(10), "status": ["ok"] * 9 + ["boundary_missing"]})
    first = sample_items(prefixes, 4, seed=1)
    assert first["item_index"].tolist() == sample_items(prefixes, 4, seed=1)["item_index"].tolist()
    assert len(first) == 4 and 9 not in first["item_index"].tolist()
    assert first["item_index"].is_monotonic_increasing
    assert sample_items(prefixes, 50, seed=1)["item_index"].tolist() == list(range(9))


def settings(tiny_model_dir, **params):
    return from_params(CacheDifferenceSettings, {"model": str(tiny_model_dir.parent), "revision": "model",
                                                 "revision_slug": "model", "device": "cpu", "progress": False,
                                                 **params})


def test_measure_cache_differences_on_a_tiny_model(tiny_model_dir, tmp_path):
    from stagereplay.models.loading import load_model
    from stagereplay.models.sources import ModelSource

    rows = [{"item_index": i, "item_id": f"item-{i}", "revision": "model", "precision": "bf16",
             "status": "ok" if i != 2 else "boundary_missing", "prompt_ids": PROMPT[: 4 + i],
             "stage_ids": STAGE if i != 2 else [], "prefix_fingerprint": "", "gold_answer": "1"} for i in range(4)]
    prefixes = tmp_path / "prefixes.parquet"
    out = tmp_path / "cache_differences.parquet"
    # caches are rebuilt in the regime the prefixes were generated in: a file that records none is refused
    write_parquet(pd.DataFrame(rows), prefixes, {"stage": "test"}, PREFIX_SCHEMA)
    with pytest.raises(ValueError, match="records no decode regime"):
        measure_cache_differences(str(prefixes), str(out), settings(tiny_model_dir, precisions=("bf16",)))
    assert not out.exists()
    generated = {"stage": "reconstruct_prefixes", "decode_regime": "eager", "decode_max_len": None,
                 "decode_max_rows": 1, "numerics_regime": {"numerics": "default"}}
    write_parquet(pd.DataFrame(rows), prefixes, generated, PREFIX_SCHEMA)
    measure_cache_differences(str(prefixes), str(out), settings(tiny_model_dir, precisions=("bf16", "fp32"),
                                                                n_items=2, seed=0))
    df = read_parquet(out)
    layers = 3  # conftest's tiny model
    assert len(df) == 2 * 2 * layers * 2  # precisions x items x layers x (K, V)
    assert set(df["precision"]) == {"bf16", "fp32"} and 2 not in set(df["item_index"])
    assert set(df["construction_a"]) == {"incremental"} and set(df["construction_b"]) == {"prefill"}
    assert (df["n_positions"] == df["prompt_length"] + len(STAGE) - 1).all()
    assert (df.loc[df["bit_equal"], "max_abs"] == 0).all()
    prov = read_provenance(out)
    assert sorted(prov["items"]) == sorted(set(df["item_id"])) and len(prov["items"]) == 2  # drawn before measuring
    # the stage measures the caches the recipe builds, byte for byte (the model loaded as the stage loads it)
    loaded_bf16 = load_model(ModelSource("local", str(tiny_model_dir)), "bf16", "cpu", attn_implementation="sdpa")
    item = int(df["item_index"].iloc[0])
    prompt = PROMPT[: 4 + item]
    expected = layer_differences(boundary_layers(loaded_bf16, "incremental", prompt),
                                 boundary_layers(loaded_bf16, "prefill", prompt))
    got = df[(df["item_index"] == item) & (df["precision"] == "bf16")].sort_values(["layer", "component"])
    assert len(got) == len(expected) == 2 * layers
    for row, want in zip(got.to_dict("records"), expected):
        assert (row["layer"], row["component"], row["bit_equal"]) == (want["layer"], want["component"],
                                                                      want["bit_equal"])
        assert (row["max_abs"], row["rms"]) == (want["max_abs"], want["rms"])
    with pytest.raises(ValueError, match="prefix_precision 'fp32'"):
        measure_cache_differences(str(prefixes), str(out), settings(tiny_model_dir, precisions=("fp32",)))


def test_cache_difference_settings_refuse_an_unknown_key(tiny_model_dir):
    with pytest.raises(TypeError, match=r"CacheDifferenceSettings does not take \['n_itmes'\]"):
        settings(tiny_model_dir, precisions=("bf16",), n_itmes=2)
