"""The invariant numerics regime: per-operation row invariance and byte-identical constructions (CPU, tiny models).

Every "identical" claim here compares bytes or sha256 fingerprints; the one tolerance (the regime against the
default regime's logits) is stated where it is used.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from stagereplay.models import invariant
from stagereplay.decode.eager import EagerDecoder
from stagereplay.io.fingerprints import tensor_bytes
from bench_scripts import load_bench
from invariant_helpers import PROMPT, constructions
from stagereplay.config import schema_file
from stagereplay.models.loading import load_model, set_determinism
from stagereplay.models.sources import ModelLoadError, ModelSource

REPO = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.bfloat16]
KERNELS = invariant.ReferenceKernels()


def rows_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and tensor_bytes(a) == tensor_bytes(b)


def assert_row_invariant(op, n_rows: int):
    """``op(lo, hi)`` computes rows lo..hi-1 together; each row alone must equal it inside every window."""
    alone = [op(i, i + 1) for i in range(n_rows)]
    for size in range(2, n_rows + 1):
        for lo in range(0, n_rows - size + 1):
            together = op(lo, lo + size)
            for i in range(size):
                assert rows_equal(together[i:i + 1], alone[lo + i]), (
                    f"row {lo + i} differs computed alone and inside rows {lo}..{lo + size - 1}")


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_rows_are_invariant(dtype, bias):
    torch.manual_seed(1)
    x, w = randn(9, 96, dtype=dtype), randn(160, 96, dtype=dtype)
    b = randn(160, dtype=dtype) if bias else None
    assert_row_invariant(lambda lo, hi: KERNELS.linear(x[lo:hi], w, b), 9)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rms_norm_and_gated_act_rows_are_invariant(dtype):
    torch.manual_seed(2)
    x, w = randn(9, 64, dtype=dtype) * 3, randn(64, dtype=dtype)
    gate, up = randn(9, 200, dtype=dtype) * 4, randn(9, 200, dtype=dtype)
    assert_row_invariant(lambda lo, hi: KERNELS.rms_norm(x[lo:hi], w, 1e-6), 9)
    assert_row_invariant(lambda lo, hi: KERNELS.gated_act(F.silu, gate[lo:hi], up[lo:hi]), 9)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rotary_rows_are_invariant(dtype):
    torch.manual_seed(3)
    x = randn(9, 4, 16, dtype=dtype)
    angles = torch.arange(9)[:, None] * torch.rand(16) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert_row_invariant(lambda lo, hi: KERNELS.rotary(x[lo:hi], cos[lo:hi], sin[lo:hi]), 9)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block", [1, 4, 64])
def test_attention_row_is_the_same_as_a_decode_step(dtype, block):
    """Row at cache position p inside a prefill of rows lo..hi-1 (cache of hi keys) equals a decode step at p
    (cache of exactly p+1 keys): same key blocks, same order, the same zero-padded partial block."""
    torch.manual_seed(4)
    n, heads, kv, d, past = 11, 4, 2, 16, 3  # grouped-query attention, 3 cached keys before the rows
    q = randn(n, heads, d, dtype=dtype)
    keys, values = randn(kv, past + n, d, dtype=dtype), randn(kv, past + n, d, dtype=dtype)

    def op(lo, hi):
        cache_len = past + hi  # the cache holds every key up to the last row of the call
        return KERNELS.attention(q[lo:hi], keys[:, :cache_len], values[:, :cache_len],
                                 list(range(past + lo, past + hi)), 0.25, block)

    assert_row_invariant(op, n)


def test_the_invariance_check_catches_a_batch_dependent_op():
    torch.manual_seed(5)
    x, w = randn(6, 64, dtype=torch.float32), randn(32, 64, dtype=torch.float32)

    def reorders_when_batched(lo, hi):  # the reduction order depends on the number of rows, as a GEMM's may
        rows = x[lo:hi]
        return rows @ w.T if hi - lo == 1 else (rows.double() @ w.double().T).float()

    with pytest.raises(AssertionError, match="differs computed alone"):
        assert_row_invariant(reorders_when_batched, 6)


def load(tiny_model_dir, precision, numerics="default", block_size=None):
    loaded = load_model(ModelSource("local", str(tiny_model_dir)), precision, "cpu", numerics=numerics)
    if block_size is not None:
        invariant.apply(loaded.model, block_size=block_size)
    return loaded


@pytest.fixture(scope="module")
def invariant_models(tiny_model_dir):
    set_determinism(1)
    return {precision: load(tiny_model_dir, precision, block_size=4) for precision in ("fp32", "bf16")}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_patched_modules_are_row_invariant(invariant_models, precision):
    model = invariant_models[precision].model
    torch.manual_seed(6)
    dtype = next(model.parameters()).dtype
    layer = model.model.layers[1]
    h = randn(1, 7, model.config.hidden_size, dtype=dtype)
    for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.o_proj, layer.mlp.down_proj,
                   layer.input_layernorm, layer.mlp, model.model.norm, model.lm_head):
        width = getattr(module, "in_features", model.config.hidden_size)
        x = h if width == model.config.hidden_size else randn(1, 7, width, dtype=dtype)
        with torch.no_grad():
            assert_row_invariant(lambda lo, hi: module(x[:, lo:hi])[0], 7)
    rotary = model.model.rotary_emb
    positions = torch.arange(300)[None]  # beyond one rotary-table chunk
    cos_all, sin_all = rotary(h, positions)
    cos_one, sin_one = rotary(h, torch.tensor([[299]]))
    assert rows_equal(cos_all[:, 299:], cos_one) and rows_equal(sin_all[:, 299:], sin_one)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_constructions_are_byte_identical_under_the_regime(invariant_models, precision):
    fingerprints, suffixes = constructions(EagerDecoder(invariant_models[precision].model, ()))
    assert len(set(fingerprints.values())) == 1, fingerprints
    assert len({repr(s) for s in suffixes.values()}) == 1  # token ids and fp32 margins alike


def test_constructions_are_byte_identical_with_the_load_model_hook(tiny_model_dir):
    """The config path: ``load_model(numerics="invariant")``, default block size, a boundary past one block."""
    set_determinism(1)
    loaded = load(tiny_model_dir, "bf16", numerics="invariant")
    assert loaded.info["numerics_regime"] == {"numerics": "invariant", "kernels": "reference",
                                              "attention_block_size": invariant.BLOCK_SIZE,
                                              "rotary_chunk": invariant.ROTARY_CHUNK}
    fingerprints, suffixes = constructions(EagerDecoder(loaded.model, ()), n_stage=invariant.BLOCK_SIZE)
    assert len(set(fingerprints.values())) == 1, fingerprints
    assert len({repr(s) for s in suffixes.values()}) == 1


def test_default_regime_constructions_differ(tiny_model_dir):
    """The control: without the regime, a one-shot fp32 prefill is not byte-identical to the live cache here
    (shape-dependent GEMM reduction order), so the test above is not passing for want of a difference."""
    set_determinism(1)
    loaded = load(tiny_model_dir, "fp32")
    assert loaded.info["numerics_regime"] == {"numerics": "default"}
    fingerprints, _ = constructions(EagerDecoder(loaded.model, ()))
    assert fingerprints["live"] == fingerprints["incremental"]
    assert fingerprints["prefill"] != fingerprints["live"]


def test_the_regime_computes_the_same_model(tiny_model_dir, invariant_models):
    """Same model, other reduction order: fp32 logits within 1e-5 of the default regime (fp32 rounding of
    sums over at most a few hundred terms of size ~1) and the same greedy choices."""
    set_determinism(1)
    default = load(tiny_model_dir, "fp32").model
    ids = torch.tensor([PROMPT * 5])
    with torch.no_grad():
        expected = default(input_ids=ids).logits
        got = invariant_models["fp32"].model(input_ids=ids).logits
    assert (got - expected).abs().max().item() < 1e-5
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_sequence_computes_the_same_alone_or_batched(invariant_models, precision):
    """Batch invariance in the usual sense too: two unpadded sequences in one batch give each its own bytes."""
    model = invariant_models[precision].model
    ids = torch.tensor([PROMPT + [5, 6], PROMPT[::-1] + [7, 8]])
    with torch.no_grad():
        together = model(input_ids=ids).logits
        alone = [model(input_ids=ids[i:i + 1]).logits for i in range(2)]
    for i in range(2):
        assert rows_equal(together[i:i + 1], alone[i])


def test_padding_and_reapplication_are_refused(invariant_models):
    model = invariant_models["fp32"].model
    with pytest.raises(invariant.InvariantRegimeError, match="unpadded"):
        model(input_ids=torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[0, 1, 1]]))
    with pytest.raises(invariant.InvariantRegimeError, match="already"):
        invariant.apply(model)


def test_other_architectures_are_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(invariant.InvariantRegimeError, match="'llama'"):
        invariant.apply(model)


def test_load_model_refuses_an_unknown_regime(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="numerics 'fast'"):
        load_model(ModelSource("local", str(tiny_model_dir)), "fp32", "cpu", numerics="fast")


def test_config_key_defaults_to_default_and_is_validated():
    schema = schema_file()
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.pop("numerics", None)
    validate(cfg, schema, set_default=True)
    assert cfg["numerics"] == "default"
    cfg["numerics"] = "exact"
    with pytest.raises(WorkflowError, match="exact"):
        validate(cfg, schema, set_default=True)


def test_cost_benchmark_runs_and_checks_the_regime(tiny_model_dir, tmp_path):
    import json

    bench = load_bench("invariant_cost")
    out = tmp_path / "cost.json"
    result = bench.main(["--model", str(tiny_model_dir), "--precision", "fp32", "--prefill-len", "12",
                         "--decode-steps", "2", "--repeats", "1", "--out", str(out)])
    assert result["invariant"]["prefill_equals_incremental"] is True
    assert result["default"]["prefill_equals_incremental"] is False  # the tiny model's fp32 control, as above
    assert json.loads(out.read_text())["decode_time_ratio"] == result["decode_time_ratio"] > 0


def test_later_stages_read_the_recorded_regime(tmp_path):
    import pandas as pd

    from stagereplay.io.parquet import write_parquet
    from stagereplay.io.provenance import recorded_numerics

    frame = pd.DataFrame({"item_index": [0]})
    regime = {"numerics": "invariant", "kernels": "reference", "attention_block_size": 64, "rotary_chunk": 256}
    write_parquet(frame, tmp_path / "gathered.parquet", {"stage": "gather", "parts": [{"numerics_regime": regime}]})
    write_parquet(frame, tmp_path / "old.parquet", {"stage": "gather", "parts": [{"stage": "reconstruct_prefixes"}]})
    assert recorded_numerics(tmp_path / "gathered.parquet") == "invariant"
    with pytest.raises(ValueError, match="records no numerics regime"):  # never guessed
        recorded_numerics(tmp_path / "old.parquet")


def batched_and_single_ledgers(tmp_path, precision, numerics):
    """The matched stage's ledger for 4 toy items with the static decoder, at batch 1 and in batches of 3."""
    from stagereplay.io.parquet import read_parquet
    from stagereplay.stages.reconstruct import reconstruct_prefixes
    from stagereplay.stages.select import select_items
    from stagereplay.stages.settings import ReconstructSettings

    items = tmp_path / "items.parquet"
    select_items({"source": "synthetic", "size": 50, "seed": 0}, 4, 0, str(items))
    common = dict(model=str(REPO / "data/toy"), revision="primary", precision=precision,
                  boundary={"marker": ";", "occurrence": 1}, max_stage_tokens=24, max_new_tokens=8, device="cpu",
                  attn_implementation="sdpa", decode_regime="static", numerics=numerics, progress=False,
                  bridge={"n_rows": 0, "seed": 0})
    ledgers = {}
    for batch_size in (1, 3):
        out = tmp_path / f"ledger{batch_size}.parquet"
        reconstruct_prefixes(str(items), str(out), str(tmp_path / f"prefixes{batch_size}.parquet"),
                             str(tmp_path / f"bridge{batch_size}.parquet"),
                             ReconstructSettings(batch_size=batch_size, **common))
        ledger = read_parquet(out).sort_values(["item_index", "construction", "replica"])
        ledgers[batch_size] = ledger.reset_index(drop=True)
    return ledgers[1], ledgers[3]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_pipeline_stage_is_batch_invariant_under_the_regime(tmp_path, precision):
    """numerics: invariant with the static decoder: a batched ledger (batches of 3, left-padded) holds the same
    trajectories and fingerprints, row for row, as a batch-1 ledger; only the batch columns differ."""
    one, three = batched_and_single_ledgers(tmp_path, precision, "invariant")
    assert sorted(three["batch_rows"].unique()) == [1, 3] and (one["status"] == "ok").sum() >= 4
    assert set(one["numerics"]) == set(three["numerics"]) == {"invariant"}
    for column in ("status", "stage_ids", "suffix_ids", "cache_fingerprint", "suffix_fingerprint"):
        assert [repr(v) for v in one[column]] == [repr(v) for v in three[column]], column


def test_the_pipeline_stage_depends_on_the_batch_in_the_default_regime(tmp_path):
    """The control for the test above: in fp32 the default regime's batched caches are other bytes."""
    one, three = batched_and_single_ledgers(tmp_path, "fp32", "default")
    assert list(one["cache_fingerprint"]) != list(three["cache_fingerprint"])
