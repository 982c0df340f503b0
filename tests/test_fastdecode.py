"""The static / cuda_graph decode regimes (decode.static): exactness within the regime, batching, the pipeline switch.

CPU runs the ``static`` regime (the same forward the CUDA graph captures, executed eagerly); tests of the graph
itself need a CUDA device and are skipped without one. Every "identical" claim compares token ids, fp32 margins
or sha256 fingerprints of the cache bytes; the one tolerance (the static forward against the eager one) is stated
where it is used.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from bench_scripts import load_bench

from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.greedy import BoundaryMatcher, decode_rows
from stagereplay.decode.plans import BatchPlan, batch_plan, batches_of
from stagereplay.decode.protocol import Decoder, RegimeError
from stagereplay.decode.regimes import decoder_from_record, make_decoder
from stagereplay.decode.static import StaticDecoder
from stagereplay.experiments import constructions
from stagereplay.experiments.recipe import run
from stagereplay.experiments.recipe import DecodeSettings
from stagereplay.experiments.transplant import transplant_edit
from stagereplay.experiments.transplant_specs import TransplantSpec
from stagereplay.io.fingerprints import fingerprint_layers

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]
PROMPTS = [PROMPT, PROMPT[:5], PROMPT[2:] + [3, 4]]  # three lengths: rows get different left padding
REPO = Path(__file__).resolve().parents[1]
NEVER = BoundaryMatcher(1, token_ids=[10_000])  # an id the model cannot produce
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the cuda_graph regime captures a CUDA graph: needs a CUDA device")


def fresh_model(tiny_model_dir, precision, device="cpu"):
    """A private copy: the static decoder rebinds weights to fused tensors, which session fixtures must not see."""
    from stagereplay.models.loading import load_model
    from stagereplay.models.sources import ModelSource

    return load_model(ModelSource("local", str(tiny_model_dir)), precision, device).model


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from stagereplay.models.loading import set_determinism

    set_determinism(1)
    return {p: fresh_model(tiny_model_dir, p) for p in ("fp32", "bf16")}


class AtLength:
    """A boundary matcher (the greedy loop only calls ``reached``): the n-th generated token of every row."""

    def __init__(self, n):
        self.n = n

    def reached(self, ids):
        return len(ids) == self.n


class Uneven:
    """A boundary that rows reach after different numbers of tokens (set by their first id), or never."""

    @staticmethod
    def reached(ids):
        return ids[0] % 4 != 0 and len(ids) == 2 + ids[0] % 4


def build(name, chunk_size=16):
    return constructions.get(name).cache_build(chunk_size)


def settings(max_new_tokens, max_stage_tokens=None, chunk_size=16):
    return DecodeSettings(max_stage_tokens, max_new_tokens, chunk_size)


def free_run(decoder, n, prompt=PROMPT):
    res = decode_rows(decoder, [prompt], matcher=NEVER, max_stage_tokens=n, max_new_tokens=1)[0]
    assert res.stop_reason == "boundary_missing" and len(res.suffix_ids) == n
    return res.suffix_ids


def boundary_at(decoder, n):
    """A matcher whose boundary is the n-th generated token from PROMPT, and the free run it came from."""
    free = free_run(decoder, n + 4)
    marker = free[n - 1]
    return BoundaryMatcher(free[:n].count(marker), token_ids=[marker]), free


def same(a, b):
    """Two results of one row, byte for byte: ids, fp32 margins, boundary-cache fingerprints and layout."""
    return (a.stage_ids, a.suffix_ids, a.margins, a.stop_reason, a.fingerprints, a.pad, a.position) == (
        b.stage_ids, b.suffix_ids, b.margins, b.stop_reason, b.fingerprints, b.pad, b.position)


def logits_bytes(t):
    return t.detach().cpu().numpy().tobytes()


def test_static_forward_matches_the_eager_forward(models):
    """Same function as the Hugging Face forward up to rounding. Tolerance: fp32 logits of a random 3-layer
    model differ by about 1e-7 (masked full-buffer attention and fused RMSNorm round in another order), so
    1e-5 absolute leaves room while catching any wrong mask, position or weight (those give ~1e-1)."""
    model = models["fp32"]
    eager, static = EagerDecoder(model, ()), make_decoder(model, (), "static", max_len=48)
    (be, le), (bs, ls) = eager.open([PROMPT]), static.open([PROMPT])
    assert le.shape == ls.shape == (1, model.config.vocab_size)
    assert torch.allclose(le, ls, rtol=0, atol=1e-5)
    for token in (5, 6, 7):
        le, ls = eager.step(be, [token]), static.step(bs, [token])
        assert torch.allclose(le, ls, rtol=0, atol=1e-5)
    end = len(PROMPT) + 3
    assert [k.shape for k, _ in eager.row_layers(be, 0, end)] == [k.shape for k, _ in static.row_layers(bs, 0, end)]


def test_fusing_weights_leaves_the_eager_regime_bit_identical(tiny_model_dir):
    model = fresh_model(tiny_model_dir, "bf16")
    eager = EagerDecoder(model, ())
    before_batch, before = eager.open([PROMPT])
    before_fp = fingerprint_layers(eager.row_layers(before_batch, 0, len(PROMPT)))
    StaticDecoder(model, (), max_len=32)  # rebinds q/k/v and gate/up weights to fused tensors
    layer = model.model.layers[0]
    fused_qkv, _, fused_gate_up = layer._stagereplay_fused
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == fused_qkv.untyped_storage().data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == fused_gate_up.untyped_storage().data_ptr()
    after_batch, after = eager.open([PROMPT])
    assert logits_bytes(after) == logits_bytes(before)
    assert fingerprint_layers(eager.row_layers(after_batch, 0, len(PROMPT))) == before_fp


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bridge_and_replicas_hold_within_the_static_regime(models, precision):
    decoder = make_decoder(models[precision], (), "static", max_len=48)
    matcher, free = boundary_at(decoder, 8)
    live = decode_rows(decoder, [PROMPT], matcher=matcher, max_stage_tokens=12, max_new_tokens=4, keep={0})[0]
    assert live.stage_ids == free[:8]
    assert all(k.shape[2] == len(PROMPT) + 7 for k, _ in live.layers) and live.position == len(PROMPT) + 7
    # continuing the live cache is the original greedy trajectory
    assert live.stage_ids + live.suffix_ids == free[:12]
    # the bridge: the incremental rebuild is the live cache and continues like it
    incremental = decode_rows(decoder, [PROMPT], stages=[live.stage_ids], build=build("incremental"),
                              max_new_tokens=4, keep={0})[0]
    assert same(incremental, live)
    assert fingerprint_layers(incremental.layers) == fingerprint_layers(live.layers)
    # replicas: two prefills of the same ids, bytes and continuations alike
    a, b = (decode_rows(decoder, [PROMPT], stages=[live.stage_ids], build=build("prefill"), max_new_tokens=6)[0]
            for _ in range(2))
    assert same(a, b) and len(a.suffix_ids) == 6


def test_evicted_batches_come_back_byte_for_byte(models):
    """One working buffer, several batches: a batch evicted by another and made resident again holds the same
    bytes, and two equal batches stepped alternately (a swap at every step) compute the same logits."""
    decoder = make_decoder(models["bf16"], (), "static", max_len=48)
    cached_one = PROMPT + [3, 4]
    one = decoder.build([PROMPT], [cached_one], None)
    f_one = fingerprint_layers(decoder.row_layers(one, 0, len(cached_one)))
    two = decoder.build([PROMPT], [PROMPT + [6]], [[len(PROMPT), 1]])  # evicts `one` from the working buffer
    assert decoder.resident is two and one.store is not None
    f_two = fingerprint_layers(decoder.row_layers(two, 0, len(PROMPT) + 1))
    assert f_one != f_two
    assert fingerprint_layers(decoder.row_layers(one, 0, len(cached_one))) == f_one  # read from its own copy
    again = decoder.build([PROMPT], [cached_one], None)
    for token in (5, 9, 2, 7):
        x, y = decoder.step(one, [token]), decoder.step(again, [token])
        assert logits_bytes(x) == logits_bytes(y)
        decoder.step(two, [token])
    # stepping wrote only new positions: every batch's boundary cache is what it was
    assert fingerprint_layers(decoder.row_layers(one, 0, len(cached_one))) == f_one
    assert fingerprint_layers(decoder.row_layers(two, 0, len(PROMPT) + 1)) == f_two
    end = len(cached_one) + 4
    assert fingerprint_layers(decoder.row_layers(one, 0, end)) == fingerprint_layers(decoder.row_layers(again, 0, end))


def test_transplant_replaces_layers_of_a_static_cache(models):
    decoder = make_decoder(models["fp32"], (), "static", max_len=48)
    stage = [3, 4, 5, 6]
    donor = decode_rows(decoder, [PROMPT], stages=[stage], build=build("prefill"), max_new_tokens=5, keep={0})[0]
    recipient = decode_rows(decoder, [PROMPT], stages=[stage], build=build("incremental"), max_new_tokens=5)[0]
    assert donor.fingerprints != recipient.fingerprints  # fp32 prefill and incremental differ in bits here
    every = TransplantSpec("all", tuple(range(decoder.n_layers)))
    got = decode_rows(decoder, [PROMPT], stages=[stage], build=build("incremental"), max_new_tokens=5, keep={0},
                      edit=transplant_edit(0, every, donor.layers, len(PROMPT)))[0]
    assert got.fingerprints == donor.fingerprints == fingerprint_layers(got.layers)
    assert got.suffix_ids == donor.suffix_ids and got.margins == donor.margins
    # one layer only: the other layers stay the recipient's
    first = decode_rows(decoder, [PROMPT], stages=[stage], build=build("incremental"), max_new_tokens=5,
                        edit=transplant_edit(0, TransplantSpec("single_layers", (0,)), donor.layers, len(PROMPT)))[0]
    assert first.fingerprints[1][0] == donor.fingerprints[1][0] and first.fingerprints[2][0] == donor.fingerprints[2][0]
    assert first.fingerprints[1][1:] == recipient.fingerprints[1][1:]
    wrong = [(k[:, :, :3], v[:, :, :3]) for k, v in donor.layers]
    with pytest.raises(ValueError, match="layer 0"):
        decode_rows(decoder, [PROMPT], stages=[stage], build=build("incremental"), max_new_tokens=5,
                    edit=transplant_edit(0, every, wrong, len(PROMPT)))


def test_regime_errors_are_clear(models):
    with pytest.raises(RegimeError, match="not one of"):
        make_decoder(models["fp32"], (), "compiled", max_len=8)
    with pytest.raises(RegimeError, match="needs max_len"):
        make_decoder(models["fp32"], (), "static")
    with pytest.raises(RegimeError, match=r"decode_attention 'flash' is not one of \['masked', 'triton'\]"):
        make_decoder(models["fp32"], (), "static", max_len=8, attention="flash")
    if not torch.cuda.is_available():
        with pytest.raises(RegimeError, match="CUDA device"):
            make_decoder(models["fp32"], (), "cuda_graph", max_len=8)
    decoder = make_decoder(models["fp32"], (), "static", max_len=12)
    with pytest.raises(ValueError, match="raise decode_max_len"):
        decode_rows(decoder, [PROMPT], stages=[[3]], build=build("prefill"), max_new_tokens=10)
    with pytest.raises(ValueError, match="does not fit the decoder's 1"):
        decoder.open([PROMPT, PROMPT])
    eager = make_decoder(models["fp32"], (), "eager")
    assert isinstance(eager, EagerDecoder) and isinstance(eager, Decoder) and isinstance(decoder, Decoder)
    assert decoder.record() == {"decode_regime": "static", "decode_max_len": 12, "decode_max_rows": 1,
                                "decode_attention": "masked", "decode_prefill_group": None,
                                "decode_kernels": "library"}
    rebuilt = decoder_from_record(models["fp32"], (), decoder.record())
    assert isinstance(rebuilt, StaticDecoder) and rebuilt.record() == decoder.record()
    assert isinstance(decoder_from_record(models["fp32"], (), eager.record()), EagerDecoder)
    with pytest.raises(RegimeError, match="decode_prefill_group 0: a positive number of rows"):
        make_decoder(models["fp32"], (), "static", max_len=8, prefill_group=0)
    with pytest.raises(RegimeError, match="need decode_regime static or cuda_graph"):
        make_decoder(models["fp32"], (), "eager", prefill_group=2)
    with pytest.raises(RegimeError, match="need decode_regime static or cuda_graph"):
        make_decoder(models["fp32"], (), "eager", attention="triton")
    with pytest.raises(RegimeError, match="need decode_regime static or cuda_graph"):
        make_decoder(models["fp32"], (), "eager", kernels="fused")
    with pytest.raises(RegimeError, match=r"decode_kernels 'triton' is not one of \['library', 'fused'\]"):
        make_decoder(models["fp32"], (), "static", max_len=8, kernels="triton")
    if os.environ.get("TRITON_INTERPRET") != "1":  # Triton kernels on a CPU model, outside the interpreter
        with pytest.raises(RegimeError, match="use decode_attention masked there"):
            make_decoder(models["fp32"], (), "static", max_len=8, attention="triton")
        with pytest.raises(RegimeError, match="use decode_kernels library there"):
            make_decoder(models["fp32"], (), "static", max_len=8, kernels="fused")
    assert not decoder.lookahead  # only the cuda_graph regime launches a step before the host reads the last
    assert decoder.span(1) == decoder.span(12) == 12  # every step attends over the whole buffer


def test_batch_plan_is_seeded_and_recorded():
    ids = [f"i{n}" for n in range(7)]
    plan = batch_plan(ids, 3, seed=4)
    assert plan == batch_plan(ids, 3, seed=4)
    assert plan.batches != batch_plan(ids, 3, seed=5).batches
    assert [len(b) for b in plan.batches] == [3, 3, 1]
    assert sorted(i for b in plan.batches for i in b) == sorted(ids)
    assert plan.record()["seed"] == 4 and plan.record()["batch_size"] == 3
    assert BatchPlan.from_record(json.loads(json.dumps(plan.record()))) == plan  # through provenance's JSON
    assert batch_plan(ids, 1, seed=4) is None and BatchPlan.from_record(None) is None
    with pytest.raises(ValueError, match="unique"):
        batch_plan(["a", "a"], 2, 0)
    with pytest.raises(ValueError, match="at least 1"):
        batch_plan(ids, 0, 0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_batched_replicas_and_bridge(models, precision):
    """Rows of one static batch (left-padded): replicas bit-exact; incremental (the live schedule, teacher-forced)
    is the live batch byte for byte; prefill is built in the same layout."""
    decoder = StaticDecoder(models[precision], (), max_len=40, max_rows=4)
    rows = set(range(len(PROMPTS)))
    a, b = (decode_rows(decoder, PROMPTS, matcher=AtLength(5), max_stage_tokens=8, max_new_tokens=6, keep=rows)
            for _ in range(2))
    width = max(len(p) for p in PROMPTS)
    for x, y, prompt in zip(a, b, PROMPTS):
        assert same(x, y) and fingerprint_layers(x.layers) == fingerprint_layers(y.layers) == x.fingerprints
        assert len(x.stage_ids) == 5 and len(x.suffix_ids) == 6
        assert (x.pad, x.position) == (width - len(prompt), width + 4)
    stages = [r.stage_ids for r in a]
    incremental = decode_rows(decoder, PROMPTS, stages=stages, build=build("incremental"), max_new_tokens=6,
                              keep=rows)
    for live, inc, prompt in zip(a, incremental, PROMPTS):
        assert inc.layers[0][0].shape[2] == len(prompt) + 4  # prompt + stage but its last token, padding dropped
        assert same(inc, live) and fingerprint_layers(inc.layers) == fingerprint_layers(live.layers)
    prefill = decode_rows(decoder, PROMPTS, stages=stages, build=build("prefill"), max_new_tokens=6, keep=rows)
    assert [r.layers[0][0].shape[2] for r in prefill] == [len(p) + 4 for p in PROMPTS]
    assert [(r.pad, r.position) for r in prefill] == [(r.pad, r.position) for r in a]  # one layout
    assert all(fingerprint_layers(r.layers) == r.fingerprints for r in prefill)
    if precision == "fp32":  # the built cache really is swapped in: here its bytes are not the live ones
        assert all(p.fingerprints[0] != live.fingerprints[0] for p, live in zip(prefill, a))


class Lockstep:
    """A decoder that runs the lockstep schedule even for one row (the built cache swapped in at the boundary)."""

    def __init__(self, decoder):
        self.inner = decoder
        self.eos_ids, self.n_layers = decoder.eos_ids, decoder.n_layers

    def independent_rows(self, rows):
        return False

    def rows_from_boundaries(self, rows):
        return False

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("regime", ["eager", "static"])
@pytest.mark.parametrize("name", ["prefill", "chunked", "prefix_cached"])
def test_both_schedules_of_the_loop_agree_at_batch_one(models, regime, name):
    """The greedy loop's two schedules are one computation for a row: continuing from the built cache (rows at
    their own positions) and the live schedule with the built cache swapped in at the boundary give the same
    bytes, ids and margins."""
    decoder = make_decoder(models["bf16"], (), regime, max_len=48)
    stage = free_run(decoder, 7)
    own = decode_rows(decoder, [PROMPT], stages=[stage], build=build(name, 4), max_new_tokens=6, keep={0})[0]
    swapped = decode_rows(Lockstep(decoder), [PROMPT], stages=[stage], build=build(name, 4), max_new_tokens=6,
                          keep={0})[0]
    assert same(own, swapped) and fingerprint_layers(own.layers) == fingerprint_layers(swapped.layers)
    incremental = decode_rows(decoder, [PROMPT], stages=[stage], build=build("incremental"), max_new_tokens=6)[0]
    assert (own.pad, own.position) == (incremental.pad, incremental.position) == (0, len(PROMPT) + 6)


@pytest.mark.parametrize("name", ["prefill", "chunked", "incremental", "prefix_cached"])
def test_eager_rows_are_the_same_in_either_schedule(models, name):
    """The eager decoder computes rows apart, so a batch with rows of other stage lengths (one of a single token,
    one without a prefix) gives each row the same bytes in the lockstep schedule as at its own position."""
    decoder = EagerDecoder(models["bf16"], ())
    stages = [[3, 4, 5], None, [6]]
    own = decode_rows(decoder, PROMPTS, stages=stages, build=build(name, 2), max_new_tokens=5)
    swapped = decode_rows(Lockstep(decoder), PROMPTS, stages=stages, build=build(name, 2), max_new_tokens=5)
    assert all(same(a, b) for a, b in zip(own, swapped))
    assert own[1].stop_reason == "no_prefix" and [len(own[r].suffix_ids) for r in (0, 2)] == [5, 5]
    assert [own[r].position for r in (0, 2)] == [len(PROMPTS[0]) + 2, len(PROMPTS[2])]


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_graph_regime_replicas_and_bridge(tiny_model_dir, precision):
    model = fresh_model(tiny_model_dir, precision, "cuda")
    decoder = make_decoder(model, (), "cuda_graph", max_len=48, max_rows=4)
    matcher, free = boundary_at(decoder, 8)
    live = decode_rows(decoder, [PROMPT], matcher=matcher, max_stage_tokens=12, max_new_tokens=4)[0]
    assert live.stage_ids + live.suffix_ids == free[:12]
    incremental = decode_rows(decoder, [PROMPT], stages=[live.stage_ids], build=build("incremental"),
                              max_new_tokens=4)[0]
    assert same(incremental, live)
    a, b = (decode_rows(decoder, [PROMPT], stages=[live.stage_ids], build=build("prefill"), max_new_tokens=4)[0]
            for _ in range(2))
    assert same(a, b)
    # batched rows in the graph regime: replicas bit-exact and the batched bridge
    x, y = (decode_rows(decoder, PROMPTS, matcher=AtLength(5), max_stage_tokens=8, max_new_tokens=6)
            for _ in range(2))
    assert all(same(r, s) and len(r.suffix_ids) == 6 for r, s in zip(x, y))
    forced = decode_rows(decoder, PROMPTS, stages=[r.stage_ids for r in x], build=build("incremental"),
                         max_new_tokens=6)
    assert all(same(r, s) for r, s in zip(forced, x))
    assert len(decoder.graphs) >= 2  # one graph per row count, replayed


def reconstruct(items, out, **kwargs):
    from stagereplay.stages.reconstruct import reconstruct_prefixes
    from stagereplay.stages.settings import ReconstructSettings

    common = dict(model=str(REPO / "data/toy"), revision="primary", precision="bf16",
                  boundary={"marker": ";", "occurrence": 1}, max_stage_tokens=24, max_new_tokens=12, device="cpu",
                  attn_implementation="sdpa", decode_regime="static", progress=False, bridge={"n_rows": 0, "seed": 0})
    reconstruct_prefixes(str(items), str(out), str(out.with_name(out.stem + "_p.parquet")),
                         str(out.with_name(out.stem + "_b.parquet")), ReconstructSettings(**{**common, **kwargs}))


def test_pipeline_stage_records_the_regime(tmp_path):
    from stagereplay.io.parquet import read_parquet, read_provenance
    from stagereplay.io.provenance import recorded_regime
    from stagereplay.stages.select import select_items

    items = tmp_path / "items.parquet"
    select_items({"source": "synthetic", "size": 50, "seed": 0}, 3, 0, str(items))
    ledger = tmp_path / "ledger.parquet"
    reconstruct(items, ledger)
    df = read_parquet(ledger)
    assert set(df["decode_regime"]) == {"static"}
    assert (df["status"] == "ok").any()  # the replica checks ran on real boundaries
    prov = read_provenance(ledger)
    assert prov["decode_regime"] == "static" and prov["config"]["decode_regime"] == "static"
    assert prov["decode_max_len"] >= 24 + 12
    assert recorded_regime(ledger)["decode_max_len"] == prov["decode_max_len"]


def test_benchmark_script_runs_every_section(tmp_path):
    bench = load_bench("benchmark")
    bench.main(["--tiny", "--out", str(tmp_path), "--precisions", "bf16"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert not results["errors"]
    assert results["decode"] and results["projection"] and results["bridge"] and results["projected"]["total_s"] > 0
    assert all(b["live_equals_incremental"] and b["prefill_replicas_equal"] for b in results["bridge"])
    assert results["decode"][0]["batch_control"]["replicas_equal"]
    assert "random weights" in (tmp_path / "results.md").read_text()


def test_pipeline_stage_runs_batched_with_a_recorded_plan(tmp_path):
    import pandas as pd

    from stagereplay.io.parquet import read_parquet, read_provenance
    from stagereplay.stages.select import select_items

    items = tmp_path / "items.parquet"
    select_items({"source": "synthetic", "size": 50, "seed": 0}, 5, 0, str(items))
    for name, shards in (("a", 1), ("b", 2)):
        for shard in range(shards):
            reconstruct(items, tmp_path / f"{name}{shard}.parquet", batch_size=2, shard=shard, n_shards=shards)
    one = read_parquet(tmp_path / "a0.parquet")
    two = pd.concat([read_parquet(tmp_path / f"b{s}.parquet") for s in range(2)], ignore_index=True)
    assert len(one) == len(two) and (one["status"] == "ok").any()
    assert sorted(one["batch_rows"].unique()) == [1, 2]  # 5 items in batches of 2
    key = ["item_index", "construction", "replica"]
    one, two = one.sort_values(key).reset_index(drop=True), two.sort_values(key).reset_index(drop=True)
    for col in ("suffix_fingerprint", "cache_fingerprint", "batch_index", "batch_row", "layout_pad",
                "layout_position"):
        assert list(one[col]) == list(two[col])  # the shard count changes nothing
    plan = read_provenance(tmp_path / "a0.parquet")["batch_plan"]
    assert plan["batch_size"] == 2 and sorted(i for b in plan["batches"] for i in b) == sorted(one["item_id"].unique())
    with pytest.raises(ValueError, match="decode_regime"):
        reconstruct(items, tmp_path / "x.parquet", batch_size=2, decode_regime="eager")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_forced_batch_is_the_live_batch_byte_for_byte(models, precision):
    """The batched bridge: stage ids teacher-forced in the live run's batched schedule give the live rows' caches
    and suffixes, whatever each row's stage length; a row without a prefix is filler and takes no part."""
    decoder = StaticDecoder(models[precision], (), max_len=48, max_rows=4)
    prompts = PROMPTS + [PROMPT[1:7]]
    rows = set(range(len(prompts)))
    live = decode_rows(decoder, prompts, matcher=Uneven(), max_stage_tokens=10, max_new_tokens=6, keep=rows)
    stages = [r.stage_ids or None for r in live]
    assert len({len(s) for s in stages if s}) > 1  # rows reach their boundary at different steps
    assert None in stages  # and one never does: it is filler in the forced run
    forced = decode_rows(decoder, prompts, stages=stages, build=build("incremental"), max_new_tokens=6, keep=rows)
    for r, res in enumerate(forced):
        if stages[r] is None:
            assert res.stop_reason == "no_prefix" and res.stage_ids == [] and res.fingerprints is None
            continue
        assert same(res, live[r]) and fingerprint_layers(res.layers) == fingerprint_layers(live[r].layers)
    # a forced stage that differs from the live one is not the live row (the check can fail)
    changed = [list(s) if s else None for s in stages]
    r0 = next(r for r, s in enumerate(changed) if s)
    changed[r0][0] = (changed[r0][0] + 1) % 19
    other = decode_rows(decoder, prompts, stages=changed, build=build("incremental"), max_new_tokens=6)
    assert other[r0].fingerprints != live[r0].fingerprints
    with pytest.raises(ValueError, match="give None"):
        decode_rows(decoder, prompts, stages=[[], None, None, None], build=build("incremental"), max_new_tokens=6)


@pytest.mark.parametrize("construction", ["live", "incremental", "prefill"])
def test_rows_can_keep_fingerprints_only(models, construction):
    """keep: every row has its boundary cache's fingerprints, only the named rows a copy of the cache (a
    paper-scale batch cannot hold a copy per row, replica and construction); the fingerprints are those of the
    copies that a full keep makes."""
    decoder = StaticDecoder(models["fp32"], (), max_len=48, max_rows=4)
    live = decode_rows(decoder, PROMPTS, matcher=Uneven(), max_stage_tokens=10, max_new_tokens=6)
    stages = [r.stage_ids or None for r in live]

    def go(keep):
        if construction == "live":
            return decode_rows(decoder, PROMPTS, matcher=Uneven(), max_stage_tokens=10, max_new_tokens=6, keep=keep)
        return decode_rows(decoder, PROMPTS, stages=stages, build=build(construction), max_new_tokens=6, keep=keep)

    full, slim = go(set(range(len(PROMPTS)))), go({0})
    kept = [r for r, res in enumerate(full) if res.stage_ids]
    assert 0 in kept and len(kept) > 1
    for r in kept:
        assert full[r].layers is not None
        assert slim[r].fingerprints == fingerprint_layers(full[r].layers) == full[r].fingerprints
        assert (slim[r].layers is not None) == (r == 0)
        assert slim[r].suffix_ids == full[r].suffix_ids
    assert fingerprint_layers(slim[0].layers) == slim[0].fingerprints


def test_a_row_without_a_prefix_is_left_out_and_changes_no_other_row(models):
    decoder = StaticDecoder(models["bf16"], (), max_len=48, max_rows=4)
    s = settings(5)
    stages = [[3, 4, 5], None, [6, 7]]
    got = run(decoder, "prefill", PROMPTS, s, stages=stages)
    assert got[1].stop_reason == "no_prefix" and got[1].stage_ids == got[1].suffix_ids == []
    assert got[1].fingerprints is None
    assert all(got[r].stage_ids == stages[r] and len(got[r].suffix_ids) == 5 for r in (0, 2))
    # the filler row's values play no part: give it a prefix and rows 0 and 2 keep every bit
    filled = run(decoder, "prefill", PROMPTS, s, stages=[stages[0], [8, 9], stages[2]])
    assert filled[1].stage_ids == [8, 9]
    assert all(same(got[r], filled[r]) for r in (0, 2))
    with pytest.raises(ValueError, match="cannot be given stage ids"):
        run(decoder, "live", PROMPTS, s, stages=stages)
    with pytest.raises(ValueError, match="cannot be rebuilt"):
        constructions.get("live").cache_build()


def test_shard_batches_and_the_recorded_plan(tmp_path):
    import pandas as pd

    from stagereplay.io.parquet import write_parquet
    from stagereplay.io.provenance import recorded_batch_plan

    ids = [f"i{n}" for n in range(9)]
    items = [{"item_index": n, "item_id": i} for n, i in enumerate(ids)]
    plan = batch_plan(ids, 2, seed=3)
    shards = [batches_of(items, plan, s, 2) for s in range(2)]
    assert [[b.index for b in shard] for shard in shards] == [[0, 2, 4], [1, 3]]
    assert [tuple(i["item_id"] for i in b.items) for b in shards[1]] == [plan.batches[1], plan.batches[3]]
    assert shards[0][0].layout_fields(1) == {"batch_index": 0, "batch_row": 1, "batch_rows": 2}
    alone = batches_of(items, None, 1, 2)  # no plan: this shard's items, each alone, in item order
    assert [(b.index, [i["item_index"] for i in b.items]) for b in alone] == [(None, [n]) for n in (1, 3, 5, 7)]
    assert alone[0].layout_fields(0) == {"batch_index": None, "batch_row": None, "batch_rows": None}
    with pytest.raises(KeyError, match="rerun reconstruct_prefixes"):
        batches_of(items[:-1], plan)
    frame = pd.DataFrame({"x": [1]})
    write_parquet(frame, tmp_path / "one.parquet", {"batch_plan": plan.record()})
    assert BatchPlan.from_record(recorded_batch_plan(tmp_path / "one.parquet")) == plan
    write_parquet(frame, tmp_path / "batch1.parquet", {"batch_plan": None, "parts": [{"batch_plan": None}]})
    assert recorded_batch_plan(tmp_path / "batch1.parquet") is None
    other = batch_plan(ids, 2, seed=4).record()
    write_parquet(frame, tmp_path / "mixed.parquet", {"parts": [{"batch_plan": plan.record()},
                                                                {"batch_plan": other}]})
    with pytest.raises(ValueError, match="2 different batch plans"):
        recorded_batch_plan(tmp_path / "mixed.parquet")


def test_compare_alone_finds_each_difference():
    from stagereplay.stages.controls import compare_alone

    row = {"status": "ok", "stage_ids": [1, 2], "suffix_ids": [3, 4, 5], "cache_fingerprint": "a", "correct": True}
    same_row = compare_alone(row, dict(row))
    assert same_row["cache_equal"] and same_row["suffix_equal"] and same_row["label_equal"]
    assert same_row["first_divergence"] is None
    moved = compare_alone(row, {**row, "suffix_ids": [3, 9, 5], "cache_fingerprint": "b", "correct": False})
    assert not moved["cache_equal"] and moved["stage_equal"] and not moved["suffix_equal"]
    assert moved["first_divergence"] == 2 + 1 and not moved["label_equal"]
    missing = compare_alone({**row, "cache_fingerprint": "", "correct": None},
                            {**row, "cache_fingerprint": "", "correct": None})
    assert missing["cache_equal"] is None and missing["label_equal"]  # no cache is never "identical"


def test_a_transplant_inside_a_batch_swaps_one_row_and_leaves_the_others(models):
    """A transplant inside a batch: with a row's own layers, its continuation is the one it has in its batch; with
    another construction's layers, the row's boundary cache is those layers, byte for byte; other rows keep
    their own bits."""
    decoder = StaticDecoder(models["fp32"], (), max_len=48, max_rows=4)
    s = settings(5)
    stages = [[3, 4, 5], None, [6, 7, 8, 9]]
    every = TransplantSpec("all", tuple(range(decoder.n_layers)))
    built = {c: run(decoder, c, PROMPTS, s, stages=stages, keep={0, 2}) for c in ("incremental", "prefill")}
    for construction, rows in built.items():
        for r in (0, 2):
            again = run(decoder, construction, PROMPTS, s, stages=stages, keep={r},
                        edit=transplant_edit(r, every, rows[r].layers, len(PROMPTS[r])))
            assert all(same(x, y) for x, y in zip(again, rows))
            assert fingerprint_layers(again[r].layers) == fingerprint_layers(rows[r].layers)
    donor = built["incremental"][2].layers
    assert fingerprint_layers(donor) != fingerprint_layers(built["prefill"][2].layers)
    swapped = run(decoder, "prefill", PROMPTS, s, stages=stages, keep={2},
                  edit=transplant_edit(2, every, donor, len(PROMPTS[2])))
    assert swapped[2].fingerprints == fingerprint_layers(donor) == fingerprint_layers(swapped[2].layers)
    assert same(swapped[0], built["prefill"][0])  # the other row is untouched
    back = run(decoder, "incremental", PROMPTS, s, stages=stages,
               edit=transplant_edit(2, every, built["prefill"][2].layers, len(PROMPTS[2])))
    assert back[2].fingerprints == built["prefill"][2].fingerprints
    with pytest.raises(ValueError, match="do not match"):  # row 2's cache does not fit row 0
        run(decoder, "prefill", PROMPTS, s, stages=stages, edit=transplant_edit(0, every, donor, len(PROMPTS[0])))


class Feeding:
    """A decoder as the loop sees it that computes every step (its ``advance`` declines), counting the steps."""

    def __init__(self, decoder, skips=False):
        self.inner, self.skips, self.steps = decoder, skips, 0
        self.eos_ids, self.n_layers = decoder.eos_ids, decoder.n_layers

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def advance(self, batch, steps):
        return self.skips and self.inner.advance(batch, steps)

    def step(self, batch, tokens):
        self.steps += 1
        return self.inner.step(batch, tokens)


@pytest.mark.parametrize("name", ["prefill", "chunked", "prefix_cached", "incremental"])
def test_a_construction_skips_the_steps_before_its_first_boundary(models, name):
    """In the lockstep schedule a built construction's rows are teacher-forced up to the batch's first boundary
    and every row's cache is replaced at its own: those steps are skipped, and every row comes out as when they
    are computed, byte for byte. The live schedule's own construction (incremental) computes them."""
    decoder = StaticDecoder(models["bf16"], (), max_len=48, max_rows=4, suffix_schedule=False)  # lockstep
    stages = [[3, 4, 5], None, [6, 7, 8, 9, 10]]
    keep = {0, 2}
    fed, skipped = Feeding(decoder), Feeding(decoder, skips=True)
    computed = decode_rows(fed, PROMPTS, stages=stages, build=build(name, 2), max_new_tokens=5, keep=keep)
    rows = decode_rows(skipped, PROMPTS, stages=stages, build=build(name, 2), max_new_tokens=5, keep=keep)
    for a, b in zip(computed, rows):
        assert same(a, b)
        assert (a.layers is None) == (b.layers is None)
        assert a.layers is None or fingerprint_layers(a.layers) == fingerprint_layers(b.layers)
    # the boundaries come at iterations 2 and 4; the last row's fifth suffix id ends the loop at iteration 9
    assert fed.steps == 9
    assert skipped.steps == (9 if name == "incremental" else 7)
    decoder.suffix_schedule = True  # from the boundaries: the pending tokens, then four steps; the same rows
    suffix = Feeding(decoder)
    for a, b in zip(computed, decode_rows(suffix, PROMPTS, stages=stages, build=build(name, 2), max_new_tokens=5,
                                          keep=keep)):
        assert same(a, b)
    assert suffix.steps == (9 if name == "incremental" else 5)
