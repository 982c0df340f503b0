"""Token-id lists as the pipeline compares them: where two of them first differ."""

from __future__ import annotations


def first_divergence(a, b) -> int | None:
    """Index of the first position where two id lists differ (a length difference counts), or None."""
    a, b = list(a), list(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
