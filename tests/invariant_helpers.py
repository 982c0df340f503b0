"""Shared by the invariant-regime tests: every construction of one toy trajectory, fingerprinted."""

from stagereplay.decode.greedy import BoundaryMatcher, decode_rows
from stagereplay.experiments import constructions as registry

PROMPT = [19, 18, 7, 11, 14, 8, 9, 16, 2]  # "Q:37+45=<think>"
NEVER = BoundaryMatcher(1, token_ids=[10_000])  # an id the model cannot produce


def free_run(decoder, prompt, n):
    """The first n greedy ids from ``prompt`` (no boundary)."""
    res = decode_rows(decoder, [prompt], matcher=NEVER, max_stage_tokens=n, max_new_tokens=1)[0]
    assert res.stop_reason == "boundary_missing" and len(res.suffix_ids) == n
    return res.suffix_ids


def constructions(decoder, n_stage=10, n_new=12):
    """Fingerprints of the live boundary cache and of every rebuilt construction, and their suffixes (ids and fp32
    margins)."""
    free = free_run(decoder, PROMPT, n_stage)
    marker = free[n_stage - 1]
    live = decode_rows(decoder, [PROMPT], matcher=BoundaryMatcher(free.count(marker), token_ids=[marker]),
                       max_stage_tokens=2 * n_stage, max_new_tokens=n_new)[0]
    assert live.stage_ids == free
    results = {"live": live}
    for name, chunk_size in (("prefill", 16), ("incremental", 16), ("chunked", 3)):
        build = registry.get(name).cache_build(chunk_size)
        results[name] = decode_rows(decoder, [PROMPT], stages=[live.stage_ids], build=build,
                                    max_new_tokens=n_new)[0]
    fingerprints = {c: res.fingerprints[0] for c, res in results.items()}
    return fingerprints, {c: (res.suffix_ids, res.margins) for c, res in results.items()}
