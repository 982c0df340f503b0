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

Knows nothing of Parquet paths or Snakemake (:mod:`stagereplay.stages.transplant` does the files).
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

SWEEPS = ("all", "single_layers", "quarters", "halves", "k_only", "v_only", "prompt_positions", "stage_positions")
COMPONENTS = ("kv", "k", "v")
POSITIONS = ("all", "prompt", "stage")


@dataclass(frozen=True)
class TransplantSpec:
    """One transplant of a sweep: which layers, which of K/V, which cache positions (a name of :data:`POSITIONS`
    or an explicit span ``(lo, hi)`` of cache positions)."""

    sweep: str
    layers: tuple[int, ...]
    component: str = "kv"
    positions: str | tuple[int, int] = "all"

    def layer_set(self, num_layers: int) -> str:
        return layer_set_name(self.layers, num_layers)


def layer_set_name(layers, num_layers: int) -> str:
    """``all`` for every layer, ``L7`` for one, ``0-11`` for a contiguous band, else comma-separated."""
    layers = sorted(layers)
    if layers == list(range(num_layers)):
        return "all"
    if len(layers) == 1:
        return f"L{layers[0]}"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(str(i) for i in layers)


def _bands(num_layers: int, parts: int) -> list[tuple[int, ...]]:
    """``parts`` contiguous bands whose sizes differ by at most one (fewer when there are fewer layers)."""
    return [tuple(int(i) for i in band) for band in np.array_split(np.arange(num_layers), parts) if len(band)]


def enumerate_sweeps(sweeps, num_layers: int) -> list[TransplantSpec]:
    """The transplants that ``sweeps`` asks for on a model of ``num_layers`` layers, each once, in request order.

    A transplant asked for by two sweeps (the quarters of a 4-layer model are its single layers) appears once,
    under the first sweep that asked for it.
    """
    unknown = [s for s in sweeps if s not in SWEEPS]
    if unknown:
        raise ValueError(f"transplant.sweeps: unknown sweep(s) {unknown}; choose among {list(SWEEPS)}")
    if num_layers < 1:
        raise ValueError(f"a model needs at least one layer to transplant, got {num_layers}")
    every = tuple(range(num_layers))
    specs: list[TransplantSpec] = []
    for sweep in sweeps:
        if sweep == "all":
            specs.append(TransplantSpec(sweep, every))
        elif sweep == "single_layers":
            specs += [TransplantSpec(sweep, (i,)) for i in every]
        elif sweep == "quarters":
            specs += [TransplantSpec(sweep, band) for band in _bands(num_layers, 4)]
        elif sweep == "halves":
            specs += [TransplantSpec(sweep, band) for band in _bands(num_layers, 2)]
        elif sweep == "k_only":
            specs.append(TransplantSpec(sweep, every, "k"))
        elif sweep == "v_only":
            specs.append(TransplantSpec(sweep, every, "v"))
        elif sweep == "prompt_positions":
            specs.append(TransplantSpec(sweep, every, "kv", "prompt"))
        elif sweep == "stage_positions":
            specs.append(TransplantSpec(sweep, every, "kv", "stage"))
    seen, unique = set(), []
    for spec in specs:
        key = (spec.layers, spec.component, spec.positions)
        if key not in seen:
            seen.add(key)
            unique.append(spec)
    return unique


def position_range(positions: str | tuple[int, int], prompt_len: int, cache_len: int) -> tuple[int, int]:
    """Cache positions [lo, hi) of ``all``, ``prompt`` (the prompt ids), ``stage`` (the cached stage ids) or of an
    explicit span ``(lo, hi)``, which must lie in the cache and hold a position."""
    if isinstance(positions, tuple):
        lo, hi = (int(x) for x in positions)
        if not 0 <= lo < hi <= cache_len:
            raise ValueError(f"position span [{lo}, {hi}) is not a non-empty span of the cache's {cache_len} positions")
        return lo, hi
    if positions == "all":
        return 0, cache_len
    if positions == "prompt":
        return 0, min(prompt_len, cache_len)
    if positions == "stage":
        return min(prompt_len, cache_len), cache_len
    raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")


def rebuilt_as(construction: str) -> str:
    """The construction that rebuilds ``construction`` from ids: ``live`` by its own schedule, ``incremental``."""
    return "incremental" if construction == "live" else construction


def transplant_edit(row: int, spec: TransplantSpec, donor: Layers, prompt_len: int):
    """The edit that writes the donor's K and/or V of ``spec`` into row ``row``'s boundary cache, in place."""
    if spec.component not in COMPONENTS:
        raise ValueError(f"component must be one of {COMPONENTS}, got {spec.component!r}")

    def edit(r: int, layers: Layers) -> None:
        if r != row:
            return
        if len(donor) != len(layers):
            raise ValueError(f"donor has {len(donor)} layers, recipient {len(layers)}: not the same model")
        for i in spec.layers:
            if not 0 <= i < len(layers):
                raise ValueError(f"layer {i} is outside the model's {len(layers)} layers")
            (dk, dv), (k, v) = donor[i], layers[i]
            if dk.shape != k.shape or dv.shape != v.shape or dk.dtype != k.dtype:
                raise ValueError(
                    f"layer {i}: donor K/V {tuple(dk.shape)} {dk.dtype} and recipient {tuple(k.shape)} {k.dtype} do "
                    "not match; donor and recipient must be boundary caches of the same prefix at the same precision")
            lo, hi = position_range(spec.positions, prompt_len, k.shape[2])  # (1, kv_heads, seq, head_dim)
            if spec.component in ("kv", "k"):
                k[:, :, lo:hi].copy_(dk[:, :, lo:hi])
            if spec.component in ("kv", "v"):
                v[:, :, lo:hi].copy_(dv[:, :, lo:hi])

    return edit


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


def transplant_rows(decoder: Decoder, prompts: list[list[int]], stages: list[list[int] | None],
                    settings: DecodeSettings, own: dict[str, list[RowResult]], donor: str, recipient: str,
                    specs: dict[int, TransplantSpec]) -> dict[int, tuple[RowResult, Outcome]]:
    """Transplants of several rows of one batch in one decode: the recipient's whole batch decoded again (the one
    recipe, the batch's own layout) with row ``r``'s boundary cache edited by ``specs[r]`` from the donor's row
    ``r``; each edited row's result and outcome.

    A row's bits may depend on its batch's layout (rows, padding, buffer length), which every transplant keeps, but
    never on the values in the other rows: every row decoded here without an edit is checked to reproduce the
    recipient's own result bit for bit (cache fingerprint and suffix ids), so a transplant that leaked into another
    row would stop the stage, not pass as data."""
    edits = {r: transplant_edit(r, spec, own[donor][r].layers, len(prompts[r])) for r, spec in specs.items()}

    def edit(r: int, layers: Layers) -> None:
        if r in edits:
            edits[r](r, layers)

    results = run(decoder, rebuilt_as(recipient), prompts, settings, stages=stages, edit=edit)
    for r, res in enumerate(results):
        if r in specs or stages[r] is None:
            continue
        mine = own[recipient][r]
        if res.fingerprints[0] != mine.fingerprints[0] or res.suffix_ids != mine.suffix_ids:
            raise ReplicaMismatchError(
                f"batch row {r}, decoded without an edit beside {len(specs)} transplanted rows, differs from the "
                f"{recipient} construction's own result: a row's continuation must not depend on the values in the "
                "other rows of its batch")
    return {r: (results[r], classify(results[r].suffix_ids, own[donor][r].suffix_ids, own[recipient][r].suffix_ids))
            for r in specs}


def directions(own: dict) -> list[tuple[str, str]]:
    """(donor, recipient) both ways between the two constructions of ``own``."""
    names = list(own)
    if len(names) != 2:
        raise ValueError(f"a bidirectional transplant needs exactly two constructions, got {names}")
    return [(names[0], names[1]), (names[1], names[0])]


def transplant_batch(decoder: Decoder, prompts: list[list[int]], stages: list[list[int] | None],
                     settings: DecodeSettings, own: dict[str, list[RowResult]], rows: list[int],
                     specs: list[TransplantSpec], labels: dict[int, dict[str, str]] | None = None
                     ) -> dict[int, list[dict]]:
    """Every spec in both directions between the two constructions of ``own`` (name -> the batch's own results,
    the rows' caches kept) for each of ``rows``: per direction and spec, one decode of the recipient's whole batch
    with every one of ``rows`` edited (:func:`transplant_rows`). ``labels[r]`` renames a construction for row
    ``r``'s records (a rebuilt live cache that is not bit-exact is ``incremental``). Returns, per row, plain row
    dicts in the order direction, spec."""
    pair = directions(own)
    a, b = pair[0]
    names = {r: labels[r] if labels else {a: a, b: b} for r in rows}
    num_layers = {r: len(own[a][r].layers) for r in rows}
    divergent = {r: first_divergence(own[a][r].suffix_ids, own[b][r].suffix_ids) is not None for r in rows}
    out: dict[int, list[dict]] = {r: [] for r in rows}
    for donor, recipient in pair:
        for spec in specs:
            done = transplant_rows(decoder, prompts, stages, settings, own, donor, recipient, {r: spec for r in rows})
            for r in rows:
                res, result = done[r]
                name = names[r]
                out[r].append({
                    "donor": name[donor], "recipient": name[recipient],
                    "direction": f"{name[donor]}->{name[recipient]}", "sweep": spec.sweep,
                    "layer_set": spec.layer_set(num_layers[r]), "layers": list(spec.layers),
                    "component": spec.component, "positions": spec.positions, "divergent": divergent[r],
                    "outcome": result.outcome, "first_divergence_donor": result.first_divergence_donor,
                    "first_divergence_recipient": result.first_divergence_recipient,
                    "suffix_ids": res.suffix_ids, "suffix_fingerprint": fingerprint_ids(res.suffix_ids),
                    "margins": res.margins, "stop_reason": res.stop_reason, "cache_fingerprint": res.fingerprints[0],
                    "layout_pad": res.pad, "layout_position": res.position, "rows_transplanted": len(rows),
                })
    return out


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
