import hashlib
import struct

import pytest
import torch

from stagereplay.models import compat
from stagereplay.engine import (
    BoundaryMatcher,
    Decoder,
    build_cache,
    continue_greedy,
    first_divergence,
    generate_to_boundary,
)
from stagereplay.io.fingerprints import fingerprint_ids, fingerprint_layers, fingerprint_tensor

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]  # "Q:37+45=<think>"


def free_run(decoder, n):
    """The first n greedy ids from PROMPT (no boundary)."""
    matcher = BoundaryMatcher(1, token_ids=[10_000])  # an id the model cannot produce
    return generate_to_boundary(decoder, PROMPT, matcher, n).generated_ids


def layers_fp(cache):
    return fingerprint_layers(compat.cache_layers(cache))


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


def test_boundary_state_is_prefix_but_last_token(loaded_fp32):
    decoder = Decoder(loaded_fp32.model, (1,))
    free = free_run(decoder, 6)
    marker = free[3]
    occurrence = free[:4].count(marker)
    result = generate_to_boundary(decoder, PROMPT, BoundaryMatcher(occurrence, token_ids=[marker]), 16)
    assert result.status == "ok"
    assert result.stage_ids == free[:4]
    # the cache covers the prompt and every stage token but the last, which is pending
    assert compat.cache_length(result.cache) == len(PROMPT) + 3


def test_boundary_missing_within_budget(loaded_fp32):
    decoder = Decoder(loaded_fp32.model, ())
    free = free_run(decoder, 5)
    absent = next(i for i in range(4, 21) if i not in free)
    result = generate_to_boundary(decoder, PROMPT, BoundaryMatcher(1, token_ids=[absent]), 5)
    assert result.status == "boundary_missing"
    assert result.generated_ids == free
    assert result.cache is None


@pytest.mark.parametrize("fixture", ["loaded_fp32", "loaded_bf16"])
def test_live_equals_incremental_byte_for_byte(fixture, request):
    decoder = Decoder(request.getfixturevalue(fixture).model, ())
    free = free_run(decoder, 8)
    marker = free[7]
    result = generate_to_boundary(decoder, PROMPT, BoundaryMatcher(free[:8].count(marker), token_ids=[marker]), 16)
    incremental = build_cache(decoder, "incremental", PROMPT, result.stage_ids)
    assert layers_fp(result.cache) == layers_fp(incremental)
    # chunked:1 is the incremental schedule
    assert layers_fp(build_cache(decoder, "chunked:1", PROMPT, result.stage_ids)) == layers_fp(incremental)


@pytest.mark.parametrize("construction", ["prefill", "incremental", "chunked:3"])
def test_rebuilt_replicas_are_bit_identical(loaded_bf16, construction):
    decoder = Decoder(loaded_bf16.model, ())
    stage = free_run(decoder, 8)
    a = build_cache(decoder, construction, PROMPT, stage)
    b = build_cache(decoder, construction, PROMPT, stage)
    assert layers_fp(a) == layers_fp(b)
    assert compat.cache_length(a) == len(PROMPT) + len(stage) - 1
    ca = continue_greedy(decoder, a, stage[-1], 10)
    cb = continue_greedy(decoder, b, stage[-1], 10)
    assert ca.suffix_ids == cb.suffix_ids and ca.margins == cb.margins


def test_continue_leaves_cache_untouched_when_copying(loaded_fp32):
    decoder = Decoder(loaded_fp32.model, ())
    stage = free_run(decoder, 4)
    cache = build_cache(decoder, "prefill", PROMPT, stage)
    before = layers_fp(cache)
    cont = continue_greedy(decoder, cache, stage[-1], 6)
    assert layers_fp(cache) == before
    assert len(cont.suffix_ids) == 6 and cont.stop_reason == "max_new_tokens"
    assert all(m >= 0 for m in cont.margins)


def test_live_continuation_equals_free_run(loaded_fp32):
    """Continuing the retained live cache is the original greedy trajectory, token for token."""
    decoder = Decoder(loaded_fp32.model, ())
    free = free_run(decoder, 12)
    marker = free[4]
    result = generate_to_boundary(decoder, PROMPT, BoundaryMatcher(free[:5].count(marker), token_ids=[marker]), 16)
    cont = continue_greedy(decoder, result.cache, result.stage_ids[-1], 7)
    assert result.stage_ids + cont.suffix_ids == free


def test_continuation_stops_at_eos(loaded_fp32):
    plain = Decoder(loaded_fp32.model, ())
    stage = free_run(plain, 4)
    cache = build_cache(plain, "prefill", PROMPT, stage)
    suffix = continue_greedy(plain, cache, stage[-1], 6).suffix_ids
    with_eos = Decoder(loaded_fp32.model, (suffix[2],))
    cont = continue_greedy(with_eos, cache, stage[-1], 6)
    assert cont.stop_reason == "eos" and cont.suffix_ids == suffix[: suffix.index(suffix[2]) + 1]


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
    decoder = Decoder(loaded_fp32.model, ())
    stage = free_run(decoder, 4)
    cache = build_cache(decoder, "prefill", PROMPT, stage)
    broken = compat.cache_layers(cache)
    compat.set_cache_layer(cache, 0, values=torch.full_like(broken[0][1], float("nan")))
    cont = continue_greedy(decoder, cache, stage[-1], 5)
    assert cont.stop_reason == "nonfinite" and cont.suffix_ids == []
