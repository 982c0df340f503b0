"""What a cell decodes, counted as the decoder does it (src/stagereplay/decode, src/stagereplay/experiments): the
units of work (:class:`Work`) that :mod:`.jobs` counts per model rule. Prices nothing (:mod:`.pricing` does).

One *cell* is one construction decoded over one batch (``decode_rows``):

- batch > 1, the ``lockstep`` schedule (the live schedule for every construction, as the decoder ran before the
  suffix schedule; price runs made then with it): the prompts in one forward (B * W tokens), then S_b + N_b - 1
  steps at B rows (S_b - 1 without a suffix). ``prefill`` first builds its caches in one forward of
  B * (W + S_b - 1) tokens; ``chunked`` and ``prefix_cached`` build theirs by per-row forwards of their segments
  (priced as one batch-1 step each plus their tokens at the prefill rate: not measured as such). A built
  construction (``prefill``, ``chunked``, ``prefix_cached``) skips the steps before the batch's first boundary,
  K = s_b - 1 of them (s_b: the mean over batches of a batch's shortest stage; the ledger's
  ``batch_stage_shortest``, 1 for a run that did not record it, made before the skip): S_b + N_b - 1 - K steps
  from cache length W + K.
- batch > 1, the ``suffix`` schedule (the default, the decoder's now: decode/greedy.py; a run's JSON may record
  ``schedule``, a run that records none is priced as suffix): ``live`` and ``incremental`` as in lockstep; a built
  construction builds its caches as there (the same forwards and tokens) and then decodes only N_b steps at B rows
  (none without a suffix), each row from its own boundary (priced from the rows' mean, cache length W + S - 1): no
  prompt forward, no teacher-forced stage step, no skip. With every stage of one length (s_b = S_b) the lockstep
  skip leaves the same N_b steps, and the two schedules differ by the prompt forward only.
- batch 1 (one row, which starts at its boundary): ``live`` and ``incremental`` P tokens then S + N - 1 steps at 1
  row (S - 1 without a suffix); ``prefill`` P + S - 1 tokens then N steps (none without a suffix). Either schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from stagereplay import catalogue
from stagereplay.experiments.transplant_specs import rebuilt_as
from stagereplay.projection.shape import RunShape


@dataclass
class Work:
    """Decode work at one precision: batched decode steps by row count, one-shot prefill tokens, rows whose boundary
    cache is fingerprinted, live rows' stage steps (the boundary matcher's), cache bytes dumped. ``segments`` holds
    the same steps by where they run, {(rows, start, count): how many times}: ``count`` steps from cache length
    ``start`` (what a measure of the triton attention prices step by step)."""

    steps: dict = field(default_factory=dict)  # rows -> steps
    prefill_tokens: float = 0.0
    boundary_rows: float = 0.0
    matcher_row_steps: float = 0.0
    dump_GB: float = 0.0
    segments: dict = field(default_factory=dict)  # (rows, start, count) -> multiplicity
    observed_row_steps: float = 0.0  # rows' fp32 logits copied and kept at a suffix step (measure_fidelity)
    compared_row_steps: float = 0.0  # compared rows' steps: step_measures and the table row (measure_fidelity)

    def __add__(self, other: "Work") -> "Work":
        steps = dict(self.steps)
        for rows, count in other.steps.items():
            steps[rows] = steps.get(rows, 0.0) + count
        segments = dict(self.segments)
        for key, times in other.segments.items():
            segments[key] = segments.get(key, 0.0) + times
        return Work(steps, self.prefill_tokens + other.prefill_tokens, self.boundary_rows + other.boundary_rows,
                    self.matcher_row_steps + other.matcher_row_steps, self.dump_GB + other.dump_GB, segments,
                    self.observed_row_steps + other.observed_row_steps,
                    self.compared_row_steps + other.compared_row_steps)

    def __mul__(self, k: float) -> "Work":
        return Work({rows: count * k for rows, count in self.steps.items()}, self.prefill_tokens * k,
                    self.boundary_rows * k, self.matcher_row_steps * k, self.dump_GB * k,
                    {key: times * k for key, times in self.segments.items()}, self.observed_row_steps * k,
                    self.compared_row_steps * k)

    __rmul__ = __mul__


def decoded(rows: int, start: float, count: float, times: float = 1.0, **rest) -> Work:
    """``times`` x ``count`` decode steps at ``rows`` rows from cache length ``start`` (the first step attends
    ``start`` + 1 positions), with the rest of a Work's fields."""
    return Work({rows: count * times}, segments={(rows, start, count): times} if count else {}, **rest)


def total(works) -> Work:
    out = Work()
    for work in works:
        out = out + work
    return out


# How each of the catalogue's segment rules is priced; "live": a cache only retained from the generation (no rule).
PRICED_RULES = ("live", "incremental", "prefill", "chunked", "prefix_cached")


def priced_as(construction: str) -> str:
    """The construction's segment rule (its catalogue entry's; ``live`` where it is only retained), which is what the
    projection prices: a new construction that reuses a rule needs no edit here."""
    rule = catalogue.construction(construction).segment_rule or "live"  # unknown: the catalogue's error
    if rule not in PRICED_RULES:
        raise ValueError(f"construction {construction!r}: the projection prices no segment rule {rule!r}; add it to "
                         f"{__name__} (priced: {list(PRICED_RULES)}; docs/EXTENDING.md)")
    return rule


def segment_forwards(rule: str, tokens: float, chunk: int) -> float:
    """Per-row forwards of a construction built segment by segment (rules chunked, prefix_cached), for ``tokens``
    ids."""
    return math.ceil(tokens / chunk) if rule == "chunked" else 2.0


def cell(shape: RunShape, construction: str, suffix: bool = True, alone: bool = False, rows: int | None = None) -> Work:
    """One construction decoded over one batch of ``rows`` rows (the run's batch size unless given: a partial last
    batch has fewer); ``alone``: one item at batch 1 whatever the run's batch size. Priced by its segment rule."""
    rule = priced_as(construction)
    if shape.lockstep and not alone:
        rows, W, S, N = rows or shape.rows, shape.W, shape.S_b, shape.N_b
        if shape.schedule == "suffix" and rule not in ("live", "incremental"):
            # its rows start at their own boundaries (the rows' mean, W + S - 1) from the built caches: the batch's
            # longest suffix, no prompt forward, no teacher-forced stage step
            work = decoded(rows, W + shape.S - 1, N if suffix else 0.0)
        else:
            skip = 0.0 if rule in ("live", "incremental") else shape.skip  # before the first boundary
            work = decoded(rows, W + skip, S - 1 + (N if suffix else 0) - skip, prefill_tokens=rows * W)  # live schedule
        built = rows * (W + S - 1)
    else:
        rows, W, S, N = 1, shape.P, shape.S, shape.N
        if rule in ("live", "incremental"):  # the prompt, then every token one step
            return decoded(1, W, S - 1 + (N if suffix else 0), prefill_tokens=W, boundary_rows=1,
                           matcher_row_steps=S if rule == "live" else 0.0)
        work = decoded(1, W + S - 1, N if suffix else 0.0)  # from the built cache at the boundary
        built = W + S - 1
    if rule == "prefill":
        work.prefill_tokens += built
    elif rule in ("chunked", "prefix_cached"):
        forwards = rows * segment_forwards(rule, W + S - 1, shape.config["chunk_size"])
        # each forward priced as one step at the boundary cache's end (its keys: the prompt and the stage)
        work = work + decoded(1, W + S - 2, 1, times=forwards, prefill_tokens=built)
        note = f"{construction}: its per-row segment forwards are priced as batch-1 steps plus prefill tokens"
        if note not in shape.warnings:
            shape.warnings.append(note)
    work.boundary_rows = rows
    work.matcher_row_steps = rows * S if rule == "live" else 0.0
    return work


def rebuild(shape: RunShape, rows: int | None = None) -> Work:
    """Both constructions of ``transplant.constructions`` rebuilt with their suffixes (the stages' ``Rebuild``)."""
    return total(cell(shape, rebuilt_as(c), rows=rows) for c in shape.config["transplant"]["constructions"])


def by_kind(held: dict, per_batch) -> Work:
    """``per_batch(rows)`` in each of the batches ``held`` counts by their rows."""
    return total(per_batch(rows) * batches for rows, batches in held.items())
