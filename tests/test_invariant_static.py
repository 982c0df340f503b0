"""``numerics: invariant`` in the static decode regime: batched rows equal batch-1 rows byte for byte.

The static decoder computes through the regime's kernels (the CPU reference here; Triton on CUDA, whose run is
recorded in bench/RESULTS.md), with each row's attention reading its own keys in blocks aligned at its first real
key. So a row's bits depend neither on its left padding nor on the batch, and a one-shot prefill equals the live
cache. The default regime is the control: the same batches there give rows that differ from batch 1.
"""

import pytest
import torch

from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.greedy import BoundaryMatcher, decode_rows
from stagereplay.decode.protocol import RegimeError
from stagereplay.decode.regimes import decoder_from_record
from stagereplay.decode.static import StaticDecoder
from stagereplay.experiments import constructions
from stagereplay.io.fingerprints import fingerprint_layers
from stagereplay.models import invariant
from stagereplay.models.loading import load_model, set_determinism
from stagereplay.models.sources import ModelSource

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]
# four lengths: rows get different left padding; the longest crosses a 4-key attention block several times
PROMPTS = [PROMPT, PROMPT[:5], PROMPT[2:] + [3, 4], PROMPT + PROMPT[:6]]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need a CUDA device")


class AtLength:
    """A boundary matcher (the greedy loop only calls ``reached``): the n-th generated token of every row."""

    def __init__(self, n):
        self.n = n

    def reached(self, ids):
        return len(ids) == self.n


def model_for(tiny_model_dir, precision, numerics, device="cpu", block_size=4):
    set_determinism(1)
    model = load_model(ModelSource("local", str(tiny_model_dir)), precision, device).model
    if numerics == "invariant":
        invariant.apply(model, block_size=block_size)
    return model


def row_bytes(res):
    """Everything a row's result holds, as exact values: ids, fp32 margins, boundary-cache fingerprints."""
    return (res.stage_ids, res.suffix_ids, res.margins, res.stop_reason, res.fingerprints)


def batch_vs_alone(decoder, n_stage=6, n_new=6):
    """The live run of PROMPTS as one batch, and each prompt decoded alone (a batch of one row)."""
    keep = set(range(len(PROMPTS)))
    batched = decode_rows(decoder, PROMPTS, matcher=AtLength(n_stage), max_stage_tokens=12, max_new_tokens=n_new,
                          keep=keep)
    alone = [decode_rows(decoder, [p], matcher=AtLength(n_stage), max_stage_tokens=12, max_new_tokens=n_new)[0]
             for p in PROMPTS]
    assert all(len(r.stage_ids) == n_stage and len(r.suffix_ids) == n_new for r in batched + alone)
    return batched, alone


def check_invariant_decoder(decoder):
    batched, alone = batch_vs_alone(decoder)
    for r, (b, a) in enumerate(zip(batched, alone)):
        assert row_bytes(b) == row_bytes(a), f"row {r} differs batched and alone"
        assert b.pad == max(len(p) for p in PROMPTS) - len(PROMPTS[r]) and a.pad == 0  # other layouts, same bits
    # prefill, incremental and live: one fingerprint per row, and the same continuation
    stages = [r.stage_ids for r in batched]
    for name in ("prefill", "incremental", "chunked"):
        rebuilt = decode_rows(decoder, PROMPTS, stages=stages, build=constructions.get(name).cache_build(3),
                              max_new_tokens=6, keep=set(range(len(PROMPTS))))
        for row, live in zip(rebuilt, batched):
            assert row_bytes(row) == row_bytes(live), name
            assert fingerprint_layers(row.layers) == fingerprint_layers(live.layers), name
    return batched


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_batched_rows_equal_batch_one_under_the_invariant_regime(tiny_model_dir, precision):
    decoder = StaticDecoder(model_for(tiny_model_dir, precision, "invariant"), (), max_len=48, max_rows=4)
    assert decoder.kernels is not None
    check_invariant_decoder(decoder)


def test_the_default_regime_is_not_batch_invariant_here(tiny_model_dir):
    """The control: the same batches in the default regime give rows whose caches differ from batch 1."""
    decoder = StaticDecoder(model_for(tiny_model_dir, "fp32", "default"), (), max_len=48, max_rows=4)
    batched, alone = batch_vs_alone(decoder)
    assert not all(b.fingerprints == a.fingerprints for b, a in zip(batched, alone))


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_graph_batched_rows_equal_batch_one_with_triton(tiny_model_dir, precision):
    model = model_for(tiny_model_dir, precision, "invariant", device="cuda", block_size=64)
    decoder = StaticDecoder(model, (), max_len=48, max_rows=4, regime="cuda_graph")
    assert type(decoder.kernels).__name__ == "TritonKernels"
    batched = check_invariant_decoder(decoder)
    # the eager Hugging Face forward of the same regime computes the same greedy ids as the static forward
    eager = decode_rows(EagerDecoder(model, ()), [PROMPTS[0]], matcher=BoundaryMatcher(1, token_ids=[10_000]),
                        max_stage_tokens=6, max_new_tokens=1)[0]
    assert eager.suffix_ids == batched[0].stage_ids


@pytest.mark.parametrize("numerics", ["invariant", "default"])
def test_a_prefill_in_row_groups_is_recorded_and_reproduces(tiny_model_dir, numerics):
    """decode_prefill_group: a batch's one-shot prefill in groups of rows (bounded memory). Under the invariant
    regime the groups change no bit; in the default regime they are a recorded regime parameter whose replicas,
    rebuilt from the record, are byte-identical."""
    model = model_for(tiny_model_dir, "fp32", numerics)
    whole = StaticDecoder(model, (), max_len=48, max_rows=4)
    grouped = StaticDecoder(model, (), max_len=48, max_rows=4, prefill_group=3)  # rows 0-2, then row 3
    assert grouped.record()["decode_prefill_group"] == 3 and whole.record()["decode_prefill_group"] is None
    cached = [p + PROMPT[:3] for p in PROMPTS]  # each prompt and a 4-token stage but its last token

    def prefill_rows(decoder):
        batch = decoder.build(PROMPTS, cached, None)
        return [fingerprint_layers(decoder.row_layers(batch, r, decoder.pad(batch, r) + len(c)))
                for r, c in enumerate(cached)]

    rebuilt = decoder_from_record(model, (), grouped.record())
    assert rebuilt.prefill_group == 3
    assert prefill_rows(grouped) == prefill_rows(rebuilt)
    if numerics == "invariant":
        assert prefill_rows(grouped) == prefill_rows(whole)


def test_fused_kernels_are_refused_under_invariant_numerics(tiny_model_dir):
    """The invariant regime computes every operation through its own kernels: decode_kernels fused would replace
    some of them with kernels outside its contract, so it is refused before any work."""
    model = model_for(tiny_model_dir, "fp32", "invariant")
    with pytest.raises(RegimeError, match="decode_kernels: fused is an option of numerics: default"):
        StaticDecoder(model, (), max_len=16, kernels="fused")
