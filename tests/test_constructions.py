"""The construction registry, the decoder protocol and "batch 1 is a batch of one row"."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.plans import Batch
from stagereplay.decode.protocol import Decoder
from stagereplay.decode.regimes import make_decoder
from stagereplay.decode.static import StaticDecoder
from stagereplay.experiments import constructions
from stagereplay.experiments.matched import fixed_prefix
from stagereplay.experiments.recipe import DecodeSettings, run
from stagereplay.experiments.rows import RunSettings
from stagereplay.io.fingerprints import fingerprint_layers
from stagereplay.models import compat
from stagereplay.models.loading import load_model
from stagereplay.models.sources import ModelSource


def rows(loaded, n, seed=0):
    tok = loaded.tokenizer
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randrange(3, 20))] for _ in range(n)]
    stages = [[rng.randrange(3, len(tok)) for _ in range(rng.randrange(2, 12))] for _ in range(n)]
    return prompts, stages


def test_registry_segments_cover_every_cached_id():
    for name in constructions.REGISTRY:
        if not constructions.get(name).rebuildable:
            continue
        for chunk in (1, 3, 64):
            for n_cached in (0, 5):
                segments = constructions.get(name).cache_build(chunk).segments(7, n_cached)
                assert sum(segments) == 7 + n_cached and all(n >= 1 for n in segments), (name, segments)
    assert constructions.get("prefix_cached").cache_build().segments(7, 5) == [7, 5]
    assert constructions.get("prefix_cached").cache_build().segments(7, 0) == [7]
    assert constructions.get("chunked").cache_build(3).segments(7, 5) == [3, 3, 3, 3]
    assert constructions.get("chunked").cache_build(64).segments(7, 5) == constructions.get("prefill").cache_build(
        64).segments(7, 5)
    assert constructions.get("incremental").cache_build().segments(7, 2) == [7, 1, 1]
    with pytest.raises(ValueError, match="live"):
        constructions.get("live").cache_build()
    with pytest.raises(ValueError, match="known"):
        constructions.get("paged")


def test_decoders_implement_the_protocol(loaded_fp32, tiny_model_dir):
    assert isinstance(EagerDecoder(loaded_fp32.model), Decoder)
    assert EagerDecoder(loaded_fp32.model).numerics == "default"
    switched = load_model(ModelSource("local", str(tiny_model_dir)), "fp32", "cpu", numerics="invariant")
    assert EagerDecoder(switched.model).numerics == "invariant"
    assert make_decoder(switched.model, (), "static", max_len=32).numerics == "invariant"
    assert isinstance(make_decoder(loaded_fp32.model, (), "static", max_len=32), StaticDecoder)
    assert isinstance(make_decoder(loaded_fp32.model, (), "static", max_len=32), Decoder)


@torch.inference_mode()
def by_hand(model, ids: list[int], sizes: list[int]) -> str:
    """A DynamicCache fed ``ids`` in forwards of ``sizes`` tokens through the Hugging Face forward itself."""
    cache, start = compat.new_dynamic_cache(model), 0
    for n in sizes:
        model(input_ids=torch.tensor([ids[start:start + n]]), use_cache=True, logits_to_keep=1,
              **{compat.cache_keyword(model): cache})
        start += n
    return fingerprint_layers(compat.cache_layers(cache))[0]


def test_every_construction_is_offered_by_the_config_schema():
    """A new construction is a registry entry: the schema the workflow validates with offers it where constructions
    are chosen."""
    from stagereplay.config import schema_file

    schema = json.loads(Path(schema_file()).read_text())["properties"]
    rebuildable = {n for n, c in constructions.REGISTRY.items() if c.rebuildable}
    assert set(schema["fixed_prefix"]["properties"]["constructions"]["items"]["enum"]) == rebuildable
    assert set(schema["transplant"]["properties"]["constructions"]["items"]["enum"]) == set(constructions.REGISTRY)


def test_prefix_cached_is_the_prompt_then_the_stage_in_one_forward(loaded_bf16):
    (prompt,), (stage,) = rows(loaded_bf16, 1, seed=5)
    settings = DecodeSettings(None, 4)
    res = run(EagerDecoder(loaded_bf16.model), "prefix_cached", [prompt], settings, stages=[stage], keep={0})[0]
    assert res.fingerprints[0] == by_hand(loaded_bf16.model, prompt + stage[:-1], [len(prompt), len(stage) - 1])
    # its prompt part is the cache every request over that prompt computes: incremental's, byte for byte
    incremental = run(EagerDecoder(loaded_bf16.model), "incremental", [prompt], settings, stages=[stage],
                      keep={0})[0]
    prompt_part = [[(k[:, :, :len(prompt)], v[:, :, :len(prompt)]) for k, v in r.layers] for r in (res, incremental)]
    assert fingerprint_layers(prompt_part[0]) == fingerprint_layers(prompt_part[1])


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_is_prefill_in_chunks_of_chunk_size(loaded_bf16, chunk):
    (prompt,), (stage,) = rows(loaded_bf16, 1, seed=3)
    settings = DecodeSettings(None, 4, chunk)
    res = run(EagerDecoder(loaded_bf16.model), "chunked", [prompt], settings, stages=[stage])[0]
    ids = prompt + stage[:-1]
    assert res.fingerprints[0] == by_hand(loaded_bf16.model, ids, [min(chunk, len(ids) - s)
                                                                   for s in range(0, len(ids), chunk)])
    if chunk >= len(ids):
        prefill = run(EagerDecoder(loaded_bf16.model), "prefill", [prompt], settings, stages=[stage])[0]
        assert res.fingerprints[0] == prefill.fingerprints[0]


@pytest.mark.parametrize("regime", ["eager", "static"])
def test_fixed_prefix_with_chunked_in_the_pair(loaded_bf16, regime):
    prompts, stages = rows(loaded_bf16, 3, seed=5)
    decoder = make_decoder(loaded_bf16.model, (), regime, max_len=64, max_rows=3)
    settings = RunSettings("r", "bf16", None, 6, chunk_size=3)
    items = tuple({"item_index": i, "item_id": f"i{i}", "gold_answer": "1"} for i in range(3))
    out = fixed_prefix(decoder, Batch(0, items), prompts, stages, settings, loaded_bf16.tokenizer,
                       pair=("chunked", "prefill"))
    assert sorted({(r["construction"], r["replica"]) for r in out}) == [("chunked", 1), ("chunked", 2),
                                                                         ("prefill", 1), ("prefill", 2)]
    assert len(out) == 12
    layouts = {(r["item_index"], r["construction"]): (r["layout_pad"], r["layout_position"]) for r in out}
    assert all(layouts[i, "chunked"] == layouts[i, "prefill"] for i in range(3))


@pytest.mark.parametrize("name", ["incremental", "prefill", "chunked"])
def test_a_batch_of_rows_is_each_row_alone_on_the_eager_decoder(loaded_bf16, name):
    """Batch 1 is a batch of one row: the eager decoder computes rows apart, so a batch gives every row its bits
    alone."""
    prompts, stages = rows(loaded_bf16, 3, seed=7)
    decoder = EagerDecoder(loaded_bf16.model)
    settings = DecodeSettings(None, 8, 2)
    together = run(decoder, name, prompts, settings, stages=stages)
    alone = [run(decoder, name, [p], settings, stages=[s])[0] for p, s in zip(prompts, stages)]
    assert [(r.fingerprints, r.suffix_ids, r.margins) for r in together] == [
        (r.fingerprints, r.suffix_ids, r.margins) for r in alone]
