"""THE recipe every experiment, the audit and the library API call: build a construction's boundary caches for a
batch of rows, fingerprint them, continue them, and run replicas that must be bit-identical.

Rows of one batch are decoded together in one layout whatever the construction
(:func:`stagereplay.decode.greedy.decode_rows`), so two constructions compared on an item differ only in how its
boundary cache was built. The recipe takes decode settings only: it knows nothing of the ledger (revision, answer
format, gold answers), whose rows are made from its results a layer above (:mod:`stagereplay.experiments.rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

from stagereplay.decode.greedy import BoundaryMatcher, RowResult, decode_rows
from stagereplay.decode.protocol import Decoder
from stagereplay.experiments import constructions


class ReplicaMismatchError(RuntimeError):
    """Two replicas of one construction and precision that are not bit-identical."""


@dataclass(frozen=True)
class DecodeSettings:
    """What the recipe needs besides the decoder and the rows: the token budgets and the chunked construction's
    forward size."""

    max_stage_tokens: int | None  # None: fixed prefixes are replayed and no stage is generated
    max_new_tokens: int
    chunk_size: int = 16  # the chunked construction's forwards

    def __post_init__(self):
        for key in ("max_stage_tokens", "max_new_tokens", "chunk_size"):
            value = getattr(self, key)
            if key == "max_stage_tokens" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} is {value!r}; it must be a whole number of tokens, at least 1")


def run(decoder: Decoder, construction: str, prompts: list[list[int]], settings: DecodeSettings, *,
        stages: list[list[int] | None] | None = None, matcher: BoundaryMatcher | None = None, edit=None,
        keep=frozenset(), max_new_tokens: int | None = None, suffixes=None, observe=None) -> list[RowResult]:
    """One construction over one batch: ``live`` generates (``matcher``); the others rebuild from ``stages``.
    ``suffixes`` and ``observe`` (teacher-forced suffix ids, each step's logits) go to the greedy loop as they are."""
    c = constructions.get(construction)
    budget = settings.max_new_tokens if max_new_tokens is None else max_new_tokens
    if not c.rebuildable:
        if stages is not None:
            raise ValueError("the live construction generates its own stage; it cannot be given stage ids")
        return decode_rows(decoder, prompts, matcher=matcher, max_stage_tokens=settings.max_stage_tokens,
                           max_new_tokens=budget, edit=edit, keep=keep, suffixes=suffixes, observe=observe)
    return decode_rows(decoder, prompts, stages=stages, build=c.cache_build(settings.chunk_size),
                       max_new_tokens=budget, edit=edit, keep=keep, suffixes=suffixes, observe=observe)


def continue_placed(decoder: Decoder, prompts: list[list[int]], stages: list[list[int] | None], pads: list[int],
                    caches: list, settings: DecodeSettings, *, edit=None, keep=frozenset()) -> list[RowResult]:
    """Rows continued from given boundary caches (row r's ``caches[r]``, of its prompt and stage ids but the last,
    at left pad ``pads[r]``) instead of caches built from ids: a row's continuation is the one its construction
    gives in its recorded batch wherever the row keeps that layout (its pad and position, the batch's row count
    and buffer), whichever row slot it sits in (:mod:`stagereplay.experiments.packing` packs decodes on it)."""
    return decode_rows(decoder, prompts, stages=stages, max_new_tokens=settings.max_new_tokens, edit=edit,
                       keep=keep, placed=(pads, caches))


def run_replicas(decoder: Decoder, construction: str, prompts: list[list[int]], settings: DecodeSettings, *,
                 replicas=(1, 2), stages=None, matcher=None, keep=frozenset()) -> list[list[RowResult]]:
    """The batch's results once per replica, each run from scratch; replica 1 keeps the caches of ``keep``."""
    return [run(decoder, construction, prompts, settings, stages=stages, matcher=matcher,
                keep=keep if i == 0 else frozenset()) for i, _ in enumerate(replicas)]


def replica_difference(a: RowResult, b: RowResult) -> str | None:
    """What two replicas of one row differ in, named as the ledger's columns are (status, stage ids, boundary cache,
    suffix, stop reason, layout), the first K layer that differs where the caches do; None when bit-identical."""
    cache_a, cache_b = (res.fingerprints or ("", [], []) for res in (a, b))
    for name, x, y in (("status", a.status, b.status), ("stage_ids", list(a.stage_ids), list(b.stage_ids)),
                       ("cache_fingerprint", cache_a[0], cache_b[0]),
                       ("suffix_ids", list(a.suffix_ids), list(b.suffix_ids)),
                       ("stop_reason", a.stop_reason, b.stop_reason), ("layout_pad", a.pad, b.pad),
                       ("layout_position", a.position, b.position)):
        if x != y:
            if name != "cache_fingerprint":
                return name
            layers = [i for i, (k, other) in enumerate(zip(cache_a[1], cache_b[1])) if k != other]
            return f"{name} (K differs from layer {layers[0] if layers else '?'})"
    return None
