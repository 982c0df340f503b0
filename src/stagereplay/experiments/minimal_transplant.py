"""The minimal sufficient transplant: a deterministic greedy search, within a budget of transplant runs, for a small
part of the boundary cache (a band of layers x a span of cache positions x K, V or both) whose transplant alone
still carries the donor's continuation.

A part is a *box* (:class:`Box`). The search starts from the whole cache (every layer, K and V, every position),
which must suffice (it is the donor's whole state). Then, in passes until a pass changes nothing, along each axis in
turn (component, layers, positions) it tries the box's candidates in a fixed order and moves to the first that still
suffices: K alone, then V alone; the lower half of the layer band, then the upper; the lower half of the position
span, then the upper (halves split at ``lo + (hi - lo) // 2``). Every box it tries is recorded, none is run twice.

What it guarantees, and what it does not:

- the box it returns was run and carried the donor's continuation (it is *sufficient*, by a run, not by inference);
- when the budget did not run out (``locally_minimal``), no half of it along layers or along positions, and neither
  K alone nor V alone where it holds both, suffices: it is minimal against halving;
- it is **not** a global minimum: a smaller box elsewhere, a union of pieces, or a part that is not a half of a
  half may suffice, and sufficiency need not be monotone (a box may fail where a part of it suffices). The search
  follows one path through the halvings, lower half first.

Knows nothing of models or files: :func:`search` takes a function that runs one transplant of a box and says
whether it followed the donor (:mod:`stagereplay.stages.minimal_transplant` runs it through the one recipe).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from stagereplay.experiments.transplant_specs import TransplantSpec, layer_set_name

SWEEP = "minimal"


@dataclass(frozen=True)
class Box:
    """A part of one boundary cache: layers [layer_lo, layer_hi), component ``kv``, ``k`` or ``v``, cache positions
    [position_lo, position_hi)."""

    layer_lo: int
    layer_hi: int
    component: str
    position_lo: int
    position_hi: int

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(range(self.layer_lo, self.layer_hi))

    def spec(self) -> TransplantSpec:
        return TransplantSpec(SWEEP, self.layers, self.component, (self.position_lo, self.position_hi))

    def label(self, num_layers: int) -> str:
        return (f"layers {layer_set_name(self.layers, num_layers)} · {self.component.upper()} · "
                f"positions [{self.position_lo}, {self.position_hi})")


@dataclass
class SearchResult:
    box: Box | None  # the sufficient box found; None when the whole cache did not suffice
    runs: int  # transplant runs used, the whole-cache one included
    full_sufficient: bool
    budget_exhausted: bool  # a box the search wanted to try was left untried
    locally_minimal: bool  # every half and single component of ``box`` was tried and did not suffice
    trials: list[tuple[Box, bool]] = field(default_factory=list)  # in the order run


def _halves(lo: int, hi: int) -> list[tuple[int, int]]:
    if hi - lo < 2:
        return []
    mid = lo + (hi - lo) // 2
    return [(lo, mid), (mid, hi)]


def candidates(box: Box, axis: str) -> list[Box]:
    """The boxes one step smaller than ``box`` along ``axis`` (component, layers, positions), in the order tried."""
    if axis == "component":
        return [replace(box, component=c) for c in ("k", "v")] if box.component == "kv" else []
    if axis == "layers":
        return [replace(box, layer_lo=lo, layer_hi=hi) for lo, hi in _halves(box.layer_lo, box.layer_hi)]
    if axis == "positions":
        return [replace(box, position_lo=lo, position_hi=hi) for lo, hi in _halves(box.position_lo, box.position_hi)]
    raise ValueError(f"axis must be component, layers or positions, got {axis!r}")


AXES = ("component", "layers", "positions")


class _BudgetSpent(Exception):
    pass


def search_steps(num_layers: int, cache_length: int, budget: int):
    """The greedy bisection of the module's docstring as a generator: it yields each box to run (at most
    ``budget``, each box once), is sent whether that box sufficed, and returns the :class:`SearchResult`. Driven
    by :func:`search` one box at a time, or by :func:`search_together` for several searches in lockstep."""
    if budget < 1:
        raise ValueError(f"the search needs a budget of at least one transplant run, got {budget}")
    if num_layers < 1 or cache_length < 1:
        raise ValueError(f"nothing to transplant: {num_layers} layers, {cache_length} cache positions")
    tried: dict[Box, bool] = {}
    trials: list[tuple[Box, bool]] = []

    def test(box: Box):
        if box not in tried:
            if len(trials) >= budget:
                raise _BudgetSpent
            tried[box] = bool((yield box))
            trials.append((box, tried[box]))
        return tried[box]

    whole = Box(0, num_layers, "kv", 0, cache_length)
    if not (yield from test(whole)):
        return SearchResult(None, len(trials), False, False, False, trials)
    box, exhausted = whole, False
    try:
        changed = True
        while changed:
            changed = False
            for axis in AXES:
                narrowed = True
                while narrowed:
                    narrowed = False
                    for candidate in candidates(box, axis):
                        if (yield from test(candidate)):
                            box, narrowed, changed = candidate, True, True
                            break
    except _BudgetSpent:
        exhausted = True
    minimal = not exhausted and all(c in tried and not tried[c] for axis in AXES for c in candidates(box, axis))
    return SearchResult(box, len(trials), True, exhausted, minimal, trials)


def search(sufficient: Callable[[Box], bool], num_layers: int, cache_length: int, budget: int) -> SearchResult:
    """The greedy bisection of the module's docstring; ``sufficient(box)`` runs one transplant (at most ``budget``
    calls in all, each box once)."""
    return search_together(lambda boxes: {key: sufficient(box) for key, box in boxes.items()},
                           {None: (num_layers, cache_length)}, budget)[None]


def search_together(sufficient: Callable[[dict], dict], starts: dict, budget: int) -> dict:
    """Several searches in lockstep: ``starts`` maps a key (a batch row, say) to its (num_layers, cache_length);
    each round ``sufficient({key: box})`` runs the next box of every search still going (in one batched decode,
    say) and returns ``{key: whether it sufficed}``. Each search tries exactly the boxes :func:`search` alone
    would; returns ``{key: SearchResult}``."""
    running, results = {}, {}
    for key, (num_layers, cache_length) in starts.items():
        gen = search_steps(num_layers, cache_length, budget)
        try:
            running[key] = (gen, next(gen))
        except StopIteration as stop:
            results[key] = stop.value
    while running:
        answers = sufficient({key: box for key, (_, box) in running.items()})
        for key, (gen, _) in list(running.items()):
            try:
                running[key] = (gen, gen.send(answers[key]))
            except StopIteration as stop:
                results[key] = stop.value
                del running[key]
    return results


def span_shares(lo: int, hi: int, prompt_length: int, cache_length: int) -> dict[str, float | None]:
    """The span [lo, hi) as a share of the cache's positions, of the prompt's and of the cached stage ids' (None
    where the part is empty)."""
    def overlap(a: int, b: int) -> int:
        return max(0, min(hi, b) - max(lo, a))

    prompt = min(prompt_length, cache_length)
    stage = cache_length - prompt
    return {"share_of_cache": (hi - lo) / cache_length,
            "share_of_prompt": overlap(0, prompt) / prompt if prompt else None,
            "share_of_stage": overlap(prompt, cache_length) / stage if stage else None}
