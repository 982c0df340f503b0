"""K/V transplantation between boundary caches, the sweeps that localise the carrier, and outcome-blind selection.

A transplant continues the recipient construction's row in its own batch and layout, with the donor's K and/or V
written over a set of layers S of its boundary cache, at all cache positions, only the prompt's or the stage's, or
an explicit span [lo, hi) of cache positions (the minimal-transplant search, :mod:`.minimal_transplant`).
Donor and recipient are decoded in one layout (the same batch, padding and positions), so the donor's tensors land
exactly where the recipient's were, and the transplanted cache's fingerprint is taken from the buffer the
continuation reads. With the boundary state of docs/STUDY.md both constructions share the pending token, so an
all-layer, all-position K/V transplant hands the recipient the donor's whole state: the continuation must then equal
the donor's own (a consistency check of the construction and of layout parity; a miss is a defect).

Outcome of one transplant: ``donor`` (suffix ids equal the donor's own continuation), ``recipient`` (equal the
recipient's own), else ``neither``; where donor and recipient agree with each other (a non-divergent item) an
equal suffix counts as ``donor`` and the row's ``divergent`` is false.

Selection never looks at correctness or at transplant outcomes: ``divergent`` compares the two constructions' suffix
token ids, ``divergent:N`` draws N of those with a seed, ``sample:N`` draws N items with a seed, an explicit
list names item ids.

What a transplant moves (its spec, the sweeps) is :mod:`.transplant_specs`; packed decodes are
:mod:`.packing`. Knows nothing of Parquet paths or Snakemake (:mod:`stagereplay.stages.transplant` does the files).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from stagereplay.decode.greedy import RowResult
from stagereplay.io.ids import first_divergence
from stagereplay.decode.protocol import Decoder, Layers
from stagereplay.experiments.recipe import DecodeSettings, ReplicaMismatchError, run
from stagereplay.io.fingerprints import fingerprint_ids
from stagereplay.experiments.transplant_specs import COMPONENTS, TransplantSpec, position_range, rebuilt_as

ARMS = ("donor", "placebo", "sham")  # what a transplant writes: the donor's bytes, their placebo, the recipient's own


PLACEBO_KINDS = ("shifted", "negated")


def span_of(spec: TransplantSpec, prompt_len: int, k) -> tuple[int, int]:
    """Cache positions [lo, hi) of ``spec`` in a layer's K of shape (1, kv_heads, seq, head_dim)."""
    return position_range(spec.positions, prompt_len, k.shape[2])


def placebo_bytes(donor, recipient):
    """The placebo of a transplant over one span: the recipient's bytes plus the donor-minus-recipient difference
    with its positions shifted cyclically by half the span (axis 2), so the same differences, of the same size, land
    on other positions of the same span, layers and component. A span of one position, or a difference the shift
    leaves in place, takes the negated difference instead. Returns (bytes, kind of :data:`PLACEBO_KINDS`).

    The sum is taken in float32 and cast back to the cache's dtype."""
    diff = donor.float() - recipient.float()
    n = int(diff.shape[2])
    if n >= 2:
        moved = diff.roll(shifts=n // 2, dims=2)
        if not moved.equal(diff):
            return (recipient.float() + moved).to(recipient.dtype), "shifted"
    return (recipient.float() - diff).to(recipient.dtype), "negated"


def _components(spec: TransplantSpec) -> tuple[int, ...]:
    """Which of (K, V) ``spec`` transplants, as indices into a layer's (k, v)."""
    if spec.component not in COMPONENTS:
        raise ValueError(f"component must be one of {COMPONENTS}, got {spec.component!r}")
    return {"kv": (0, 1), "k": (0,), "v": (1,)}[spec.component]


def transplant_edit(row: int, spec: TransplantSpec, donor: Layers, prompt_len: int, arm: str = "donor"):
    """The edit that writes, in place, into row ``row``'s boundary cache over ``spec``: the donor's K and/or V (arm
    ``donor``; ``sham`` is the same edit with the recipient's own layers as ``donor``) or their placebo (arm
    ``placebo``, :func:`placebo_bytes`). ``edit.placebo_kind`` says which placebo was written (None for the
    others, or before the decode ran)."""
    parts = _components(spec)
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")

    def edit(r: int, layers: Layers) -> None:
        if r != row:
            return
        if len(donor) != len(layers):
            raise ValueError(f"donor has {len(donor)} layers, recipient {len(layers)}: not the same model")
        kinds = set()
        for i in spec.layers:
            if not 0 <= i < len(layers):
                raise ValueError(f"layer {i} is outside the model's {len(layers)} layers")
            (dk, dv), (k, v) = donor[i], layers[i]
            if dk.shape != k.shape or dv.shape != v.shape or dk.dtype != k.dtype:
                raise ValueError(
                    f"layer {i}: donor K/V {tuple(dk.shape)} {dk.dtype} and recipient {tuple(k.shape)} {k.dtype} do "
                    "not match; donor and recipient must be boundary caches of the same prefix at the same precision")
            lo, hi = span_of(spec, prompt_len, k)  # (1, kv_heads, seq, head_dim)
            for part in parts:
                src, dst = (dk, dv)[part][:, :, lo:hi], (k, v)[part][:, :, lo:hi]
                if arm == "placebo":
                    src, kind = placebo_bytes(src, dst)
                    kinds.add(kind)
                dst.copy_(src)
        edit.placebo_kind = "+".join(sorted(kinds)) if kinds else None

    edit.placebo_kind = None
    return edit


def transplanted_bytes_equal(spec: TransplantSpec, donor: Layers, recipient: Layers, prompt_len: int) -> bool:
    """Whether the donor's bytes that ``spec`` would write equal the recipient's there: such a transplant is a
    no-op (e.g. prompt positions that both constructions computed to the same bytes, which happens where the
    prompt's K/V do not depend on the forward's length) and is evidence of nothing."""
    parts = _components(spec)
    for i in spec.layers:
        lo, hi = span_of(spec, prompt_len, recipient[i][0])
        for part in parts:
            if not donor[i][part][:, :, lo:hi].equal(recipient[i][part][:, :, lo:hi]):
                return False
    return True


@dataclass
class Outcome:
    outcome: str  # donor | recipient | neither
    first_divergence_donor: int | None
    first_divergence_recipient: int | None


def classify(suffix: list[int], donor_suffix: list[int], recipient_suffix: list[int]) -> Outcome:
    """Which side's own continuation the transplanted continuation equals, token id for token id."""
    fd_donor = first_divergence(suffix, donor_suffix)
    fd_recipient = first_divergence(suffix, recipient_suffix)
    outcome = "donor" if fd_donor is None else "recipient" if fd_recipient is None else "neither"
    return Outcome(outcome, fd_donor, fd_recipient)


class PlaceboError(ReplicaMismatchError):
    """A control that is not one: a placebo whose transplanted cache is the donor's transplant's, or a sham (the
    recipient's own bytes written back) that does not reproduce the recipient byte for byte."""


class TransplantResults(dict):
    """Row -> (result, outcome) of one transplant decode, with ``placebo_kinds`` (row -> kind or None)."""

    placebo_kinds: dict[int, str | None]


def transplant_rows(decoder: Decoder, prompts: list[list[int]], stages: list[list[int] | None],
                    settings: DecodeSettings, own: dict[str, list[RowResult]], donor: str, recipient: str,
                    specs: dict[int, TransplantSpec], arm: str = "donor") -> dict[int, tuple[RowResult, Outcome]]:
    """Transplants of several rows of one batch in one decode: the recipient's whole batch decoded again (the one
    recipe, the batch's own layout) with row ``r``'s boundary cache edited by ``specs[r]`` from the donor's row
    ``r`` (``arm``: the donor's bytes, their placebo, or ``sham``: the recipient's own bytes through the same edit);
    each edited row's result and outcome (against the donor's and the recipient's own continuations). A placebo
    row's result carries the placebo's kind in ``placebo_kinds[r]`` (the returned dict's attribute).

    A row's bits may depend on its batch's layout (rows, padding, buffer length), which every transplant keeps, but
    never on the values in the other rows: every row decoded here without an edit is checked to reproduce the
    recipient's own result bit for bit (cache fingerprint and suffix ids), so a transplant that leaked into another
    row would stop the stage, not pass as data. A sham row must reproduce its own result the same way."""
    source = recipient if arm == "sham" else donor
    edits = {r: transplant_edit(r, spec, own[source][r].layers, len(prompts[r]), arm) for r, spec in specs.items()}

    def edit(r: int, layers: Layers) -> None:
        if r in edits:
            edits[r](r, layers)

    results = run(decoder, rebuilt_as(recipient), prompts, settings, stages=stages, edit=edit)
    for r, res in enumerate(results):
        if (r in specs and arm != "sham") or stages[r] is None:
            continue
        mine = own[recipient][r]
        if res.fingerprints[0] != mine.fingerprints[0] or res.suffix_ids != mine.suffix_ids:
            if r in specs:
                raise PlaceboError(
                    f"batch row {r}: the sham transplant (the {recipient} cache's own bytes written back through the "
                    "transplant's edit) does not reproduce the recipient's own result byte for byte: the edit path "
                    "changes what it should only copy")
            raise ReplicaMismatchError(
                f"batch row {r}, decoded without an edit beside {len(specs)} transplanted rows, differs from the "
                f"{recipient} construction's own result: a row's continuation must not depend on the values in the "
                "other rows of its batch")
    done = TransplantResults(
        {r: (results[r], classify(results[r].suffix_ids, own[donor][r].suffix_ids, own[recipient][r].suffix_ids))
         for r in specs})
    done.placebo_kinds = {r: e.placebo_kind for r, e in edits.items()}
    return done


def check_placebo(item: str, placebo: RowResult, transplanted: RowResult, noop: bool) -> None:
    """A placebo must not hand the recipient the donor's transplant: its transplanted cache may equal the donor
    transplant's only where the transplant is a no-op (no bytes differ, so both are the recipient's)."""
    if not noop and placebo.fingerprints[0] == transplanted.fingerprints[0]:
        raise PlaceboError(f"{item}: the placebo's transplanted cache is byte-identical to the donor transplant's; a "
                           "placebo that is the real donor controls for nothing")


def directions(own: dict) -> list[tuple[str, str]]:
    """(donor, recipient) both ways between the two constructions of ``own``."""
    names = list(own)
    if len(names) != 2:
        raise ValueError(f"a bidirectional transplant needs exactly two constructions, got {names}")
    return [(names[0], names[1]), (names[1], names[0])]


def whole_cache(num_layers: int) -> TransplantSpec:
    """The sham's spec: every layer, K and V, every position (an identity edit over any part is one over less)."""
    return TransplantSpec("sham", tuple(range(num_layers)))


@dataclass(frozen=True)
class Transplant:
    """One transplant to run: batch row ``row``'s ``recipient`` cache edited by ``spec`` with ``arm``'s bytes."""

    row: int
    donor: str
    recipient: str
    spec: TransplantSpec
    arm: str = "donor"


@dataclass
class Done:
    result: RowResult
    outcome: Outcome
    placebo_kind: str | None  # which placebo was written (arm ``placebo`` only)
    shared: int  # transplants run in the same decode (``rows_transplanted``)


def run_transplants(decoder: Decoder, prompts: list[list[int]], stages: list[list[int] | None],
                    settings: DecodeSettings, own: dict[str, list[RowResult]], transplants: list[Transplant],
                    pack: bool = True) -> list[Done]:
    """Each of ``transplants`` (rows of one recorded batch), in order.

    Packed (``pack``): every decode's row slots filled with transplants, each continued from its recipient's
    recorded boundary cache in the row's own layout (:mod:`stagereplay.experiments.packing`); a sham there must
    reproduce its recipient's own result (cache fingerprint, suffix ids, margins) byte for byte, or
    :class:`PlaceboError`. Unpacked: one decode of the recipient's whole batch per direction, arm and set of rows
    (:func:`transplant_rows`, in order, each row once a decode), as the stages ran before packing."""
    if pack:
        return _packed(decoder, prompts, stages, settings, own, transplants)
    out: list[Done | None] = [None] * len(transplants)
    pending = list(range(len(transplants)))
    while pending:
        first = transplants[pending[0]]
        group, rows, rest = [], set(), []
        for i in pending:
            t = transplants[i]
            if (t.donor, t.recipient, t.arm) == (first.donor, first.recipient, first.arm) and t.row not in rows:
                group.append(i)
                rows.add(t.row)
            else:
                rest.append(i)
        done = transplant_rows(decoder, prompts, stages, settings, own, first.donor, first.recipient,
                               {transplants[i].row: transplants[i].spec for i in group}, first.arm)
        for i in group:
            r = transplants[i].row
            out[i] = Done(done[r][0], done[r][1], done.placebo_kinds[r], len(group))
        pending = rest
    return out


def _packed(decoder, prompts, stages, settings, own, transplants: list[Transplant]) -> list[Done]:
    from stagereplay.experiments.packing import Task, run_packed

    tasks, edits = [], []
    for i, t in enumerate(transplants):
        source = t.recipient if t.arm == "sham" else t.donor
        edit = transplant_edit(t.row, t.spec, own[source][t.row].layers, len(prompts[t.row]), t.arm)
        mine = own[t.recipient][t.row]
        tasks.append(Task(i, len(prompts), mine.pad, list(prompts[t.row]), list(stages[t.row]), mine.layers,
                          lambda layers, edit=edit, row=t.row: edit(row, layers)))
        edits.append(edit)
    packed = run_packed(decoder, tasks, settings)
    out = []
    for i, t in enumerate(transplants):
        res, mine = packed[i].result, own[t.recipient][t.row]
        if t.arm == "sham":
            check_sham(t, res, mine, packed[i].shared)
        outcome = classify(res.suffix_ids, own[t.donor][t.row].suffix_ids, mine.suffix_ids)
        out.append(Done(res, outcome, edits[i].placebo_kind, packed[i].shared))
    return out


def check_sham(t: Transplant, res: RowResult, mine: RowResult, shared: int) -> None:
    """A sham continued in a packed decode must reproduce its recipient's own recorded result byte for byte (cache
    fingerprint, suffix ids, margins): the run's own check that the edit path only copies and that a row's
    continuation does not depend on its slot."""
    if res.fingerprints[0] != mine.fingerprints[0] or res.suffix_ids != mine.suffix_ids or res.margins != mine.margins:
        raise PlaceboError(
            f"batch row {t.row}: the sham (the {t.recipient} cache's own bytes written back), continued in a packed "
            f"decode of {shared} rows, does not reproduce the recipient's own result byte for byte: either the edit "
            "changes what it should only copy or a row's continuation depends on its slot; run the stage with "
            "transplant.pack: false and report it")


def run_shams(decoder: Decoder, prompts, stages, settings: DecodeSettings, own: dict[str, list[RowResult]],
              rows: list[int], pack: bool = True) -> dict[str, dict[int, str]]:
    """The machinery's check, once per direction: each recipient's own bytes over its whole cache written back
    through the transplant's edit; every row must reproduce its own result byte for byte
    (:func:`run_transplants` stops otherwise). Returns recipient -> row -> the sham's cache fingerprint."""
    shams = [Transplant(r, recipient, recipient, whole_cache(len(own[recipient][r].layers)), "sham")
             for _, recipient in directions(own) for r in rows]
    done = run_transplants(decoder, prompts, stages, settings, own, shams, pack)
    out: dict[str, dict[int, str]] = {}
    for t, d in zip(shams, done):
        out.setdefault(t.recipient, {})[t.row] = d.result.fingerprints[0]
    return out


def transplant_batch(decoder: Decoder, prompts: list[list[int]], stages: list[list[int] | None],
                     settings: DecodeSettings, own: dict[str, list[RowResult]], rows: list[int],
                     specs: list[TransplantSpec], labels: dict[int, dict[str, str]] | None = None,
                     pack: bool = True) -> dict[int, list[dict]]:
    """Every spec in both directions between the two constructions of ``own`` (name -> the batch's own results,
    the rows' caches kept) for each of ``rows``, each with its placebo, beside one sham per row and direction
    (:func:`run_shams`), run by :func:`run_transplants` (``pack``: packed decodes). ``labels[r]`` renames a
    construction for row ``r``'s records (a rebuilt live cache that is not bit-exact is ``incremental``).
    Returns, per row, plain row dicts in the order direction, spec."""
    pair = directions(own)
    a, b = pair[0]
    names = {r: labels[r] if labels else {a: a, b: b} for r in rows}
    num_layers = {r: len(own[a][r].layers) for r in rows}
    divergent = {r: first_divergence(own[a][r].suffix_ids, own[b][r].suffix_ids) is not None for r in rows}
    shams = [Transplant(r, recipient, recipient, whole_cache(num_layers[r]), "sham") for _, recipient in pair
             for r in rows]
    wanted = [Transplant(r, donor, recipient, spec, arm) for donor, recipient in pair for spec in specs
              for arm in ("donor", "placebo") for r in rows]
    if pack:  # the shams in the same packed decodes as the transplants they vouch for
        done = run_transplants(decoder, prompts, stages, settings, own, shams + wanted, pack)
        sham = {(t.recipient, t.row): d.result.fingerprints[0] for t, d in zip(shams, done)}
        done = done[len(shams):]
    else:
        sham = {(recipient, r): fp for recipient, fps in run_shams(decoder, prompts, stages, settings, own, rows,
                                                                   pack).items() for r, fp in fps.items()}
        done = run_transplants(decoder, prompts, stages, settings, own, wanted, pack)
    by = {(t.donor, t.spec, t.arm, t.row): d for t, d in zip(wanted, done)}
    out: dict[int, list[dict]] = {r: [] for r in rows}
    for donor, recipient in pair:
        for spec in specs:
            for r in rows:
                name = names[r]
                mine, placebo = by[donor, spec, "donor", r], by[donor, spec, "placebo", r]
                noop = transplanted_bytes_equal(spec, own[donor][r].layers, own[recipient][r].layers, len(prompts[r]))
                check_placebo(f"row {r} {name[donor]}->{name[recipient]} {spec}", placebo.result, mine.result, noop)
                out[r].append({
                    "donor": name[donor], "recipient": name[recipient],
                    "direction": f"{name[donor]}->{name[recipient]}", "sweep": spec.sweep,
                    "layer_set": spec.layer_set(num_layers[r]), "layers": list(spec.layers),
                    "component": spec.component, "positions": spec.positions, "divergent": divergent[r],
                    **result_columns((mine.result, mine.outcome)), "noop": noop,
                    **result_columns((placebo.result, placebo.outcome), "placebo_"),
                    "placebo_kind": placebo.placebo_kind, "sham_cache_fingerprint": sham[recipient, r],
                    "layout_pad": mine.result.pad, "layout_position": mine.result.position,
                    "rows_transplanted": mine.shared,
                })
    return out


def result_columns(done: tuple[RowResult, Outcome], prefix: str = "") -> dict:
    """A transplant's result as record columns (``prefix`` names the arm: "" for the donor's, with its suffix ids
    and margins; ``placebo_`` with fingerprints only)."""
    res, result = done
    cols = {f"{prefix}outcome": result.outcome, f"{prefix}first_divergence_donor": result.first_divergence_donor,
            f"{prefix}first_divergence_recipient": result.first_divergence_recipient,
            f"{prefix}suffix_fingerprint": fingerprint_ids(res.suffix_ids), f"{prefix}stop_reason": res.stop_reason,
            f"{prefix}cache_fingerprint": res.fingerprints[0]}
    if not prefix:
        cols.update(suffix_ids=res.suffix_ids, margins=res.margins)
    return cols


_SAMPLE = re.compile(r"^sample:([1-9][0-9]*)$")
_DIVERGENT_SAMPLE = re.compile(r"^divergent:([1-9][0-9]*)$")


def choose_transplant_items(pairs: pd.DataFrame, select, seed: int = 0) -> pd.DataFrame:
    """Outcome-blind selection of transplant items from ``pairs``.

    ``pairs`` has one row per candidate item (both constructions ok) with ``item_index``, ``item_id``,
    ``suffix_a`` and ``suffix_b`` (the two constructions' suffix ids). Returns the selected rows, sorted by
    item_index, with ``divergent`` and ``first_divergence`` (from token ids only). ``select`` is ``divergent``,
    ``divergent:N`` (N of the divergent items drawn with ``seed``; all of them when there are N or fewer),
    ``sample:N`` or a list of item ids.
    """
    pairs = pairs.copy()
    pairs["first_divergence"] = [first_divergence(list(a), list(b)) for a, b in zip(pairs["suffix_a"], pairs["suffix_b"])]
    pairs["divergent"] = pairs["first_divergence"].notna()
    pairs = pairs.sort_values("item_index", kind="stable").reset_index(drop=True)
    if isinstance(select, str) and select == "divergent":
        chosen = pairs[pairs["divergent"]]
    elif isinstance(select, str) and _DIVERGENT_SAMPLE.match(select):
        n = int(_DIVERGENT_SAMPLE.match(select).group(1))
        divergent = pairs[pairs["divergent"]]
        if len(divergent) <= n:
            chosen = divergent
        else:
            rng = np.random.default_rng(seed)
            chosen = divergent.iloc[sorted(rng.choice(len(divergent), size=n, replace=False).tolist())]
    elif isinstance(select, str) and _SAMPLE.match(select):
        n = int(_SAMPLE.match(select).group(1))
        if n > len(pairs):
            raise ValueError(f"transplant.select: {select} asks for {n} items but only {len(pairs)} have both "
                             "constructions ok; lower N or select 'divergent'")
        rng = np.random.default_rng(seed)
        picked = sorted(rng.choice(len(pairs), size=n, replace=False).tolist())
        chosen = pairs.iloc[picked]
    elif isinstance(select, (list, tuple)):
        known = set(pairs["item_id"])
        missing = [i for i in select if i not in known]
        if missing:
            raise ValueError(f"transplant.select: item ids {missing} are not among the {len(pairs)} items whose "
                             "constructions both ran (status ok); check the ids against the ledger")
        chosen = pairs[pairs["item_id"].isin(set(select))]
    else:
        raise ValueError(f"transplant.select must be 'divergent', 'divergent:N', 'sample:N' or a list of item ids, "
                         f"got {select!r}")
    return chosen.drop(columns=["suffix_a", "suffix_b"]).reset_index(drop=True)
