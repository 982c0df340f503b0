"""The construction registry: every way this package builds a boundary cache, as the decoder runs it.

A construction is how the KV cache at the stage boundary is built (docs/STUDY.md): ``live`` is retained from the
greedy generation itself; the others rebuild it from the prefix ids, each as forwards of some number of tokens.
Every experiment (matched, fixed-prefix 2x2, bridge, audit, transplants, cache differences) names constructions
and gets them from here; :func:`stagereplay.decode.greedy.decode_rows` runs them all in one layout.

The constructions themselves (name, label, segment rule) are declared in :mod:`stagereplay.catalogue`; this module
owns the segment rules (:data:`SEGMENT_RULES`: how many tokens each forward feeds) and builds :data:`REGISTRY` from
the catalogue's entries. A new construction is a catalogue entry, plus a rule here where no existing one fits
(docs/EXTENDING.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from stagereplay import catalogue
from stagereplay.decode.greedy import CacheBuild


def _prefill(prompt_len: int, n_cached: int, chunk_size: int) -> list[int]:
    return [prompt_len + n_cached]  # one forward over every boundary-cache id


def _incremental(prompt_len: int, n_cached: int, chunk_size: int) -> list[int]:
    return [prompt_len] + [1] * n_cached  # the prompt at once, then the stage one token at a time


def _chunked(prompt_len: int, n_cached: int, chunk_size: int) -> list[int]:
    total = prompt_len + n_cached  # serving engines' chunked prefill: every id, chunk_size at a time
    return [min(chunk_size, total - start) for start in range(0, total, chunk_size)]


def _prefix_cached(prompt_len: int, n_cached: int, chunk_size: int) -> list[int]:
    # serving engines' automatic prefix caching: the prompt's cache from an earlier request (one forward over the
    # prompt, as every request that shares it computed it), then the stage ids on top of it in one forward
    return [prompt_len] + ([n_cached] if n_cached else [])


@dataclass(frozen=True)
class Construction:
    name: str
    label: str  # how the report and figures name it
    segments: Callable[[int, int, int], list[int]] | None  # None: only retained from generation (live)
    schedule: bool = False  # the live schedule's own cache (prompt, then one token per step)

    @property
    def rebuildable(self) -> bool:
        return self.segments is not None

    def cache_build(self, chunk_size: int = 16) -> CacheBuild:
        if self.segments is None:
            raise ValueError(f"construction {self.name!r} cannot be rebuilt from ids: it is only retained from the "
                             "generation (rebuild it as 'incremental', its own schedule)")
        segments = self.segments
        return CacheBuild(lambda p, n: segments(p, n, chunk_size), self.schedule)


# A catalogue entry's segment_rule -> the function: (prompt_len, n_cached, chunk_size) -> tokens per forward.
SEGMENT_RULES: dict[str, Callable[[int, int, int], list[int]]] = {
    "incremental": _incremental,
    "prefill": _prefill,
    "chunked": _chunked,
    "prefix_cached": _prefix_cached,
}


def registry_of(entries) -> dict[str, Construction]:
    """{name: Construction} of the catalogue's construction entries, each with its segment rule's function."""
    registry = {}
    for entry in entries:
        if entry.segment_rule is not None and entry.segment_rule not in SEGMENT_RULES:
            raise ValueError(f"construction {entry.name!r}: no segment rule {entry.segment_rule!r} in "
                             f"{__name__}.SEGMENT_RULES (known: {sorted(SEGMENT_RULES)})")
        segments = SEGMENT_RULES[entry.segment_rule] if entry.segment_rule is not None else None
        registry[entry.name] = Construction(entry.name, entry.label, segments, entry.schedule)
    return registry


REGISTRY: dict[str, Construction] = registry_of(catalogue.CONSTRUCTIONS)


def get(name: str) -> Construction:
    if name not in REGISTRY:
        raise ValueError(f"unknown construction {name!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[name]
