"""K/V transplantation between boundary caches, the sweeps that localise the carrier, and outcome-blind selection.

A transplant continues from a copy of the recipient construction's boundary cache in which the donor's K and/or V
replace a set of layers S, at all cache positions or only the prompt's or the stage's. With DESIGN.md's boundary
state both constructions share the pending token, so an all-layer, all-position K/V transplant hands the recipient
the donor's whole state: the continuation must then equal the donor's own, and a miss is a finding.

Outcome of one transplant: ``donor`` (suffix ids equal the donor's own continuation), ``recipient`` (equal the
recipient's own), else ``neither``; where donor and recipient agree with each other (a non-divergent item) an
equal suffix counts as ``donor`` and the row's ``divergent`` is false.

Selection never looks at correctness or at transplant outcomes: ``divergent`` compares the two constructions' suffix
token ids, ``sample:N`` draws N items with a seed, an explicit list names item ids.

Knows nothing of Parquet paths or Snakemake (:mod:`stagereplay.transplant_stages` does the files).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from stagereplay.models import compat
from stagereplay.engine import Decoder, continue_greedy, first_divergence

SWEEPS = ("all", "single_layers", "quarters", "halves", "k_only", "v_only", "prompt_positions", "stage_positions")
COMPONENTS = ("kv", "k", "v")
POSITIONS = ("all", "prompt", "stage")


@dataclass(frozen=True)
class TransplantSpec:
    """One transplant of a sweep: which layers, which of K/V, which cache positions."""

    sweep: str
    layers: tuple[int, ...]
    component: str = "kv"
    positions: str = "all"

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


def position_range(positions: str, prompt_len: int, cache_len: int) -> tuple[int, int]:
    """Cache positions [lo, hi) of ``all``, ``prompt`` (the prompt ids) or ``stage`` (the cached stage ids)."""
    if positions == "all":
        return 0, cache_len
    if positions == "prompt":
        return 0, min(prompt_len, cache_len)
    if positions == "stage":
        return min(prompt_len, cache_len), cache_len
    raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")


def transplant_cache(recipient, donor, layers, component: str = "kv", positions: str = "all", prompt_len: int = 0):
    """A copy of ``recipient`` whose ``layers`` carry the donor's K and/or V at ``positions``; inputs untouched."""
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {COMPONENTS}, got {component!r}")
    donor_layers = compat.cache_layers(donor)
    out = copy.deepcopy(recipient)
    out_layers = compat.cache_layers(out)
    if len(donor_layers) != len(out_layers):
        raise ValueError(f"donor has {len(donor_layers)} layers, recipient {len(out_layers)}: not the same model")
    for i in layers:
        if not 0 <= i < len(out_layers):
            raise ValueError(f"layer {i} is outside the model's {len(out_layers)} layers")
        (dk, dv), (rk, rv) = donor_layers[i], out_layers[i]
        if dk.shape != rk.shape or dv.shape != rv.shape or dk.dtype != rk.dtype:
            raise ValueError(
                f"layer {i}: donor K/V {tuple(dk.shape)} {dk.dtype} and recipient {tuple(rk.shape)} {rk.dtype} do not "
                "match; donor and recipient must be boundary caches of the same prefix at the same precision"
            )
        lo, hi = position_range(positions, prompt_len, rk.shape[2])  # K/V: (batch, kv_heads, seq, head_dim)

        def merged(d: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
            if (lo, hi) == (0, r.shape[2]):
                return d
            new = r.clone()
            new[:, :, lo:hi] = d[:, :, lo:hi]
            return new

        compat.set_cache_layer(out, i,
                               keys=merged(dk, rk) if component in ("kv", "k") else None,
                               values=merged(dv, rv) if component in ("kv", "v") else None)
    return out


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


def run_transplants(decoder: Decoder, caches: dict, suffixes: dict, pending_id: int, prompt_len: int,
                    specs: list[TransplantSpec], max_new_tokens: int, continue_with=None) -> list[dict]:
    """Every spec in both directions between the two constructions of ``caches`` (name -> boundary cache).

    ``suffixes`` holds each construction's own continuation (name -> ids). Returns plain row dicts.
    ``continue_with(recipient, cache)``, when given, continues a transplanted cache where the recipient's own
    continuation ran (a batched row: in its batch) and returns what :func:`continue_greedy` would.
    """
    from stagereplay.io.fingerprints import fingerprint_ids, fingerprint_layers

    names = list(caches)
    if len(names) != 2:
        raise ValueError(f"a bidirectional transplant needs exactly two constructions, got {names}")
    num_layers = len(compat.cache_layers(caches[names[0]]))
    divergent = first_divergence(suffixes[names[0]], suffixes[names[1]]) is not None
    rows = []
    for donor, recipient in ((names[0], names[1]), (names[1], names[0])):
        for spec in specs:
            cache = transplant_cache(caches[recipient], caches[donor], spec.layers, spec.component, spec.positions,
                                     prompt_len)
            cache_fp = fingerprint_layers(compat.cache_layers(cache))[0]
            cont = (continue_with(recipient, cache) if continue_with is not None
                    else continue_greedy(decoder, cache, pending_id, max_new_tokens, copy_cache=False))
            result = classify(cont.suffix_ids, suffixes[donor], suffixes[recipient])
            rows.append({
                "donor": donor, "recipient": recipient, "direction": f"{donor}->{recipient}",
                "sweep": spec.sweep, "layer_set": spec.layer_set(num_layers), "layers": list(spec.layers),
                "component": spec.component, "positions": spec.positions, "divergent": divergent,
                "outcome": result.outcome, "first_divergence_donor": result.first_divergence_donor,
                "first_divergence_recipient": result.first_divergence_recipient,
                "suffix_ids": cont.suffix_ids, "suffix_fingerprint": fingerprint_ids(cont.suffix_ids),
                "margins": cont.margins, "stop_reason": cont.stop_reason, "cache_fingerprint": cache_fp,
            })
    return rows


_SAMPLE = re.compile(r"^sample:([1-9][0-9]*)$")


def select_items(pairs: pd.DataFrame, select, seed: int = 0) -> pd.DataFrame:
    """Outcome-blind selection of transplant items from ``pairs``.

    ``pairs`` has one row per candidate item (both constructions ok) with ``item_index``, ``item_id``,
    ``suffix_a`` and ``suffix_b`` (the two constructions' suffix ids). Returns the selected rows, sorted by
    item_index, with ``divergent`` and ``first_divergence`` (from token ids only). ``select`` is ``divergent``,
    ``sample:N`` or a list of item ids.
    """
    pairs = pairs.copy()
    pairs["first_divergence"] = [first_divergence(list(a), list(b)) for a, b in zip(pairs["suffix_a"], pairs["suffix_b"])]
    pairs["divergent"] = pairs["first_divergence"].notna()
    pairs = pairs.sort_values("item_index", kind="stable").reset_index(drop=True)
    if isinstance(select, str) and select == "divergent":
        chosen = pairs[pairs["divergent"]]
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
        raise ValueError(f"transplant.select must be 'divergent', 'sample:N' or a list of item ids, got {select!r}")
    return chosen.drop(columns=["suffix_a", "suffix_b"]).reset_index(drop=True)
