"""``numerics: invariant`` in the static decode regime: batched rows equal batch-1 rows byte for byte.

The static decoder computes through the regime's kernels (the CPU reference here; Triton on CUDA, whose run is
recorded in bench/RESULTS.md), with each row's attention reading its own keys in blocks aligned at its first real
key. So a row's bits depend neither on its left padding nor on the batch, and a one-shot prefill equals the live
cache. The default regime is the control: the same batches there give rows that differ from batch 1.
"""

import pytest
import torch

from stagereplay import fastdecode as fd
from stagereplay.io.fingerprints import fingerprint_layers
from stagereplay.models.loading import ModelSource, load_model, set_determinism

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]
# four lengths: rows get different left padding; the longest crosses a 4-key attention block several times
PROMPTS = [PROMPT, PROMPT[:5], PROMPT[2:] + [3, 4], PROMPT + PROMPT[:6]]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need a CUDA device")


def stage_of(n):
    return lambda ids: len(ids) == n


def model_for(tiny_model_dir, precision, numerics, device="cpu", block_size=4):
    set_determinism(1)
    model = load_model(ModelSource("local", str(tiny_model_dir)), precision, device).model
    if numerics == "invariant":
        from stagereplay.models import invariant

        invariant.apply(model, block_size=block_size)
    return model


def batch_vs_alone(decoder, n_stage=6, n_new=6):
    batched = fd.generate_batch(decoder, PROMPTS, stage_of(n_stage), 12, n_new)
    return batched, fd.batch_invariance(decoder, PROMPTS, batched, stage_of(n_stage), 12, n_new,
                                        sample=len(PROMPTS), seed=0)


def check_invariant_decoder(decoder):
    batched, records = batch_vs_alone(decoder)
    assert len(records) == len(PROMPTS)
    assert all(r["cache_equal"] and r["suffix_equal"] for r in records), records
    # prefill, incremental and live: one fingerprint per row
    stages = [r.stage_ids for r in batched]
    for construction in ("prefill", "incremental"):
        cache, ends = fd.build_batch(decoder, construction, PROMPTS, stages)
        for row, live in zip(fd.row_caches(cache, ends), batched):
            assert fingerprint_layers(row) == fingerprint_layers(live.cache_layers), construction
    return batched


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_batched_rows_equal_batch_one_under_the_invariant_regime(tiny_model_dir, precision):
    decoder = fd.StaticDecoder(model_for(tiny_model_dir, precision, "invariant"), (), max_len=48, max_rows=4)
    assert decoder.kernels is not None
    check_invariant_decoder(decoder)


def test_the_default_regime_is_not_batch_invariant_here(tiny_model_dir):
    """The control: the same batches in the default regime give rows whose caches differ from batch 1."""
    decoder = fd.StaticDecoder(model_for(tiny_model_dir, "fp32", "default"), (), max_len=48, max_rows=4)
    _, records = batch_vs_alone(decoder)
    assert not all(r["cache_equal"] for r in records)


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_graph_batched_rows_equal_batch_one_with_triton(tiny_model_dir, precision):
    model = model_for(tiny_model_dir, precision, "invariant", device="cuda", block_size=64)
    decoder = fd.StaticDecoder(model, (), max_len=48, max_rows=4, regime="cuda_graph")
    assert type(decoder.kernels).__name__ == "TritonKernels"
    batched = check_invariant_decoder(decoder)
    # the eager Hugging Face forward of the same regime computes the same bits as the static forward
    from stagereplay.engine import Decoder, generate_to_boundary, BoundaryMatcher

    eager = generate_to_boundary(Decoder(model, ()), PROMPTS[0], BoundaryMatcher(10_000, token_ids=[10_000]), 6)
    assert eager.generated_ids == batched[0].stage_ids


@pytest.mark.parametrize("numerics", ["invariant", "default"])
def test_a_prefill_in_row_groups_is_recorded_and_reproduces(tiny_model_dir, numerics):
    """decode_prefill_group: a batch's one-shot prefill in groups of rows (bounded memory). Under the invariant
    regime the groups change no bit; in the default regime they are a recorded regime parameter whose replicas,
    rebuilt from the record, are byte-identical."""
    model = model_for(tiny_model_dir, "fp32", numerics)
    whole = fd.StaticDecoder(model, (), max_len=48, max_rows=4)
    grouped = fd.StaticDecoder(model, (), max_len=48, max_rows=4, prefill_group=3)  # rows 0-2, then row 3
    assert grouped.describe()["decode_prefill_group"] == 3 and whole.describe()["decode_prefill_group"] is None
    stages = [PROMPT[:4]] * len(PROMPTS)

    def prefill_rows(decoder):
        cache, ends = fd.build_batch(decoder, "prefill", PROMPTS, stages)
        return [fingerprint_layers(row) for row in fd.row_caches(cache, ends)]

    rebuilt = fd.decoder_from_record(model, (), grouped.describe())
    assert rebuilt.prefill_group == 3
    assert prefill_rows(grouped) == prefill_rows(rebuilt)
    if numerics == "invariant":
        assert prefill_rows(grouped) == prefill_rows(whole)
