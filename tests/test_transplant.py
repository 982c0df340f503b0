"""Transplants, sweeps, outcome-blind selection and cache dumps on a tiny random Qwen2 (CPU, seconds)."""

import dataclasses
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from stagereplay.analysis.report import RevisionData, transplant_section
from stagereplay.decode.greedy import BoundaryMatcher, decode_rows
from stagereplay.decode.plans import Batch
from stagereplay.decode.regimes import make_decoder
from stagereplay.experiments import transplant as transplant_module
from stagereplay.experiments.matched import fixed_prefix
from stagereplay.experiments.recipe import run
from stagereplay.experiments.rows import ReplicaMismatchError, RunSettings
from stagereplay.experiments.transplant import (
    choose_transplant_items,
    classify,
    transplant_batch,
    transplant_edit,
    transplant_rows,
)
from stagereplay.experiments.transplant_specs import SWEEPS, TransplantSpec, enumerate_sweeps
from stagereplay.io import cache_dumps as cache_io
from stagereplay.io.fingerprints import fingerprint_layers, tensor_bytes
from stagereplay.models import compat
from stagereplay.stages.transplant import TRANSPLANT_SCHEMA, Rebuild
from stagereplay.stages.transplant_selection import baseline_rows

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]
N_NEW = 12
N_LAYERS = 3  # conftest's tiny model
ALL = TransplantSpec("all", tuple(range(N_LAYERS)))


def settings(precision="fp32", regime="eager"):
    return RunSettings("tiny", precision, None, N_NEW, decode_regime=regime)


def stage_ids(decoder, n=6):
    """``n`` greedy ids from PROMPT (a boundary that never appears: everything generated in the stage budget)."""
    [res] = decode_rows(decoder, [PROMPT], matcher=BoundaryMatcher(1, token_ids=[10_000]), max_stage_tokens=n,
                        max_new_tokens=1)
    assert res.stop_reason == "boundary_missing" and len(res.suffix_ids) == n
    return res.suffix_ids


def own(decoder, construction, stage, precision="fp32", edit=None):
    """One row's own continuation of ``construction`` over PROMPT + stage, its boundary cache kept."""
    return run(decoder, construction, [PROMPT], settings(precision), stages=[stage], edit=edit, keep={0})[0]


@pytest.fixture(scope="module")
def setup(loaded_fp32):
    decoder = make_decoder(loaded_fp32.model, ())
    stage = stage_ids(decoder)
    return decoder, stage, own(decoder, "prefill", stage)


def noise(layers, layer, component, lo, hi, scale=4.0):
    """Fixed noise for one layer's K or V at cache positions [lo, hi): an edit that perturbs a cache in place."""
    k, v = layers[layer]
    target = k if component == "k" else v
    gen = torch.Generator().manual_seed(1)
    delta = scale * torch.randn(target[:, :, lo:hi].shape, generator=gen, dtype=torch.float32).to(target.dtype)

    def edit(r, rows_layers):
        t = rows_layers[layer][0 if component == "k" else 1]
        t[:, :, lo:hi] += delta

    return edit


def test_all_layer_transplant_from_a_copy_of_itself_changes_nothing(setup):
    decoder, stage, a = setup
    moved = own(decoder, "prefill", stage, edit=transplant_edit(0, ALL, a.layers, len(PROMPT)))
    assert moved.fingerprints == a.fingerprints == fingerprint_layers(moved.layers)
    assert moved.suffix_ids == a.suffix_ids and moved.margins == a.margins
    assert (moved.pad, moved.position) == (a.pad, a.position)


def test_transplant_follows_a_deliberately_perturbed_donor(setup, monkeypatch):
    """Donor B is A (prefill) with layer 1's V perturbed at stage positions: each sweep's outcome is then known."""
    decoder, stage, a = setup
    perturb = noise(a.layers, 1, "v", len(PROMPT), len(PROMPT) + len(stage) - 1)
    real_run = transplant_module.run

    def run_with_perturbed(decoder, construction, prompts, settings, *, edit=None, **kwargs):
        """``perturbed``: the prefill construction with the perturbation at its boundary, then ``edit``."""
        if construction != "perturbed":
            return real_run(decoder, construction, prompts, settings, edit=edit, **kwargs)

        def both(r, layers):
            perturb(r, layers)
            if edit is not None:
                edit(r, layers)

        return real_run(decoder, "prefill", prompts, settings, edit=both, **kwargs)

    monkeypatch.setattr(transplant_module, "run", run_with_perturbed)
    b = run_with_perturbed(decoder, "perturbed", [PROMPT], settings(), stages=[stage], keep={0})[0]
    assert a.suffix_ids != b.suffix_ids, "the perturbation must change the continuation for this test to bite"
    assert a.fingerprints[1] == b.fingerprints[1] and a.fingerprints[2][1] != b.fingerprints[2][1]
    specs = enumerate_sweeps(list(SWEEPS), N_LAYERS)
    rows = transplant_batch(decoder, [PROMPT], [stage], settings(), {"perturbed": [b], "prefill": [a]}, [0], specs)[0]
    assert len(rows) == 2 * len(specs)
    suffix = {"perturbed": b.suffix_ids, "prefill": a.suffix_ids}
    cache = {"perturbed": b.fingerprints[0], "prefill": a.fingerprints[0]}
    got = {(r["direction"], r["layer_set"], r["component"], r["positions"]): r for r in rows}
    for key, row in got.items():
        # every other byte is shared, so a transplant carries the donor exactly when it moves the perturbed bytes
        carries = 1 in row["layers"] and row["component"] in ("kv", "v") and row["positions"] in ("all", "stage")
        expected = "donor" if carries else "recipient"
        assert row["outcome"] == expected, (key, row["outcome"])
        assert row["divergent"] is True
        side = row["donor"] if carries else row["recipient"]
        # the continuation read exactly the cache of the side it followed
        assert row["suffix_ids"] == suffix[side] and row["cache_fingerprint"] == cache[side], key
        if expected == "donor":
            assert row["first_divergence_donor"] is None and row["first_divergence_recipient"] is not None
        else:
            assert row["first_divergence_recipient"] is None and row["first_divergence_donor"] is not None
    assert {k[1:] for k, r in got.items() if r["outcome"] == "donor"} >= {
        ("all", "kv", "all"), ("L1", "kv", "all"), ("all", "v", "all"), ("all", "kv", "stage")}
    assert got[("perturbed->prefill", "all", "k", "all")]["outcome"] == "recipient"
    # the all-layer K/V transplant hands over the donor's exact cache
    assert got[("perturbed->prefill", "all", "kv", "all")]["cache_fingerprint"] == b.fingerprints[0]
    assert got[("prefill->perturbed", "all", "kv", "all")]["cache_fingerprint"] == a.fingerprints[0]


def test_position_and_component_transplants_touch_only_what_they_name(setup):
    decoder, stage, a = setup
    recipient = [(k.clone(), v.clone()) for k, v in a.layers]
    donor = [(k.clone(), v.clone()) for k, v in a.layers]
    donor[0][0][:, :, :20] += 1.0
    donor[0][1][:, :, :20] += 1.0
    donor_before = fingerprint_layers(donor)
    n = len(PROMPT)
    edit = transplant_edit(0, TransplantSpec("prompt_positions", (0,), "k", "prompt"), donor, n)
    edit(1, recipient)  # another row's boundary: nothing happens
    assert fingerprint_layers(recipient) == fingerprint_layers(a.layers)
    edit(0, recipient)
    (mk, mv), (ak, av), (bk, bv) = recipient[0], a.layers[0], donor[0]
    assert tensor_bytes(mk[:, :, :n]) == tensor_bytes(bk[:, :, :n]) != tensor_bytes(ak[:, :, :n])
    assert tensor_bytes(mk[:, :, n:]) == tensor_bytes(ak[:, :, n:])
    assert tensor_bytes(mv) == tensor_bytes(av)
    moved = fingerprint_layers(recipient)
    assert moved[0] != fingerprint_layers(a.layers)[0] and moved[1][1:] == fingerprint_layers(a.layers)[1][1:]
    assert moved[2] == fingerprint_layers(a.layers)[2]
    assert fingerprint_layers(donor) == donor_before  # the donor is read, never written
    # stage positions and V only
    recipient = [(k.clone(), v.clone()) for k, v in a.layers]
    transplant_edit(0, TransplantSpec("v_only", (0,), "v", "stage"), donor, n)(0, recipient)
    (mk, mv) = recipient[0]
    assert tensor_bytes(mv[:, :, n:]) == tensor_bytes(bv[:, :, n:]) != tensor_bytes(av[:, :, n:])
    assert tensor_bytes(mv[:, :, :n]) == tensor_bytes(av[:, :, :n]) and tensor_bytes(mk) == tensor_bytes(ak)


def test_transplant_refuses_caches_of_different_prefixes(setup):
    decoder, stage, a = setup
    shorter = own(decoder, "prefill", stage[:-1]).layers
    with pytest.raises(ValueError, match="layer 0"):
        transplant_edit(0, ALL, shorter, len(PROMPT))(0, [(k.clone(), v.clone()) for k, v in a.layers])
    with pytest.raises(ValueError, match="not the same model"):
        transplant_edit(0, ALL, a.layers[:2], len(PROMPT))(0, [(k.clone(), v.clone()) for k, v in a.layers])
    with pytest.raises(ValueError, match="layer 5 is outside"):
        transplant_edit(0, TransplantSpec("x", (5,)), a.layers, len(PROMPT))(0, list(a.layers))
    with pytest.raises(ValueError, match="component"):
        transplant_edit(0, TransplantSpec("x", (0,), "q"), a.layers, len(PROMPT))
    # inside the loop: the transplant stops the run
    with pytest.raises(ValueError, match="layer 0"):
        own(decoder, "prefill", stage, edit=transplant_edit(0, ALL, shorter, len(PROMPT)))


@pytest.mark.parametrize("regime", ["eager", "static"])
def test_all_layer_transplant_between_constructions_continues_as_the_donor(tiny_model_dir, regime):
    """Real constructions of a batch, each row decoded in its batch's layout: the all-layer, all-position K/V
    transplant hands the recipient the donor's whole boundary state, so the continuation is the donor's own; the
    other rows of the batch are left as the recipient construction made them."""
    from stagereplay.models.loading import load_model
    from stagereplay.models.sources import ModelSource

    loaded = load_model(ModelSource("local", str(tiny_model_dir)), "fp32", "cpu")  # the static regime fuses weights
    decoder = make_decoder(loaded.model, (), regime, max_len=40, max_rows=3)
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]]
    stages = [[8, 15, 4, 19, 11, 6], [3, 5, 7], [12, 13, 14, 20, 9]]
    s = settings(regime=regime)
    row = 1
    own_runs = {name: run(decoder, name, prompts, s, stages=stages, keep={row}) for name in ("incremental", "prefill")}
    if regime == "static":
        assert len({res.pad for res in own_runs["prefill"]}) > 1  # left-padded rows
    rows = transplant_batch(decoder, prompts, stages, s, own_runs, [row], [ALL])[row]
    assert [r["direction"] for r in rows] == ["incremental->prefill", "prefill->incremental"]
    for r in rows:
        donor = own_runs[r["donor"]][row]
        assert r["outcome"] == "donor" and r["first_divergence_donor"] is None
        assert r["suffix_ids"] == donor.suffix_ids and r["margins"] == donor.margins
        assert r["cache_fingerprint"] == donor.fingerprints[0]
        assert (r["layout_pad"], r["layout_position"]) == (donor.pad, donor.position)
    # the edit touches its row only
    edit = transplant_edit(row, ALL, own_runs["incremental"][row].layers, len(prompts[row]))
    edited = run(decoder, "prefill", prompts, s, stages=stages, edit=edit)
    for r in (0, 2):
        assert edited[r].fingerprints == own_runs["prefill"][r].fingerprints
        assert edited[r].suffix_ids == own_runs["prefill"][r].suffix_ids


@pytest.mark.parametrize("regime", ["eager", "static"])
def test_rows_transplanted_together_equal_each_row_transplanted_alone(tiny_model_dir, regime):
    """The transplant stage edits every selected row of a batch in one decode; each row's result must be the bytes
    it gets when it is the only row edited (the batch's layout is the same; other rows' values must not matter),
    and a row left unedited beside transplanted ones must reproduce its own result, or the stage stops."""
    from stagereplay.models.loading import load_model
    from stagereplay.models.sources import ModelSource

    loaded = load_model(ModelSource("local", str(tiny_model_dir)), "bf16", "cpu")
    decoder = make_decoder(loaded.model, (), regime, max_len=40, max_rows=3)
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]]
    stages = [[8, 15, 4, 19, 11, 6], [3, 5, 7], [12, 13, 14, 20, 9]]
    s = settings("bf16", regime=regime)
    own_runs = {name: run(decoder, name, prompts, s, stages=stages, keep={0, 1, 2}) for name in ("incremental", "prefill")}
    specs = enumerate_sweeps(["all", "halves", "k_only", "prompt_positions"], N_LAYERS)
    together = transplant_batch(decoder, prompts, stages, s, own_runs, [0, 1, 2], specs)
    for r in range(3):
        alone = transplant_batch(decoder, prompts, stages, s, own_runs, [r], specs)[r]
        assert [row["rows_transplanted"] for row in together[r]] == [3] * 2 * len(specs)
        keys = ("direction", "layer_set", "component", "positions", "outcome", "suffix_ids", "margins",
                "cache_fingerprint", "layout_pad", "layout_position")
        assert [[row[k] for k in keys] for row in together[r]] == [[row[k] for k in keys] for row in alone]
    # a row decoded unedited must reproduce its own result: a tampered own result of row 0 stops the transplant
    tampered = {name: list(results) for name, results in own_runs.items()}
    tampered["prefill"][0] = dataclasses.replace(tampered["prefill"][0], suffix_ids=[1, 2, 3])
    with pytest.raises(ReplicaMismatchError, match="batch row 0"):
        transplant_rows(decoder, prompts, stages, s, tampered, "incremental", "prefill", {1: ALL})


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
    chosen = choose_transplant_items(pairs_frame(), "divergent")
    assert chosen["item_id"].tolist() == ["b", "d"]
    assert chosen["first_divergence"].tolist() == [1, 2]
    assert "suffix_a" not in chosen.columns
    s1 = choose_transplant_items(pairs_frame(), "sample:3", seed=4)
    s2 = choose_transplant_items(pairs_frame(), "sample:3", seed=4)
    assert s1.equals(s2) and len(s1) == 3 and s1["item_index"].is_monotonic_increasing
    assert {tuple(choose_transplant_items(pairs_frame(), "sample:3", seed=s)["item_id"]) for s in range(10)} != {tuple(s1["item_id"])}
    assert choose_transplant_items(pairs_frame(), ["e", "a"])["item_id"].tolist() == ["a", "e"]
    with pytest.raises(ValueError, match="'zz'"):
        choose_transplant_items(pairs_frame(), ["a", "zz"])
    with pytest.raises(ValueError, match="sample:9"):
        choose_transplant_items(pairs_frame(), "sample:9")
    with pytest.raises(ValueError, match="divergent"):
        choose_transplant_items(pairs_frame(), "largest_margin")


def test_divergent_n_draws_among_divergent_items_only():
    frame = pd.DataFrame({"item_index": range(8), "item_id": list("abcdefgh"),
                          "suffix_a": [[1, 2]] * 8, "suffix_b": [[1, 2], [1, 5]] * 4})  # b, d, f, h diverge
    draws = {tuple(choose_transplant_items(frame, "divergent:2", seed=s)["item_id"]) for s in range(20)}
    assert all(len(d) == 2 and set(d) <= set("bdfh") and list(d) == sorted(d) for d in draws)
    assert len(draws) > 1  # the seed decides which, not the order of the items
    assert choose_transplant_items(frame, "divergent:2", seed=3).equals(choose_transplant_items(frame, "divergent:2", seed=3))
    # N at or above the divergent count: every divergent item, as 'divergent' gives
    assert choose_transplant_items(frame, "divergent:9").equals(choose_transplant_items(frame, "divergent"))


@pytest.mark.parametrize("fixture", ["loaded_bf16", "loaded_fp32"])
def test_dump_reload_continues_bit_for_bit(fixture, request, tmp_path):
    loaded = request.getfixturevalue(fixture)
    precision = fixture.removeprefix("loaded_")
    decoder = make_decoder(loaded.model, ())
    stage = stage_ids(decoder)
    cache = own(decoder, "incremental", stage, precision)
    written = cache_io.save_cache(tmp_path / "c.safetensors", cache.layers, {"item_id": "x", "pending_id": stage[-1]})
    assert written["bytes"] == (tmp_path / "c.safetensors").stat().st_size > 0
    # no temp file left behind, only the dump and its hash record
    assert sorted(p.name for p in tmp_path.iterdir()) == [".c.safetensors.sha256", "c.safetensors"]
    dump = cache_io.load_cache(tmp_path / "c.safetensors")
    assert dump.meta["pending_id"] == stage[-1] and dump.meta["cache_fingerprint"] == cache.fingerprints[0]
    assert fingerprint_layers(dump.layers) == cache.fingerprints
    reloaded = compat.cache_from_tensors(loaded.model, dump.layers)
    assert fingerprint_layers(compat.cache_layers(reloaded)) == cache.fingerprints

    def from_dump(r, layers):  # wipe the rebuilt cache, then continue from the dump's bytes alone
        for k, v in layers:
            k.zero_()
            v.zero_()
        transplant_edit(0, ALL, dump.layers, len(PROMPT))(r, layers)

    continued = own(decoder, "prefill", stage, precision, edit=from_dump)
    assert continued.fingerprints == cache.fingerprints
    assert continued.suffix_ids == cache.suffix_ids and continued.margins == cache.margins


def test_tampered_dump_is_refused_naming_file_and_layer(loaded_bf16, tmp_path):
    decoder = make_decoder(loaded_bf16.model, ())
    stage = stage_ids(decoder)
    cache = own(decoder, "prefill", stage, "bf16")
    path = tmp_path / "c.safetensors"
    cache_io.save_cache(path, cache.layers, {})
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    meta = cache_io.read_metadata(path)
    # flip one byte inside the last tensor's data (the file orders tensors by name: layers.2.values is last)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    assert header < len(data) - 3 and meta["num_layers"] == N_LAYERS
    with pytest.raises(cache_io.CacheDumpError, match=r"c\.safetensors: layer 2 V bytes do not match"):
        cache_io.load_cache(path)
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(cache_io.CacheDumpError, match="not a readable safetensors file"):
        cache_io.load_cache(path)


def test_rebuilt_cache_is_called_live_only_when_its_bytes_are_the_ledgers(setup, loaded_fp32):
    decoder, stage, _ = setup
    item = {"item_index": 0, "item_id": "x", "gold_answer": "1"}
    batch = Batch(None, (item,))
    rows = fixed_prefix(decoder, batch, [PROMPT], [stage], settings(), loaded_fp32.tokenizer, replicas=(1,))
    # the baseline's live row: its cache is the incremental rebuild's, byte for byte (the bridge's claim)
    rows = [dict(r, construction="live") if r["construction"] == "incremental" else r for r in rows]

    def rebuild(rows):
        pairs = baseline_rows(pd.DataFrame(rows), "fp32", ("live", "prefill"))
        by_index = {int(p["item_index"]): p for p in pairs.to_dict("records")}
        members = Batch(None, ({**item, "prompt_ids": PROMPT},))
        return Rebuild(SimpleNamespace(decoder=decoder), members, by_index, ("live", "prefill"), settings(), {0})

    def edited(construction, **change):
        return [dict(r, **change) if r["construction"] == construction else r for r in rows]

    done = rebuild(rows)
    assert done.names[0]["live"] == "live" and done.match[0] is True
    assert done.own["live"][0].layers is not None  # kept for dumps and transplants
    done = rebuild(edited("live", cache_fingerprint="0" * 64))
    assert done.names[0]["live"] == "incremental" and done.match[0] is False
    with pytest.raises(ReplicaMismatchError, match="'x'.*prefill"):
        rebuild(edited("prefill", cache_fingerprint="0" * 64))
    prefill_suffix = next(r for r in rows if r["construction"] == "prefill")["suffix_ids"]
    with pytest.raises(ReplicaMismatchError, match="'x'.*prefill continuation"):
        rebuild(edited("prefill", suffix_ids=[(prefill_suffix[0] + 1) % 21] + list(prefill_suffix[1:])))


def test_rebuild_names_both_constructions_of_the_pair(setup, loaded_fp32):
    """Every rebuilt construction of the pair gets a name: the other one keeps its own."""
    decoder, stage, _ = setup
    item = {"item_index": 0, "item_id": "x", "gold_answer": "1", "prompt_ids": PROMPT}
    rows = fixed_prefix(decoder, Batch(None, (item,)), [PROMPT], [stage], settings(), loaded_fp32.tokenizer,
                        replicas=(1,))
    for pair in (("incremental", "prefill"), ("live", "prefill")):
        named = [dict(r, construction="live") if pair[0] == "live" and r["construction"] == "incremental" else r
                 for r in rows]
        pairs = baseline_rows(pd.DataFrame(named), "fp32", pair)
        by_index = {int(p["item_index"]): p for p in pairs.to_dict("records")}
        done = Rebuild(SimpleNamespace(decoder=decoder), Batch(None, (item,)), by_index, pair, settings(), {0})
        assert done.names[0] == {name: name for name in pair}


@pytest.fixture(scope="module")
def toy_ledger(tmp_path_factory):
    """A gathered bf16 ledger of three toy items (the matched experiment), as the workflow makes it."""
    from pathlib import Path

    from stagereplay.stages.gather import gather_ledger
    from stagereplay.stages.reconstruct import reconstruct_prefixes
    from stagereplay.stages.select import select_items as select_from_dataset
    from stagereplay.stages.settings import ReconstructSettings, from_params

    folder = tmp_path_factory.mktemp("toy_ledger")
    model = dict(model=str(Path(__file__).resolve().parents[1] / "data/toy"), revision="primary", device="cpu",
                 progress=False)
    select_from_dataset({"source": "synthetic", "size": 20, "seed": 0}, 3, 0, str(folder / "items.parquet"))
    reconstruct_prefixes(str(folder / "items.parquet"), str(folder / "part.parquet"), str(folder / "prefixes.parquet"),
                         str(folder / "bridge.parquet"), from_params(ReconstructSettings, dict(
                             model, precision="bf16", boundary={"marker": ";"}, max_stage_tokens=32,
                             max_new_tokens=N_NEW, bridge={"n_rows": 0, "seed": 0})))
    gather_ledger([str(folder / "part.parquet")], str(folder / "ledger.parquet"))
    return folder, model


def test_dump_caches_writes_both_constructions_bit_exact_with_the_ledger(toy_ledger, tmp_path):
    from stagereplay.io.parquet import read_parquet
    from stagereplay.stages.settings import DumpSettings, from_params
    from stagereplay.stages.transplant import dump_caches

    folder, model = toy_ledger
    dump_caches(str(folder / "ledger.parquet"), str(tmp_path / "caches"), str(tmp_path / "caches.parquet"),
                from_params(DumpSettings, dict(model, items="all", max_new_tokens=N_NEW)))
    manifest = read_parquet(tmp_path / "caches.parquet")
    ledger = read_parquet(folder / "ledger.parquet")
    ok = ledger[(ledger["status"] == "ok") & (ledger["replica"] == 1)]
    assert len(manifest) == len(ok) and set(manifest["construction"]) <= {"live", "incremental", "prefill"}
    by = {(int(r["item_index"]), r["construction"]): r for r in ok.to_dict("records")}
    for entry in manifest.to_dict("records"):
        dump = cache_io.load_cache(tmp_path / "caches" / entry["path"])  # its bytes match its own fingerprints
        side = "live" if entry["construction"] == "incremental" else entry["construction"]
        assert entry["live_fingerprint_match"] is True
        assert dump.meta["cache_fingerprint"] == by[(int(entry["item_index"]), side)]["cache_fingerprint"]


def test_transplant_caches_all_layer_transplants_follow_the_donor(toy_ledger, tmp_path):
    from stagereplay.io.parquet import read_parquet
    from stagereplay.stages.settings import TransplantSettings, from_params
    from stagereplay.stages.transplant import transplant_caches
    from stagereplay.stages.transplant_selection import select_transplant_items

    folder, model = toy_ledger
    chosen = select_transplant_items(str(folder / "ledger.parquet"), str(tmp_path / "selection.parquet"),
                                     revision="primary", precision="bf16", select="sample:2", seed=0)
    assert len(chosen) == 2
    df = transplant_caches(str(tmp_path / "selection.parquet"), str(folder / "ledger.parquet"),
                           str(tmp_path / "transplant.parquet"),
                           from_params(TransplantSettings, dict(model, precision="bf16", max_new_tokens=N_NEW,
                                                                      sweeps=("all",))))
    assert len(df) == 2 * 2 and len(read_parquet(tmp_path / "transplant.parquet")) == 4
    assert set(df["direction"]) == {"live->prefill", "prefill->live"}
    assert (df["outcome"] == "donor").all()
    assert (df["cache_fingerprint"] == df["donor_cache_fingerprint"]).all()
    assert (df["suffix_fingerprint"] == df["donor_suffix_fingerprint"]).all()


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
