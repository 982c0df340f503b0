"""The static / cuda_graph decode regimes: exactness within the regime, batching, and the pipeline switch.

CPU runs the ``static`` regime (the same forward the CUDA graph captures, executed eagerly); tests of the graph
itself need a CUDA device and are skipped without one.
"""

import copy
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from stagereplay.models import compat
from stagereplay import fastdecode as fd
from stagereplay.engine import BoundaryMatcher, Decoder, build_cache, continue_greedy, generate_to_boundary
from stagereplay.io.fingerprints import fingerprint_layers

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]
REPO = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the cuda_graph regime captures a CUDA graph: needs a CUDA device")


def fp(cache):
    return fingerprint_layers(compat.cache_layers(cache))


def fresh_model(tiny_model_dir, precision, device="cpu"):
    """A private copy: the static decoder rebinds weights to fused tensors, which session fixtures must not see."""
    from stagereplay.models.loading import ModelSource, load_model

    return load_model(ModelSource("local", str(tiny_model_dir)), precision, device).model


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from stagereplay.models.loading import set_determinism

    set_determinism(1)
    return {p: fresh_model(tiny_model_dir, p) for p in ("fp32", "bf16")}


def boundary_at(decoder, n):
    """A matcher whose boundary is the n-th generated token from PROMPT."""
    free = generate_to_boundary(decoder, PROMPT, BoundaryMatcher(1, token_ids=[10_000]), n + 4).generated_ids
    marker = free[n - 1]
    return BoundaryMatcher(free[:n].count(marker), token_ids=[marker]), free


def test_static_forward_matches_the_eager_forward(models):
    """Same function as the Hugging Face forward up to rounding. Tolerance: fp32 logits of a random 3-layer
    model differ by about 1e-7 (masked full-buffer attention and fused RMSNorm round in another order), so
    1e-5 absolute leaves room while catching any wrong mask, position or weight (those give ~1e-1)."""
    model = models["fp32"]
    eager, static = Decoder(model, ()), fd.make_decoder(model, (), "static", max_len=48)
    ce, cs = eager.new_cache(), static.new_cache()
    le, ls = eager.forward(PROMPT, ce), static.forward(PROMPT, cs)
    assert torch.allclose(le, ls, rtol=0, atol=1e-5)
    for token in (5, 6, 7):
        le, ls = eager.forward([token], ce), static.forward([token], cs)
        assert torch.allclose(le, ls, rtol=0, atol=1e-5)
    assert [k.shape for k, _ in compat.cache_layers(ce)] == [k.shape for k, _ in compat.cache_layers(cs)]


def test_fusing_weights_leaves_the_eager_regime_bit_identical(tiny_model_dir):
    model = fresh_model(tiny_model_dir, "bf16")
    eager = Decoder(model, ())
    before_cache = eager.new_cache()
    before = eager.forward(PROMPT, before_cache)
    fd.StaticDecoder(model, (), max_len=32)  # rebinds q/k/v and gate/up weights to fused tensors
    layer = model.model.layers[0]
    fused_qkv, _, fused_gate_up = layer._stagereplay_fused
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == fused_qkv.untyped_storage().data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == fused_gate_up.untyped_storage().data_ptr()
    after_cache = eager.new_cache()
    after = eager.forward(PROMPT, after_cache)
    assert after.numpy().tobytes() == before.numpy().tobytes()
    assert fp(after_cache) == fp(before_cache)


@pytest.mark.parametrize("precision,bucket", [("fp32", None), ("bf16", None), ("fp32", 4), ("bf16", 4)])
def test_bridge_and_replicas_hold_within_the_static_regime(models, precision, bucket):
    """With a bucket, the attended span changes along the run (every 4 positions): still exact, because a
    span depends on the position alone."""
    decoder = fd.make_decoder(models[precision], (), "static", max_len=48, bucket=bucket)
    matcher, free = boundary_at(decoder, 8)
    live = generate_to_boundary(decoder, PROMPT, matcher, 12)
    assert live.status == "ok" and live.stage_ids == free[:8]
    assert compat.cache_length(live.cache) == len(PROMPT) + 7
    assert fp(build_cache(decoder, "incremental", PROMPT, live.stage_ids)) == fp(live.cache)
    a, b = (build_cache(decoder, "prefill", PROMPT, live.stage_ids) for _ in range(2))
    assert fp(a) == fp(b)
    ca, cb = (continue_greedy(decoder, c, live.stage_ids[-1], 6) for c in (a, b))
    assert ca.suffix_ids == cb.suffix_ids and ca.margins == cb.margins
    # continuing the live cache is the original greedy trajectory
    cont = continue_greedy(decoder, live.cache, live.stage_ids[-1], 4)
    assert live.stage_ids + cont.suffix_ids == free[:12]


def test_copies_and_swaps_leave_caches_untouched(models):
    decoder = fd.make_decoder(models["bf16"], (), "static", max_len=48)
    one = build_cache(decoder, "prefill", PROMPT, [3, 4, 5])
    two = build_cache(decoder, "incremental", PROMPT, [6, 7])  # evicts `one` from the working buffer
    f_one, f_two = fp(one), fp(two)
    continue_greedy(decoder, one, 5, 5)
    continue_greedy(decoder, two, 7, 5)
    assert fp(one) == f_one and fp(two) == f_two
    clone = copy.deepcopy(one)
    assert fp(clone) == f_one
    assert continue_greedy(decoder, clone, 5, 5).suffix_ids == continue_greedy(decoder, one, 5, 5).suffix_ids


def test_transplant_replaces_layers_of_a_static_cache(models):
    decoder = fd.make_decoder(models["fp32"], (), "static", max_len=48)
    stage = [3, 4, 5, 6]
    donor = build_cache(decoder, "prefill", PROMPT, stage)
    recipient = build_cache(decoder, "incremental", PROMPT, stage)
    assert fp(donor) != fp(recipient)  # fp32 prefill and incremental differ in bits here (see the bridge tests)
    for i, (k, v) in enumerate(compat.cache_layers(donor)):
        compat.set_cache_layer(recipient, i, keys=k, values=v)
    assert fp(recipient) == fp(donor)
    got = continue_greedy(decoder, recipient, stage[-1], 5)
    want = continue_greedy(decoder, donor, stage[-1], 5)
    assert got.suffix_ids == want.suffix_ids and got.margins == want.margins
    with pytest.raises(ValueError, match="layer 0"):
        compat.set_cache_layer(recipient, 0, keys=torch.zeros(1, 2, 3, 16))


def test_regime_errors_are_clear(models):
    with pytest.raises(fd.RegimeError, match="not one of"):
        fd.make_decoder(models["fp32"], (), "compiled", max_len=8)
    with pytest.raises(fd.RegimeError, match="needs max_len"):
        fd.make_decoder(models["fp32"], (), "static")
    with pytest.raises(fd.RegimeError, match=r"decode_attention 'flash' is not one of \['masked', 'triton'\]"):
        fd.make_decoder(models["fp32"], (), "static", max_len=8, attention="flash")
    with pytest.raises(fd.RegimeError, match="decode_bucket has no effect"):
        fd.make_decoder(models["fp32"], (), "static", max_len=8, bucket=4, attention="triton")
    if not torch.cuda.is_available():
        with pytest.raises(fd.RegimeError, match="CUDA device"):
            fd.make_decoder(models["fp32"], (), "cuda_graph", max_len=8)
    decoder = fd.make_decoder(models["fp32"], (), "static", max_len=12)
    with pytest.raises(ValueError, match="raise decode_max_len"):
        continue_greedy(decoder, build_cache(decoder, "prefill", PROMPT, [3]), 3, 10)
    assert isinstance(fd.make_decoder(models["fp32"], (), "eager"), Decoder)
    assert fd.regime_info(decoder) == {"decode_regime": "static", "decode_max_len": 12, "decode_max_rows": 1,
                                       "decode_bucket": None, "decode_attention": "masked",
                                       "decode_prefill_group": None}
    with pytest.raises(fd.RegimeError, match="decode_prefill_group 0: a positive number of rows"):
        fd.make_decoder(models["fp32"], (), "static", max_len=8, prefill_group=0)
    with pytest.raises(fd.RegimeError, match="need decode_regime static or cuda_graph"):
        fd.make_decoder(models["fp32"], (), "eager", prefill_group=2)
    with pytest.raises(fd.RegimeError, match="need decode_regime static or cuda_graph"):
        fd.make_decoder(models["fp32"], (), "eager", attention="triton")
    if os.environ.get("TRITON_INTERPRET") != "1":  # the triton attention on a CPU model, outside the interpreter
        with pytest.raises(fd.RegimeError, match="use decode_attention masked there"):
            fd.make_decoder(models["fp32"], (), "static", max_len=8, attention="triton")
    bucketed = fd.make_decoder(models["fp32"], (), "static", max_len=12, bucket=5)
    assert [bucketed.span(e) for e in (1, 5, 6, 11, 12)] == [5, 5, 10, 12, 12]


def test_batch_plan_is_seeded_and_recorded():
    ids = [f"i{n}" for n in range(7)]
    plan = fd.batch_plan(ids, 3, seed=4)
    assert plan == fd.batch_plan(ids, 3, seed=4)
    assert plan.batches != fd.batch_plan(ids, 3, seed=5).batches
    assert [len(b) for b in plan.batches] == [3, 3, 1]
    assert sorted(i for b in plan.batches for i in b) == sorted(ids)
    records = plan.records()
    assert {r["item_id"] for r in records} == set(ids) and all(r["batch_seed"] == 4 for r in records)
    with pytest.raises(ValueError, match="unique"):
        fd.batch_plan(["a", "a"], 2, 0)


PROMPTS = [PROMPT, PROMPT[:5], PROMPT[2:] + [3, 4]]  # three lengths: rows get different left padding


def stage_of(n):
    return lambda ids: len(ids) == n


@pytest.mark.parametrize("precision,bucket", [("fp32", None), ("bf16", None), ("bf16", 8)])
def test_batched_replicas_and_bridge(models, precision, bucket):
    decoder = fd.StaticDecoder(models[precision], (), max_len=40, max_rows=4, bucket=bucket)
    a = fd.generate_batch(decoder, PROMPTS, stage_of(5), 8, 6)
    b = fd.generate_batch(decoder, PROMPTS, stage_of(5), 8, 6)
    for x, y in zip(a, b):
        assert x.stage_ids == y.stage_ids and x.suffix_ids == y.suffix_ids and x.margins == y.margins
        assert fingerprint_layers(x.cache_layers) == fingerprint_layers(y.cache_layers)
        assert len(x.stage_ids) == 5 and len(x.suffix_ids) == 6
    cache, ends = fd.build_batch(decoder, "incremental", PROMPTS, [r.stage_ids for r in a])
    for live, inc, prompt in zip(a, fd.row_caches(cache, ends), PROMPTS):
        assert inc[0][0].shape[2] == len(prompt) + 4  # prompt + stage but its last token, padding dropped
        assert fingerprint_layers(inc) == fingerprint_layers(live.cache_layers)
    pcache, pends = fd.build_batch(decoder, "prefill", PROMPTS, [r.stage_ids for r in a])
    assert [r[0][0].shape[2] for r in fd.row_caches(pcache, pends)] == [len(p) + 4 for p in PROMPTS]
    suffixes = fd.continue_batch(decoder, cache, [r.stage_ids[-1] for r in a], 6)
    assert [s for s, _, _ in suffixes] == [r.suffix_ids for r in a]  # incremental continues like live


def test_batch_invariance_control_reports_each_sampled_row(models):
    decoder = fd.StaticDecoder(models["fp32"], (), max_len=40, max_rows=4)
    batched = fd.generate_batch(decoder, PROMPTS, stage_of(4), 8, 5)
    records = fd.batch_invariance(decoder, PROMPTS, batched, stage_of(4), 8, 5, sample=2, seed=0)
    assert len(records) == 2 and len({r["row"] for r in records}) == 2
    for r in records:
        alone = fd.generate_batch(decoder, [PROMPTS[r["row"]]], stage_of(4), 8, 5)[0]
        assert r["suffix_equal"] == (alone.suffix_ids == batched[r["row"]].suffix_ids)
        assert r["cache_equal"] == (fingerprint_layers(alone.cache_layers) ==
                                    fingerprint_layers(batched[r["row"]].cache_layers))
    # a planted disagreement is found, with its position in stage + suffix
    alone = [fd.generate_batch(decoder, [PROMPTS[0]], stage_of(4), 8, 5)[0]]
    planted = copy.deepcopy(alone)
    planted[0].suffix_ids[2] += 1
    assert fd.compare_rows(alone, alone, [0])[0]["suffix_equal"]
    changed = fd.compare_rows(planted, alone, [0])[0]
    assert not changed["suffix_equal"] and changed["cache_equal"] and changed["suffix_first_divergence"] == 4 + 2


@needs_cuda
@pytest.mark.parametrize("precision,bucket", [("fp32", None), ("bf16", None), ("bf16", 8)])
def test_cuda_graph_regime_replicas_and_bridge(tiny_model_dir, precision, bucket):
    model = fresh_model(tiny_model_dir, precision, "cuda")
    decoder = fd.make_decoder(model, (), "cuda_graph", max_len=48, max_rows=4, bucket=bucket)
    matcher, free = boundary_at(decoder, 8)
    live = generate_to_boundary(decoder, PROMPT, matcher, 12)
    assert fp(build_cache(decoder, "incremental", PROMPT, live.stage_ids)) == fp(live.cache)
    assert fp(build_cache(decoder, "prefill", PROMPT, live.stage_ids)) == \
        fp(build_cache(decoder, "prefill", PROMPT, live.stage_ids))
    a = fd.generate_batch(decoder, PROMPTS, stage_of(5), 8, 6)
    b = fd.generate_batch(decoder, PROMPTS, stage_of(5), 8, 6)
    assert all(fingerprint_layers(x.cache_layers) == fingerprint_layers(y.cache_layers)
               and x.suffix_ids == y.suffix_ids for x, y in zip(a, b))


def test_pipeline_stage_records_the_regime(tmp_path):
    from stagereplay.io.parquet import read_parquet, read_provenance
    from stagereplay.stages import reconstruct_prefixes, select_items

    items = tmp_path / "items.parquet"
    select_items({"source": "synthetic", "size": 50, "seed": 0}, 3, 0, str(items))
    ledger, prefixes = tmp_path / "ledger.parquet", tmp_path / "prefixes.parquet"
    reconstruct_prefixes(str(items), str(ledger), str(prefixes), model=str(REPO / "data/toy"), revision="primary",
                         precision="bf16", boundary={"marker": ";", "occurrence": 1}, max_stage_tokens=24,
                         max_new_tokens=12, device="cpu", attn_implementation="sdpa", decode_regime="static",
                         progress=False)
    df = read_parquet(ledger)
    assert set(df["decode_regime"]) == {"static"}
    assert (df["status"] == "ok").any()  # the replica checks ran on real boundaries
    prov = read_provenance(ledger)
    assert prov["decode_regime"] == "static" and prov["config"]["decode_regime"] == "static"
    assert prov["decode_max_len"] >= 24 + 12


def test_benchmark_script_runs_every_section(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmark", REPO / "bench/benchmark.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--tiny", "--out", str(tmp_path), "--precisions", "bf16"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert not results["errors"]
    assert results["decode"] and results["projection"] and results["bridge"] and results["projected"]["total_s"] > 0
    assert all(b["live_equals_incremental"] and b["prefill_replicas_equal"] for b in results["bridge"])
    assert results["decode"][0]["batch_control"]["replicas_equal"]
    assert "random weights" in (tmp_path / "results.md").read_text()


def test_generate_batch_of_one_row_is_the_engine_path(models):
    """At batch 1, the batched live run and the engine's generate_to_boundary + continue_greedy are one schedule."""
    decoder = fd.make_decoder(models["bf16"], (), "static", max_len=48)
    matcher, _ = boundary_at(decoder, 6)
    live = generate_to_boundary(decoder, PROMPT, matcher, 10)
    cont = continue_greedy(decoder, live.cache, live.stage_ids[-1], 5)
    row = fd.generate_batch(decoder, [PROMPT], matcher.reached, 10, 5)[0]
    assert row.stage_ids == live.stage_ids and row.suffix_ids == cont.suffix_ids and row.margins == cont.margins
    assert fingerprint_layers(row.cache_layers) == fp(live.cache)


def test_pipeline_stage_runs_batched_with_a_recorded_plan(tmp_path):
    from stagereplay.io.parquet import read_parquet, read_provenance
    from stagereplay.stages import reconstruct_prefixes, select_items

    items = tmp_path / "items.parquet"
    select_items({"source": "synthetic", "size": 50, "seed": 0}, 5, 0, str(items))
    common = dict(model=str(REPO / "data/toy"), revision="primary", precision="bf16",
                  boundary={"marker": ";", "occurrence": 1}, max_stage_tokens=24, max_new_tokens=12, device="cpu",
                  attn_implementation="sdpa", decode_regime="static", progress=False)
    for name, shards in (("a", 1), ("b", 2)):
        for shard in range(shards):
            reconstruct_prefixes(str(items), str(tmp_path / f"{name}{shard}.parquet"),
                                 str(tmp_path / f"{name}{shard}_p.parquet"), batch_size=2, shard=shard,
                                 n_shards=shards, **common)
    one = read_parquet(tmp_path / "a0.parquet")
    two = pd_concat([read_parquet(tmp_path / f"b{s}.parquet") for s in range(2)])
    assert len(one) == len(two) and (one["status"] == "ok").any()
    assert sorted(one["batch_rows"].unique()) == [1, 2]  # 5 items in batches of 2
    key = ["item_index", "construction", "replica"]
    one, two = one.sort_values(key).reset_index(drop=True), two.sort_values(key).reset_index(drop=True)
    for col in ("suffix_fingerprint", "cache_fingerprint", "batch_index", "batch_row"):
        assert list(one[col]) == list(two[col])  # the shard count changes nothing
    plan = read_provenance(tmp_path / "a0.parquet")["batch_plan"]
    assert plan["batch_size"] == 2 and sorted(i for b in plan["batches"] for i in b) == sorted(one["item_id"].unique())
    with pytest.raises(ValueError, match="decode_regime"):
        reconstruct_prefixes(str(items), str(tmp_path / "x.parquet"), str(tmp_path / "y.parquet"), batch_size=2,
                             **{**common, "decode_regime": "eager"})


def pd_concat(frames):
    import pandas as pd

    return pd.concat(frames, ignore_index=True)


def uneven_boundary(ids):
    """A boundary that rows reach after different numbers of tokens (set by their first id), or never."""
    return ids[0] % 4 != 0 and len(ids) == 2 + ids[0] % 4


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_forced_batch_is_the_live_batch_byte_for_byte(models, precision):
    """The batched bridge: stage ids teacher-forced in the live run's batched schedule give the live rows' caches
    and suffixes, whatever each row's stage length; a row without a prefix is filler and takes no part."""
    decoder = fd.StaticDecoder(models[precision], (), max_len=48, max_rows=4)
    prompts = PROMPTS + [PROMPT[1:7]]
    live = fd.generate_batch(decoder, prompts, uneven_boundary, 10, 6)
    stages = [r.stage_ids or None for r in live]
    assert len({len(s) for s in stages if s}) > 1  # rows reach their boundary at different steps
    assert None in stages  # and one never does: it is filler in the forced run
    forced = fd.construct_batch(decoder, "incremental", prompts, stages, 6)
    assert sorted(forced) == [r for r, s in enumerate(stages) if s]
    for r, res in forced.items():
        assert res.stage_ids == live[r].stage_ids and res.suffix_ids == live[r].suffix_ids
        assert res.margins == live[r].margins
        assert fingerprint_layers(res.cache_layers) == fingerprint_layers(live[r].cache_layers)
    # a forced stage that differs from the live one is not the live row (the check can fail)
    changed = [list(s) if s else None for s in stages]
    r0 = next(r for r, s in enumerate(changed) if s)
    changed[r0][0] = (changed[r0][0] + 1) % 19
    other = fd.construct_batch(decoder, "incremental", prompts, changed, 6)
    assert fingerprint_layers(other[r0].cache_layers) != fingerprint_layers(live[r0].cache_layers)
    with pytest.raises(ValueError, match="give None"):
        fd.generate_batch(decoder, prompts, None, 0, 6, forced=[[], None, None, None])


@pytest.mark.parametrize("construction", ["live", "incremental", "prefill"])
def test_rows_can_keep_fingerprints_only(models, construction):
    """keep_rows: every row keeps its boundary cache's fingerprints, only the named rows a copy of the cache (a
    paper-scale batch cannot hold a copy per row, replica and construction); the fingerprints are those of the
    copies that a full keep makes."""
    decoder = fd.StaticDecoder(models["fp32"], (), max_len=48, max_rows=4)
    live = fd.generate_batch(decoder, PROMPTS, uneven_boundary, 10, 6)
    stages = [r.stage_ids or None for r in live]

    def run(keep_rows):
        if construction == "live":
            return dict(enumerate(fd.generate_batch(decoder, PROMPTS, uneven_boundary, 10, 6, keep_rows=keep_rows)))
        return fd.construct_batch(decoder, construction, PROMPTS, stages, 6, keep_rows=keep_rows)

    full, slim = run(None), run({0})
    assert sorted(full) == sorted(slim)
    kept = [r for r in full if full[r].stage_ids]
    assert 0 in kept and len(kept) > 1
    for r in kept:
        assert full[r].fingerprints is None and full[r].cache_layers is not None
        assert slim[r].fingerprints == fingerprint_layers(full[r].cache_layers) == fd.row_fingerprints(full[r])
        assert (slim[r].cache_layers is not None) == (r == 0)
        assert slim[r].suffix_ids == full[r].suffix_ids
    assert fingerprint_layers(slim[0].cache_layers) == slim[0].fingerprints


def test_construct_batch_prefill_leaves_rows_without_a_prefix_out(models):
    decoder = fd.StaticDecoder(models["bf16"], (), max_len=48, max_rows=4)
    stages = [[3, 4, 5], None, [6, 7]]
    got = fd.construct_batch(decoder, "prefill", PROMPTS, stages, 5)
    assert sorted(got) == [0, 2]
    cache, ends = fd.build_batch(decoder, "prefill", [PROMPTS[0], PROMPTS[2]], [stages[0], stages[2]])
    want = fd.row_caches(cache, ends)
    assert [fingerprint_layers(got[r].cache_layers) for r in (0, 2)] == [fingerprint_layers(w) for w in want]
    suffixes = fd.continue_batch(decoder, cache, [5, 7], 5)
    assert [got[0].suffix_ids, got[2].suffix_ids] == [s for s, _, _ in suffixes]
    with pytest.raises(ValueError, match="prefill and incremental"):
        fd.construct_batch(decoder, "live", PROMPTS, stages, 5)


def test_shard_batches_and_the_recorded_plan(tmp_path):
    import pandas as pd

    from stagereplay.io.parquet import write_parquet
    from stagereplay.io.provenance import recorded_batch_plan

    plan = fd.batch_plan([f"i{n}" for n in range(9)], 2, seed=3)
    shards = [fd.shard_batches(plan, s, 2) for s in range(2)]
    assert shards == [[0, 2, 4], [1, 3]]
    frame = pd.DataFrame({"x": [1]})
    write_parquet(frame, tmp_path / "one.parquet", {"batch_plan": fd.plan_record(plan)})
    assert fd.recorded_plan(tmp_path / "one.parquet") == plan
    write_parquet(frame, tmp_path / "batch1.parquet", {"batch_plan": None, "parts": [{"batch_plan": None}]})
    assert fd.recorded_plan(tmp_path / "batch1.parquet") is None
    other = fd.plan_record(fd.batch_plan([f"i{n}" for n in range(9)], 2, seed=4))
    write_parquet(frame, tmp_path / "mixed.parquet", {"parts": [{"batch_plan": fd.plan_record(plan)},
                                                                {"batch_plan": other}]})
    with pytest.raises(ValueError, match="2 different batch plans"):
        recorded_batch_plan(tmp_path / "mixed.parquet")


def test_compare_alone_finds_each_difference():
    from stagereplay.control_stages import compare_alone

    row = {"status": "ok", "stage_ids": [1, 2], "suffix_ids": [3, 4, 5], "cache_fingerprint": "a", "correct": True}
    same = compare_alone(row, dict(row))
    assert same["cache_equal"] and same["suffix_equal"] and same["label_equal"] and same["first_divergence"] is None
    moved = compare_alone(row, {**row, "suffix_ids": [3, 9, 5], "cache_fingerprint": "b", "correct": False})
    assert not moved["cache_equal"] and moved["stage_equal"] and not moved["suffix_equal"]
    assert moved["first_divergence"] == 2 + 1 and not moved["label_equal"]
    missing = compare_alone({**row, "cache_fingerprint": "", "correct": None},
                            {**row, "cache_fingerprint": "", "correct": None})
    assert not missing["cache_equal"] and missing["label_equal"]  # no cache is never "identical"


def test_continue_in_batch_swaps_one_row_and_leaves_the_batch_as_built(models):
    """A transplant inside a batch: with a row's own layers, its continuation is the one it has in its batch; with
    another construction's layers, the row's boundary cache is those layers, byte for byte."""
    decoder = fd.StaticDecoder(models["fp32"], (), max_len=48, max_rows=4)
    stages = [[3, 4, 5], None, [6, 7, 8, 9]]
    built = {c: fd.construct_batch(decoder, c, PROMPTS, stages, 5) for c in ("incremental", "prefill")}
    for construction, rows in built.items():
        for r in (0, 2):
            again = fd.continue_in_batch(decoder, construction, PROMPTS, stages, r, rows[r].cache_layers, 5)
            assert again.suffix_ids == rows[r].suffix_ids and again.margins == rows[r].margins
            assert fingerprint_layers(again.cache_layers) == fingerprint_layers(rows[r].cache_layers)
    donor = built["incremental"][2].cache_layers
    assert fingerprint_layers(donor) != fingerprint_layers(built["prefill"][2].cache_layers)
    swapped = fd.continue_in_batch(decoder, "prefill", PROMPTS, stages, 2, donor, 5)
    assert fingerprint_layers(swapped.cache_layers) == fingerprint_layers(donor)
    back = fd.continue_in_batch(decoder, "incremental", PROMPTS, stages, 2, built["prefill"][2].cache_layers, 5)
    assert fingerprint_layers(back.cache_layers) == fingerprint_layers(built["prefill"][2].cache_layers)
    with pytest.raises(ValueError, match="does not fit"):
        fd.continue_in_batch(decoder, "prefill", PROMPTS, stages, 0, donor, 5)
