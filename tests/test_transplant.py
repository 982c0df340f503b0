"""Transplants, sweeps, outcome-blind selection and cache dumps on a tiny random Qwen2 (CPU, seconds)."""

import copy

import pandas as pd
import pytest
import torch

from stagereplay.io import cache_dumps as cache_io
from stagereplay.models import compat
from stagereplay.engine import BoundaryMatcher, Decoder, build_cache, continue_greedy, generate_to_boundary
from stagereplay.experiment import ReplicaMismatchError
from stagereplay.io.fingerprints import fingerprint_ids, fingerprint_layers, tensor_bytes
from stagereplay.analysis.report import RevisionData, transplant_section
from stagereplay.transplant import SWEEPS, classify, enumerate_sweeps, run_transplants, select_items, transplant_cache
from stagereplay.transplant_stages import TRANSPLANT_SCHEMA, rebuild_constructions

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]
N_NEW = 12


def fp(cache):
    return fingerprint_layers(compat.cache_layers(cache))


def stage_ids(decoder, n=6):
    return generate_to_boundary(decoder, PROMPT, BoundaryMatcher(1, token_ids=[10_000]), n).generated_ids


@pytest.fixture(scope="module")
def setup(loaded_fp32):
    decoder = Decoder(loaded_fp32.model, ())
    stage = stage_ids(decoder)
    return decoder, stage, build_cache(decoder, "prefill", PROMPT, stage)


def perturbed(cache, layer, component, lo, hi, scale=4.0):
    """A copy of ``cache`` with noise added to one layer's K or V at cache positions [lo, hi)."""
    out = copy.deepcopy(cache)
    k, v = compat.cache_layers(out)[layer]
    target = (k if component == "k" else v).clone()
    gen = torch.Generator().manual_seed(1)
    target[:, :, lo:hi] += scale * torch.randn(target[:, :, lo:hi].shape, generator=gen, dtype=target.dtype)
    compat.set_cache_layer(out, layer, **({"keys": target} if component == "k" else {"values": target}))
    return out


def test_all_layer_transplant_into_a_copy_of_itself_changes_nothing(setup):
    decoder, stage, cache = setup
    twin = copy.deepcopy(cache)
    moved = transplant_cache(twin, cache, range(3))
    assert fp(moved) == fp(cache) == fp(twin)
    a = continue_greedy(decoder, cache, stage[-1], N_NEW)
    b = continue_greedy(decoder, moved, stage[-1], N_NEW)
    assert a.suffix_ids == b.suffix_ids and a.margins == b.margins


def test_transplant_follows_a_deliberately_perturbed_donor(setup):
    """Donor B differs from A only in layer 1's V at stage positions: each sweep's outcome is then known."""
    decoder, stage, a = setup
    b = perturbed(a, 1, "v", len(PROMPT), len(PROMPT) + len(stage) - 1)
    own = {"prefill": continue_greedy(decoder, a, stage[-1], N_NEW).suffix_ids,
           "perturbed": continue_greedy(decoder, b, stage[-1], N_NEW).suffix_ids}
    assert own["prefill"] != own["perturbed"], "the perturbation must change the continuation for this test to bite"
    specs = enumerate_sweeps(list(SWEEPS), 3)
    rows = run_transplants(decoder, {"perturbed": b, "prefill": a}, own, stage[-1], len(PROMPT), specs, N_NEW)
    assert len(rows) == 2 * len(specs)
    got = {(r["direction"], r["layer_set"], r["component"], r["positions"]): r for r in rows}
    for key, row in got.items():
        # every other byte is shared, so a transplant carries the donor exactly when it moves the perturbed bytes
        carries = 1 in row["layers"] and row["component"] in ("kv", "v") and row["positions"] in ("all", "stage")
        expected = "donor" if carries else "recipient"
        assert row["outcome"] == expected, (key, row["outcome"])
        assert row["divergent"] is True
        if expected == "donor":
            assert row["first_divergence_donor"] is None and row["first_divergence_recipient"] is not None
            assert row["suffix_ids"] == own[row["donor"]]
    assert {k[1:] for k, r in got.items() if r["outcome"] == "donor"} >= {
        ("all", "kv", "all"), ("L1", "kv", "all"), ("all", "v", "all"), ("all", "kv", "stage")}
    assert got[("perturbed->prefill", "all", "k", "all")]["outcome"] == "recipient"
    # the all-layer K/V transplant hands over the donor's exact cache
    assert got[("perturbed->prefill", "all", "kv", "all")]["cache_fingerprint"] == fp(b)[0]


def test_position_and_component_transplants_touch_only_what_they_name(setup):
    decoder, stage, a = setup
    b = perturbed(perturbed(a, 0, "k", 0, 20), 0, "v", 0, 20)
    moved = transplant_cache(a, b, [0], component="k", positions="prompt", prompt_len=len(PROMPT))
    (mk, mv), (ak, av), (bk, bv) = (compat.cache_layers(c)[0] for c in (moved, a, b))
    n = len(PROMPT)
    assert tensor_bytes(mk[:, :, :n]) == tensor_bytes(bk[:, :, :n])
    assert tensor_bytes(mk[:, :, n:]) == tensor_bytes(ak[:, :, n:])
    assert tensor_bytes(mv) == tensor_bytes(av)
    assert fp(a) != fp(moved)  # and the inputs were left untouched
    assert fp(a)[1][1:] == fp(moved)[1][1:]


def test_transplant_refuses_caches_of_different_prefixes(setup):
    decoder, stage, a = setup
    shorter = build_cache(decoder, "prefill", PROMPT, stage[:-1])
    with pytest.raises(ValueError, match="layer 0"):
        transplant_cache(a, shorter, [0])


def test_sweeps_enumerate_what_is_asked():
    specs = enumerate_sweeps(["all", "single_layers", "quarters", "halves"], 8)
    names = [s.layer_set(8) for s in specs]
    assert names == ["all"] + [f"L{i}" for i in range(8)] + ["0-1", "2-3", "4-5", "6-7", "0-3", "4-7"]
    assert [s.sweep for s in specs][:2] == ["all", "single_layers"]
    assert [s.layer_set(8) for s in enumerate_sweeps(["halves"], 7)] == ["0-3", "4-6"]
    # on a 4-layer model quarters are single layers: each transplant appears once, under the first sweep asking
    four = enumerate_sweeps(["single_layers", "quarters"], 4)
    assert len(four) == 4 and {s.sweep for s in four} == {"single_layers"}
    rest = enumerate_sweeps(["k_only", "v_only", "prompt_positions", "stage_positions"], 2)
    assert [(s.layer_set(2), s.component, s.positions) for s in rest] == [
        ("all", "k", "all"), ("all", "v", "all"), ("all", "kv", "prompt"), ("all", "kv", "stage")]
    assert enumerate_sweeps(["all"], 48)[0].layers == tuple(range(48))
    with pytest.raises(ValueError, match="thirds"):
        enumerate_sweeps(["all", "thirds"], 4)


def test_classify():
    assert classify([1, 2], [1, 2], [1, 3]).outcome == "donor"
    r = classify([1, 3, 4], [1, 2], [1, 3, 4])
    assert (r.outcome, r.first_divergence_donor, r.first_divergence_recipient) == ("recipient", 1, None)
    r = classify([5], [1, 2], [1, 3])
    assert (r.outcome, r.first_divergence_donor, r.first_divergence_recipient) == ("neither", 0, 0)


def pairs_frame():
    # items 1 and 3 diverge; correctness is deliberately absent: selection never sees it
    return pd.DataFrame({"item_index": [0, 1, 2, 3, 4], "item_id": list("abcde"),
                         "suffix_a": [[1, 2], [1, 2], [7], [1, 2, 3], [4]],
                         "suffix_b": [[1, 2], [1, 5], [7], [1, 2], [4]]})


def test_selection_is_decided_from_token_ids_only():
    chosen = select_items(pairs_frame(), "divergent")
    assert chosen["item_id"].tolist() == ["b", "d"]
    assert chosen["first_divergence"].tolist() == [1, 2]
    assert "suffix_a" not in chosen.columns
    s1, s2 = select_items(pairs_frame(), "sample:3", seed=4), select_items(pairs_frame(), "sample:3", seed=4)
    assert s1.equals(s2) and len(s1) == 3 and s1["item_index"].is_monotonic_increasing
    assert {tuple(select_items(pairs_frame(), "sample:3", seed=s)["item_id"]) for s in range(10)} != {tuple(s1["item_id"])}
    assert select_items(pairs_frame(), ["e", "a"])["item_id"].tolist() == ["a", "e"]
    with pytest.raises(ValueError, match="'zz'"):
        select_items(pairs_frame(), ["a", "zz"])
    with pytest.raises(ValueError, match="sample:9"):
        select_items(pairs_frame(), "sample:9")
    with pytest.raises(ValueError, match="divergent"):
        select_items(pairs_frame(), "largest_margin")


@pytest.mark.parametrize("fixture", ["loaded_bf16", "loaded_fp32"])
def test_dump_reload_continues_bit_for_bit(fixture, request, tmp_path):
    loaded = request.getfixturevalue(fixture)
    decoder = Decoder(loaded.model, ())
    stage = stage_ids(decoder)
    cache = build_cache(decoder, "incremental", PROMPT, stage)
    written = cache_io.save_cache(tmp_path / "c.safetensors", cache, {"item_id": "x", "pending_id": stage[-1]})
    assert written["bytes"] == (tmp_path / "c.safetensors").stat().st_size > 0
    assert not [p for p in tmp_path.iterdir() if p.name != "c.safetensors"]  # no temp file left behind
    dump = cache_io.load_cache(tmp_path / "c.safetensors")
    assert dump.meta["pending_id"] == stage[-1] and dump.meta["cache_fingerprint"] == fp(cache)[0]
    reloaded = dump.to_cache(loaded.model)
    assert fp(reloaded) == fp(cache)
    a = continue_greedy(decoder, cache, stage[-1], N_NEW)
    b = continue_greedy(decoder, reloaded, stage[-1], N_NEW)
    assert a.suffix_ids == b.suffix_ids and a.margins == b.margins


def test_tampered_dump_is_refused_naming_file_and_layer(loaded_bf16, tmp_path):
    decoder = Decoder(loaded_bf16.model, ())
    stage = stage_ids(decoder)
    cache = build_cache(decoder, "prefill", PROMPT, stage)
    path = tmp_path / "c.safetensors"
    cache_io.save_cache(path, cache, {})
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    meta = cache_io.read_metadata(path)
    # flip one byte inside the last tensor's data (the file orders tensors by name: layers.2.values is last)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    assert header < len(data) - 3 and meta["num_layers"] == 3
    with pytest.raises(cache_io.CacheDumpError, match=r"c\.safetensors: layer 2 V bytes do not match"):
        cache_io.load_cache(path)
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(cache_io.CacheDumpError, match="not a readable safetensors file"):
        cache_io.load_cache(path)


def test_rebuilt_cache_is_called_live_only_when_its_bytes_are_the_ledgers(setup):
    decoder, stage, prefill = setup
    incremental = build_cache(decoder, "incremental", PROMPT, stage)
    row = {"item_id": "x", "prompt_ids": PROMPT, "stage_ids": stage, "precision": "fp32",
           "prefix_fingerprint": fingerprint_ids(PROMPT + stage)}
    live = {**row, "construction": "live", "cache_fingerprint": fp(incremental)[0]}
    pre = {**row, "construction": "prefill", "cache_fingerprint": fp(prefill)[0]}
    caches, match = rebuild_constructions(decoder, live, pre)
    assert list(caches) == ["live", "prefill"] and match is True
    caches, match = rebuild_constructions(decoder, {**live, "cache_fingerprint": "0" * 64}, pre)
    assert list(caches) == ["incremental", "prefill"] and match is False
    with pytest.raises(ReplicaMismatchError, match="'x'.*prefill"):
        rebuild_constructions(decoder, live, {**pre, "cache_fingerprint": "0" * 64})


def test_report_section_counts_divergent_items_and_names_misses():
    rows = []
    for item, divergent, outcomes in ((0, True, ("donor", "donor")), (1, True, ("donor", "neither")),
                                      (2, False, ("donor", "donor"))):
        for direction, outcome in zip(("live->prefill", "prefill->live"), outcomes):
            rows.append({"item_index": item, "item_id": f"i{item}", "direction": direction, "sweep": "all",
                         "layer_set": "all", "component": "kv", "positions": "all", "divergent": divergent,
                         "outcome": outcome, "live_fingerprint_match": True})
    frame = pd.DataFrame(rows).assign(revision="primary", precision="bf16")
    lines, numbers = transplant_section(RevisionData("primary", {}, _frames={"transplant": frame}))
    rates = numbers["all_layers"]["bf16"]
    assert (rates["live->prefill"]["donor"], rates["prefill->live"]["donor"]) == (2, 1)  # item 2 is not divergent
    assert rates["prefill->live"]["neither"] == 1
    text = "\n".join(lines)
    assert "24 / 24" in text and "43 / 43" in text
    assert "**Finding:**" in text and "`i1 prefill->live (neither)`" in text


def test_report_section_of_an_empty_transplant_file():
    empty = TRANSPLANT_SCHEMA.empty_table().to_pandas()
    lines, numbers = transplant_section(RevisionData("later", {}, _frames={"transplant": empty}))
    assert numbers == {"n_items": 0, "n_divergent": 0} and "No divergent item" in "\n".join(lines)


@pytest.mark.parametrize("change,key", [
    ({"transplant": {"select": "sample:0"}}, "sample:0"),
    ({"transplant": {"select": "largest"}}, "largest"),
    ({"transplant": {"sweeps": ["all", "thirds"]}}, "thirds"),
    ({"transplant": {"sweeps": []}}, "sweeps"),
    ({"transplant": {"seeed": 1}}, "seeed"),
    ({"dump": {"items": "some"}}, "some"),
])
def test_bad_transplant_config_fails_naming_the_value(change, key):
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    from test_config import SCHEMA, default_config

    cfg = default_config()
    cfg.update(change)
    with pytest.raises(WorkflowError) as err:
        validate(cfg, SCHEMA, set_default=True)
    assert key in str(err.value)


def test_partial_transplant_config_gets_the_other_defaults():
    from snakemake.utils import validate

    from test_config import SCHEMA, default_config

    cfg = default_config()
    cfg["transplant"] = {"revisions": ["primary", "later"], "select": ["toy-0-000001"]}
    validate(cfg, SCHEMA, set_default=True)
    assert cfg["transplant"]["sweeps"][0] == "all" and "single_layers" not in cfg["transplant"]["sweeps"]
    assert cfg["transplant"]["seed"] == 0 and cfg["dump"] == {"items": "divergent"}


@pytest.mark.parametrize("positions", [3, 4096])  # 0.2 MB: hashed in line; 64 MB: hashed in threads
def test_fingerprints_are_sha256_of_the_exact_bytes_at_any_size(positions):
    import hashlib
    import struct

    from stagereplay.io.fingerprints import PARALLEL_HASH_BYTES

    generator = torch.Generator().manual_seed(0)
    layers = [tuple(torch.randn(1, 4, positions, 128, generator=generator).to(torch.bfloat16) for _ in range(2))
              for _ in range(8)]
    raw = [bytes(t.view(torch.uint8).numpy()) for pair in layers for t in pair]
    assert (sum(map(len, raw)) >= PARALLEL_HASH_BYTES) == (positions == 4096)
    whole, ks, vs = fingerprint_layers(layers)
    digests = [hashlib.sha256(b).digest() for b in raw]  # the whole: a hash list over the tensors' digests
    assert whole == hashlib.sha256(b"stagereplay-cache-v2\0" + struct.pack("<Q", 16) + b"".join(digests)).hexdigest()
    assert ks == [hashlib.sha256(b).hexdigest() for b in raw[0::2]]
    assert vs == [hashlib.sha256(b).hexdigest() for b in raw[1::2]]
