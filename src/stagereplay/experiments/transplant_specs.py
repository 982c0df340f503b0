"""What a transplant moves: the sweeps' specs (layers x K/V x cache positions), their names, and which construction
rebuilds a cache from ids. Pure Python (no torch), read by the experiments, the selection, the library's argument
checks and the projection."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
