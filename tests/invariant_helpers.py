"""Shared by the invariant-regime tests: every construction of one toy trajectory, fingerprinted."""

from stagereplay.models import compat
from stagereplay.engine import BoundaryMatcher, build_cache, continue_greedy, generate_to_boundary
from stagereplay.io.fingerprints import fingerprint_layers

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]  # "Q:37+45=<think>"


def constructions(decoder, n_stage=10):
    """Fingerprints of the live boundary cache and of every rebuilt construction, and their suffixes."""
    free = generate_to_boundary(decoder, PROMPT, BoundaryMatcher(1, token_ids=[10_000]), n_stage).generated_ids
    marker = free[n_stage - 1]
    live = generate_to_boundary(decoder, PROMPT, BoundaryMatcher(free.count(marker), token_ids=[marker]), 2 * n_stage)
    assert live.status == "ok" and live.stage_ids == free
    caches = {"live": live.cache}
    for construction in ("prefill", "incremental", "chunked:3"):
        caches[construction] = build_cache(decoder, construction, PROMPT, live.stage_ids)
    fingerprints = {c: fingerprint_layers(compat.cache_layers(cache))[0] for c, cache in caches.items()}
    suffixes = {c: continue_greedy(decoder, cache, live.stage_ids[-1], 12) for c, cache in caches.items()}
    return fingerprints, {c: (s.suffix_ids, s.margins) for c, s in suffixes.items()}
