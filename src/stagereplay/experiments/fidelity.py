"""Fidelity along the suffix: how far each construction's next-token distributions lie from the reference's when
both read the same tokens.

For one batch of rows, the reference (``live``) is decoded greedily through the recipe from the recorded prompts,
and each other construction's boundary cache, built over the reference's prefix ids in the same batch and layout,
is teacher-forced through exactly the reference's suffix (:func:`stagereplay.decode.greedy.decode_rows`'s
``suffixes``). At every suffix step both sides' fp32 logits are compared: KL divergences in nats (float64, from
``log_softmax``), the max-abs logit difference, both top-2 margins, whether the argmax differs and whether the two
logit vectors are equal byte for byte. Until the first step whose argmax differs the teacher-forced suffix is the
construction's own greedy one, so that step is the pair's first divergence.

This module knows the ledger only as the recorded rows it is handed (to check that the regenerated reference is
the recorded one); it writes no file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from stagereplay.decode.greedy import BoundaryMatcher
from stagereplay.decode.plans import Batch
from stagereplay.decode.protocol import Decoder
from stagereplay.experiments import constructions
from stagereplay.experiments.recipe import ReplicaMismatchError, run
from stagereplay.experiments.rows import RunSettings
from stagereplay.io.fingerprints import fingerprint_ids
from stagereplay.io.keys import ITEM_FIELDS

if TYPE_CHECKING:
    import torch

REFERENCE = "live"
FIDELITY_CONSTRUCTIONS = ("prefill", "chunked", "prefix_cached")

FIDELITY_SCHEMA = pa.schema([
    *ITEM_FIELDS,
    ("reference", pa.string()),  # the construction whose greedy suffix both sides read (live)
    ("construction", pa.string()),  # the construction teacher-forced through that suffix
    ("step", pa.int32()),  # 0-based suffix position
    ("token_id", pa.int32()),  # the reference's token at this step (its greedy choice; fed to both sides next)
    ("kl_forward", pa.float64()),  # KL(P_reference || P_construction), nats
    ("kl_reverse", pa.float64()),  # KL(P_construction || P_reference), nats
    ("kl_sym", pa.float64()),  # (kl_forward + kl_reverse) / 2
    ("max_abs_logit_diff", pa.float64()),  # max over the vocabulary of |logit_reference - logit_construction|
    ("margin_reference", pa.float32()),  # top-2 logit margin (fp32), as the ledger's margins
    ("margin_construction", pa.float32()),
    ("argmax_differs", pa.bool_()),  # the construction's greedy choice here is not the reference's token
    ("logits_equal", pa.bool_()),  # the two fp32 logit vectors are equal byte for byte
    ("cache_equal", pa.bool_()),  # the two boundary caches are equal byte for byte (fingerprints)
    ("decode_regime", pa.string()),
    ("numerics", pa.string()),
    ("batch_index", pa.int32()),  # the item's batch in the recorded plan, its row, the batch's size (null at 1)
    ("batch_row", pa.int16()),
    ("batch_rows", pa.int16()),
    ("layout_pad", pa.int32()),  # the row's left padding and the pending token's buffer position (both sides')
    ("layout_position", pa.int32()),
])


class ReferenceMismatchError(RuntimeError):
    """The regenerated reference is not the recorded one: its prefix (or suffix) differs from the ledger's."""


def step_measures(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Per step, the comparison of two (steps, vocab) fp32 logit matrices; numpy arrays of length steps.

    KL divergences are in nats, in float64 from the fp32 logits: with P from ``log_softmax`` and d the logit
    difference (exact in float64), KL(P || Q) = E_P[d] + log E_P[exp(-d)], the log of the second term taken as
    ``log1p(E_P[expm1(-d)])``. The identity is the textbook sum of P (log P - log Q) with the two log-partition
    functions cancelled exactly: at fp32's last-ulp differences (KL about 1e-14) that sum is lost in their rounding
    (about 1e-16, negative on some steps). Terms where P is 0 count 0. Byte-equal logit vectors give exactly 0.0
    (and ``logits_equal`` True).
    """
    import torch

    if reference.dtype != torch.float32 or other.dtype != torch.float32 or reference.shape != other.shape:
        raise ValueError(f"need two fp32 logit matrices of one shape, got {reference.dtype} {tuple(reference.shape)} "
                         f"and {other.dtype} {tuple(other.shape)}")
    equal = (reference.view(torch.int32) == other.view(torch.int32)).all(dim=-1)
    a, b = reference.double(), other.double()

    def kl(x, y):  # KL(softmax(x) || softmax(y)) per row
        p = torch.log_softmax(x, dim=-1).exp()
        d = x - y
        zero = torch.zeros_like(p)
        mean_d = torch.where(p > 0, p * d, zero).sum(dim=-1)
        mean_e = torch.where(p > 0, p * torch.expm1(-d), zero).sum(dim=-1)
        return mean_d + torch.log1p(mean_e)

    forward, reverse = kl(a, b), kl(b, a)
    top_a, top_b = torch.topk(reference, 2, dim=-1).values, torch.topk(other, 2, dim=-1).values
    return {"kl_forward": forward.cpu().numpy(), "kl_reverse": reverse.cpu().numpy(),
            "kl_sym": ((forward + reverse) / 2).cpu().numpy(),
            "max_abs_logit_diff": (a - b).abs().amax(dim=-1).cpu().numpy(),
            "margin_reference": (top_a[:, 0] - top_a[:, 1]).cpu().numpy(),
            "margin_construction": (top_b[:, 0] - top_b[:, 1]).cpu().numpy(),
            "argmax_reference": torch.argmax(reference, dim=-1).cpu().numpy(),
            "argmax_construction": torch.argmax(other, dim=-1).cpu().numpy(),
            "logits_equal": equal.cpu().numpy()}


class _Logits:
    """Each row's fp32 logits at every suffix step, as :func:`decode_rows`'s ``observe`` hands them (copied: the
    decoder may reuse the tensor)."""

    def __init__(self, rows: set[int] | None = None):
        self.rows: dict[int, list] = {}
        self.wanted = rows  # the batch rows whose logits are kept (None: all): what the device holds grows with them

    def __call__(self, row: int, step: int, logits) -> None:
        if self.wanted is not None and row not in self.wanted:
            return
        steps = self.rows.setdefault(row, [])
        if step != len(steps):
            raise RuntimeError(f"row {row}: suffix step {step} observed after {len(steps)} steps")
        steps.append(logits.detach().clone())

    def of(self, row: int):
        import torch

        return torch.stack(self.rows[row]) if self.rows.get(row) else None


def _check_reference(item: dict, res, recorded: dict | None, precision: str) -> None:
    """Refuse a regenerated reference that is not the recorded ``live`` row (its replica 1)."""
    if recorded is None:
        raise ReferenceMismatchError(f"item {item['item_id']!r}: the ledger has no matched live row at {precision}; "
                                     "rerun reconstruct_prefixes (the fidelity stage compares with what it recorded)")
    stage = [int(i) for i in recorded["stage_ids"]]
    if list(res.stage_ids) != stage:
        raise ReferenceMismatchError(
            f"item {item['item_id']!r}: the live generation regenerated at {precision} reached the boundary with "
            f"stage ids other than the recorded prefix ({len(res.stage_ids)} ids, the ledger {len(stage)}; first "
            "difference at " + str(next((i for i, (a, b) in enumerate(zip(res.stage_ids, stage)) if a != b),
                                        min(len(res.stage_ids), len(stage)))) +
            "). The model, precision, device, threads, numerics, decode regime or batch plan is not the one the "
            "ledger was made with: rerun reconstruct_prefixes, or run this stage where the ledger was made")
    if stage and fingerprint_ids(res.suffix_ids) != recorded["suffix_fingerprint"]:
        raise ReferenceMismatchError(
            f"item {item['item_id']!r}: the live suffix regenerated at {precision} differs from the ledger's although "
            "its prefix is the recorded one (a replica that is not bit-exact): check that deterministic algorithms "
            "are on and the settings are the ledger's")


def fidelity_batch(decoder: Decoder, batch: Batch, prompts: list[list[int]], settings: RunSettings,
                   matcher: BoundaryMatcher, pair_constructions=FIDELITY_CONSTRUCTIONS, *,
                   recorded: dict[int, dict], recorded_caches: dict | None = None,
                   wanted: set[int] | None = None) -> list[dict]:
    """Per-step fidelity rows of one batch: the reference regenerated greedily (its rows checked against
    ``recorded``, item_index -> the ledger's matched live row), each of ``pair_constructions`` teacher-forced
    through its suffix. ``recorded_caches`` ((item_index, construction) -> the ledger's cache fingerprint over the
    same prefix ids in the same batch) are checked too: the construction's cache must be the recorded one.
    ``wanted`` (item indexes; None: all) are the rows recorded; every row is decoded (the batch's layout)."""
    for name in pair_constructions:
        if name == REFERENCE or not constructions.get(name).rebuildable:
            raise ValueError(f"fidelity.constructions: {name!r} cannot be compared with the {REFERENCE} reference "
                             "(it is the reference, or cannot be rebuilt from the prefix ids)")
    kept = None if wanted is None else {r for r, item in enumerate(batch.items) if int(item["item_index"]) in wanted}
    seen = _Logits(kept)
    reference = run(decoder, REFERENCE, prompts, settings.decode, matcher=matcher, observe=seen)
    for r, item in enumerate(batch.items):
        _check_reference(item, reference[r], recorded.get(int(item["item_index"])), settings.precision)
    stages = [res.stage_ids or None for res in reference]
    suffixes = [list(res.suffix_ids) if res.stage_ids else None for res in reference]
    rows = []
    for name in pair_constructions:
        forced = _Logits(kept)
        other = run(decoder, name, prompts, settings.decode, stages=stages, suffixes=suffixes, observe=forced)
        for r, item in enumerate(batch.items):
            index = int(item["item_index"])
            if stages[r] is None or (wanted is not None and index not in wanted):
                continue
            ref, res = reference[r], other[r]
            if (ref.pad, ref.position) != (res.pad, res.position):
                raise RuntimeError(f"item {item['item_id']!r}: {name} was decoded in another layout than {REFERENCE} "
                                   f"(pad, position {res.pad, res.position} vs {ref.pad, ref.position})")
            expected = (recorded_caches or {}).get((index, name))
            if expected is not None and res.fingerprints[0] != expected:
                raise ReplicaMismatchError(
                    f"item {item['item_id']!r}: the {name} cache rebuilt at {settings.precision} differs from the "
                    "ledger's over the same prefix ids and batch: check that the model, precision, device, threads "
                    "and batch plan are the ones the ledger ran with")
            rows += _step_rows(item, settings, name, ref, res, seen.of(r), forced.of(r), batch, r)
    return rows


def _step_rows(item, settings: RunSettings, name: str, ref, res, a, b, batch: Batch, r: int) -> list[dict]:
    if a is None or b is None:
        return []
    n = min(len(a), len(b), len(ref.suffix_ids))  # fewer only where a side's logits turned non-finite
    m = step_measures(a[:n], b[:n])
    tokens = [int(t) for t in ref.suffix_ids[:n]]
    if [int(t) for t in m["argmax_reference"]] != tokens:
        raise RuntimeError(f"item {item['item_id']!r}: the reference's logits observed do not give its own greedy "
                           "suffix (the greedy loop's observe is out of step)")
    base = {"item_index": int(item["item_index"]), "item_id": item["item_id"], "revision": settings.revision,
            "precision": settings.precision, "reference": REFERENCE, "construction": name,
            "cache_equal": res.fingerprints[0] == ref.fingerprints[0], "decode_regime": settings.decode_regime,
            "numerics": settings.numerics, **batch.layout_fields(r), "layout_pad": ref.pad,
            "layout_position": ref.position}
    return [{**base, "step": j, "token_id": tokens[j], "kl_forward": float(m["kl_forward"][j]),
             "kl_reverse": float(m["kl_reverse"][j]), "kl_sym": float(m["kl_sym"][j]),
             "max_abs_logit_diff": float(m["max_abs_logit_diff"][j]),
             "margin_reference": float(m["margin_reference"][j]),
             "margin_construction": float(m["margin_construction"][j]),
             "argmax_differs": bool(m["argmax_construction"][j] != tokens[j]),
             "logits_equal": bool(m["logits_equal"][j])} for j in range(n)]
