"""The benchmarks' batch-invariance measurement: rows of a batched live run, each rerun alone and compared.

Built on the package's greedy loop (:func:`stagereplay.decode.greedy.decode_rows`, the ``live`` construction):
a seeded sample of the rows of one batched run is decoded again as a batch of one row with the same decoder, and
each is compared with its batched row (stage and suffix ids, boundary-cache fingerprint). Disagreements are
reported, not raised: batch composition is a construction factor, and a row whose padding differs may
legitimately get other bits. (The pipeline's own control, over stored ledger rows, is
:func:`stagereplay.stages.controls.batch_invariance`.)
"""

from __future__ import annotations

import random

from stagereplay.decode.greedy import RowResult, decode_rows
from stagereplay.io.ids import first_divergence


class StageOfLength:
    """A boundary matcher for random-weight models: the stage ends after exactly ``n`` generated tokens."""

    def __init__(self, n: int):
        self.n = int(n)

    def reached(self, generated: list[int]) -> bool:
        return len(generated) == self.n


def live_rows(decoder, prompts: list[list[int]], matcher, max_stage_tokens: int, max_new_tokens: int,
              keep=frozenset()) -> list[RowResult]:
    """The live construction over ``prompts`` decoded together: greedy to each row's boundary, then its suffix."""
    return decode_rows(decoder, prompts, matcher=matcher, max_stage_tokens=max_stage_tokens,
                       max_new_tokens=max_new_tokens, keep=keep)


def compare_rows(batched: list[RowResult], single: list[RowResult], rows: list[int]) -> list[dict]:
    """One record per sampled row: its batched result against the same prompt decoded alone."""
    out = []
    for r, alone in zip(rows, single):
        b = batched[r]
        fp_b = (b.fingerprints or ("",))[0]
        fp_s = (alone.fingerprints or ("",))[0]
        out.append({"row": r, "stage_equal": b.stage_ids == alone.stage_ids,
                    "suffix_equal": b.stage_ids == alone.stage_ids and b.suffix_ids == alone.suffix_ids,
                    "cache_equal": fp_b == fp_s and fp_b != "",
                    "suffix_first_divergence": first_divergence(b.stage_ids + b.suffix_ids,
                                                                alone.stage_ids + alone.suffix_ids)})
    return out


def batch_invariance(decoder, prompts: list[list[int]], batched: list[RowResult], matcher, max_stage_tokens: int,
                     max_new_tokens: int, sample: int, seed: int) -> list[dict]:
    """A seeded sample of ``sample`` rows of the batched live run ``batched`` (of ``prompts``), each rerun alone
    (a batch of one row, the same decoder and budgets) and compared with its batched row."""
    rows = sorted(random.Random(seed).sample(range(len(prompts)), min(sample, len(prompts))))
    single = [live_rows(decoder, [prompts[r]], matcher, max_stage_tokens, max_new_tokens)[0] for r in rows]
    return compare_rows(batched, single, rows)
