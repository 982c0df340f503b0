"""The greedy loop (decode.greedy.decode_rows) in the eager regime: boundaries, constructions, continuations.

Every "identical" claim compares token ids, fp32 margins or sha256 fingerprints of the cache bytes."""

import hashlib
import struct

import pytest
import torch

from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.greedy import BoundaryMatcher, decode_rows
from stagereplay.io.ids import first_divergence
from stagereplay.decode.protocol import Decoder
from stagereplay.experiments import constructions, recipe
from stagereplay.experiments.recipe import DecodeSettings
from stagereplay.io.fingerprints import fingerprint_ids, fingerprint_layers, fingerprint_tensor

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]  # "Q:37+45=<think>"
NEVER = BoundaryMatcher(1, token_ids=[10_000])  # an id the model cannot produce


def free_run(decoder, n):
    """The first n greedy ids from PROMPT (no boundary)."""
    res = decode_rows(decoder, [PROMPT], matcher=NEVER, max_stage_tokens=n, max_new_tokens=1)[0]
    assert res.stop_reason == "boundary_missing" and res.stage_ids == []
    return res.suffix_ids


def live(decoder, matcher, max_stage_tokens, max_new_tokens, keep=frozenset({0})):
    return decode_rows(decoder, [PROMPT], matcher=matcher, max_stage_tokens=max_stage_tokens,
                       max_new_tokens=max_new_tokens, keep=keep)[0]


def rebuilt(decoder, construction, stage, max_new_tokens, chunk_size=16, edit=None):
    build = constructions.get(construction).cache_build(chunk_size)
    return decode_rows(decoder, [PROMPT], stages=[stage], build=build, max_new_tokens=max_new_tokens,
                       keep={0}, edit=edit)[0]


def boundary_at(free, n):
    """A matcher whose boundary is the n-th token of the free run ``free``."""
    marker = free[n - 1]
    return BoundaryMatcher(free[:n].count(marker), token_ids=[marker])


def test_id_matcher_counts_occurrences():
    m = BoundaryMatcher(2, token_ids=[5, 6])
    assert not m.reached([5, 6])
    assert not m.reached([5, 6, 1, 5])
    assert m.reached([5, 6, 1, 5, 6])
    assert not m.reached([5, 6, 1, 5, 6, 5, 6])  # the third occurrence is past the boundary


def test_text_matcher_finds_marker_across_tokens():
    vocab = {1: "a", 2: "<", 3: "/t>", 4: "b"}
    decode = lambda ids: "".join(vocab[i] for i in ids)
    m = BoundaryMatcher(1, text="</t>", decode=decode)
    assert not m.reached([1, 2])
    assert m.reached([1, 2, 3])
    assert not m.reached([1, 2, 3, 4])


def test_matcher_rejects_bad_specs():
    with pytest.raises(ValueError):
        BoundaryMatcher(0, token_ids=[1])
    with pytest.raises(ValueError):
        BoundaryMatcher(1)
    with pytest.raises(ValueError):
        BoundaryMatcher(1, text="x")  # a string marker needs a decode function


def test_eager_decoder_implements_the_protocol(loaded_fp32):
    decoder = EagerDecoder(loaded_fp32.model, (1,))
    assert isinstance(decoder, Decoder)
    assert decoder.record()["decode_regime"] == "eager" and decoder.independent_rows(4)


def test_boundary_state_is_prefix_but_last_token(loaded_fp32):
    decoder = EagerDecoder(loaded_fp32.model, (1,))
    free = free_run(decoder, 6)
    result = live(decoder, boundary_at(free, 4), 16, 2)
    assert result.stop_reason == "max_new_tokens"
    assert result.stage_ids == free[:4]
    # the cache covers the prompt and every stage token but the last, which is pending
    assert result.pad == 0 and result.position == len(PROMPT) + 3
    assert all(k.shape[2] == v.shape[2] == len(PROMPT) + 3 for k, v in result.layers)
    assert result.fingerprints == fingerprint_layers(result.layers)


def test_boundary_missing_within_budget(loaded_fp32):
    decoder = EagerDecoder(loaded_fp32.model, ())
    free = free_run(decoder, 5)
    absent = next(i for i in range(4, 21) if i not in free)
    result = live(decoder, BoundaryMatcher(1, token_ids=[absent]), 5, 4)
    assert result.stop_reason == "boundary_missing" and result.stage_ids == []
    assert result.suffix_ids == free  # everything generated within the stage budget
    assert result.fingerprints is None and result.layers is None and result.margins == []


def test_live_needs_a_matcher_and_stages_need_a_build(loaded_fp32):
    decoder = EagerDecoder(loaded_fp32.model, ())
    with pytest.raises(ValueError, match="matcher"):
        decode_rows(decoder, [PROMPT], max_new_tokens=2)
    with pytest.raises(ValueError, match="CacheBuild"):
        decode_rows(decoder, [PROMPT], stages=[[3, 4]], max_new_tokens=2)
    with pytest.raises(ValueError, match="give None"):
        decode_rows(decoder, [PROMPT], stages=[[]], build=constructions.get("prefill").cache_build(),
                    max_new_tokens=2)


@pytest.mark.parametrize("fixture", ["loaded_fp32", "loaded_bf16"])
def test_live_equals_incremental_byte_for_byte(fixture, request):
    decoder = EagerDecoder(request.getfixturevalue(fixture).model, ())
    free = free_run(decoder, 12)
    result = live(decoder, boundary_at(free, 8), 16, 4)
    assert result.stage_ids == free[:8]
    incremental = rebuilt(decoder, "incremental", result.stage_ids, 4)
    assert incremental.fingerprints == result.fingerprints
    assert fingerprint_layers(incremental.layers) == fingerprint_layers(result.layers)
    assert incremental.suffix_ids == result.suffix_ids and incremental.margins == result.margins
    assert (incremental.pad, incremental.position) == (result.pad, result.position)
    # a chunked prefill whose one chunk holds every cached id is the one-shot prefill
    one_chunk = rebuilt(decoder, "chunked", result.stage_ids, 4, chunk_size=len(PROMPT) + 7)
    assert one_chunk.fingerprints == rebuilt(decoder, "prefill", result.stage_ids, 4).fingerprints


def test_the_check_can_fail(loaded_fp32):
    """The control for the byte-level claims: another stage gives other cache bytes."""
    decoder = EagerDecoder(loaded_fp32.model, ())
    stage = free_run(decoder, 6)
    other = [stage[0] % 19 + 1] + stage[1:]
    assert rebuilt(decoder, "incremental", other, 2).fingerprints[0] != \
        rebuilt(decoder, "incremental", stage, 2).fingerprints[0]


@pytest.mark.parametrize("construction,chunk_size", [("prefill", 16), ("incremental", 16), ("chunked", 3),
                                                        ("prefix_cached", 16)])
def test_rebuilt_replicas_are_bit_identical(loaded_bf16, construction, chunk_size):
    decoder = EagerDecoder(loaded_bf16.model, ())
    stage = free_run(decoder, 8)
    settings = DecodeSettings(max_stage_tokens=None, max_new_tokens=10, chunk_size=chunk_size)
    a, b = (recipe.run(decoder, construction, [PROMPT], settings, stages=[stage], keep={0})[0] for _ in range(2))
    assert a.fingerprints == b.fingerprints
    assert fingerprint_layers(a.layers) == fingerprint_layers(b.layers) == a.fingerprints
    assert all(k.shape[2] == len(PROMPT) + len(stage) - 1 for k, _ in a.layers)
    assert a.stage_ids == b.stage_ids == stage
    assert a.suffix_ids == b.suffix_ids and a.margins == b.margins and len(a.suffix_ids) == 10


def test_kept_cache_is_a_copy_that_the_continuation_leaves_untouched(loaded_fp32):
    decoder = EagerDecoder(loaded_fp32.model, ())
    stage = free_run(decoder, 4)
    res = rebuilt(decoder, "prefill", stage, 6)
    # the fingerprints were taken at the boundary; the copy still holds those bytes after six more steps
    assert fingerprint_layers(res.layers) == res.fingerprints
    assert len(res.suffix_ids) == 6 and res.stop_reason == "max_new_tokens"
    assert len(res.margins) == 6 and all(m >= 0 for m in res.margins)
    # a row outside ``keep`` has its fingerprints but no copy
    slim = decode_rows(decoder, [PROMPT], stages=[stage], build=constructions.get("prefill").cache_build(),
                       max_new_tokens=6)[0]
    assert slim.layers is None and slim.fingerprints == res.fingerprints and slim.suffix_ids == res.suffix_ids


def test_live_continuation_equals_free_run(loaded_fp32):
    """Continuing the retained live cache is the original greedy trajectory, token for token."""
    decoder = EagerDecoder(loaded_fp32.model, ())
    free = free_run(decoder, 12)
    result = live(decoder, boundary_at(free, 5), 16, 7)
    assert result.stage_ids + result.suffix_ids == free


def test_continuation_stops_at_eos(loaded_fp32):
    plain = EagerDecoder(loaded_fp32.model, ())
    stage = free_run(plain, 4)
    suffix = rebuilt(plain, "prefill", stage, 6).suffix_ids
    with_eos = EagerDecoder(loaded_fp32.model, (suffix[2],))
    cont = rebuilt(with_eos, "prefill", stage, 6)
    assert cont.stop_reason == "eos" and cont.suffix_ids == suffix[: suffix.index(suffix[2]) + 1]


def test_zero_new_tokens_gives_the_boundary_cache_only(loaded_fp32):
    decoder = EagerDecoder(loaded_fp32.model, ())
    stage = free_run(decoder, 4)
    full = rebuilt(decoder, "incremental", stage, 3)
    none = rebuilt(decoder, "incremental", stage, 0)
    assert none.suffix_ids == [] and none.stop_reason == "max_new_tokens"
    assert none.fingerprints == full.fingerprints


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None


def test_fingerprints_are_sha256_of_exact_bytes():
    expected = hashlib.sha256(struct.pack("<3i", 1, -2, 70000)).hexdigest()
    assert fingerprint_ids([1, -2, 70000]) == expected
    t = torch.tensor([1.0, -2.5], dtype=torch.bfloat16)
    # bf16 1.0 = 0x3F80, -2.5 = 0xC020, little-endian
    assert fingerprint_tensor(t) == hashlib.sha256(bytes([0x80, 0x3F, 0x20, 0xC0])).hexdigest()
    # a different bit pattern changes the fingerprint
    assert fingerprint_tensor(t) != fingerprint_tensor(torch.tensor([1.0, -2.5], dtype=torch.float32))


def test_nonfinite_logits_stop_the_suffix(loaded_fp32):
    decoder = EagerDecoder(loaded_fp32.model, ())
    stage = free_run(decoder, 4)
    clean = rebuilt(decoder, "prefill", stage, 5)

    def poison(row, layers):
        layers[0][1].fill_(float("nan"))  # layer 0's V, in place: the continuation reads it

    cont = rebuilt(decoder, "prefill", stage, 5, edit=poison)
    assert cont.stop_reason == "nonfinite" and cont.suffix_ids == [] and cont.margins == []
    assert cont.stage_ids == stage
    # the fingerprints are those of the edited cache, the one the continuation read
    assert cont.fingerprints != clean.fingerprints and cont.fingerprints == fingerprint_layers(cont.layers)
    assert torch.isnan(cont.layers[0][1]).all()
