"""The greedy loop over a batch of rows, and the boundary matcher: one loop for every construction and regime.

:func:`decode_rows` runs one batch from its prompts to each row's boundary and on through its suffix, in one of two
schedules chosen by the decoder (:meth:`~stagereplay.decode.protocol.Decoder.independent_rows` and
:meth:`~stagereplay.decode.protocol.Decoder.rows_from_boundaries`):

- the *live schedule*, for ``live`` and, in a static batch of several rows, for its own construction
  (``incremental``): prompts in one forward, then one token per step, each row fed its stage ids (or its greedy
  choices for ``live``) and on into its suffix; rows step in lockstep in a static batch.
- *from the boundaries*, for a construction built from ids (``build``): each row continues from its own boundary
  cache; the rows of a static batch step together, each at its own buffer position, so the construction decodes its
  suffixes only. The bits are those the live schedule gives the row: there, a row's suffix step is one step of the
  same rows at the row's own position, through the same kernels and shapes (the batch's rows, the whole buffer),
  reading the same cache (its built cache, then its own suffix steps); a row's values depend on neither the other
  rows' values nor the step at which it runs, and positions past its own are masked (or not read). Where a decoder
  does not offer it (``rows_from_boundaries`` false), a built construction runs the live schedule too, its cache
  written over the row's positions at the row's boundary and the steps before the batch's first boundary skipped
  (``advance``: every row is teacher-forced there and reads nothing). Either way every construction of a batch is
  decoded in one layout: the same rows, padding and positions; only the boundary cache differs.

A decoder with ``lookahead`` (the ``cuda_graph`` regime) lets the loop hide its host work behind the device's: the
next step is launched from the device's own greedy choice (or the teacher-forced id) before the host has read the
choice, and the host checks the step while it runs. Where the host must change the cache before the next step (a
row's boundary, with a construction's cache to swap in or an edit to apply), it takes the step back
(``rewind``) and feeds it again; a row that has finished is fed its greedy choice instead of padding, which no row
reads. The ids, margins and caches are those of the plain loop (tested).

At each row's boundary, after the construction's cache is in place and before the pending token is fed, ``edit``
may change the row's cache in place (a transplant), and the row's boundary fingerprints are taken from the very
tensors the continuation reads. The loop knows nothing of tokenizers beyond the matcher it is given, nothing of the
ledger and nothing of Snakemake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from stagereplay.decode.choice import Lookahead, greedy_choice
from stagereplay.decode.protocol import Decoder, Layers, RegimeError
from stagereplay.io.fingerprints import PendingFingerprints

# torch is imported where the loop computes, not here: the ledger's rows and the experiments' tables import this
# module's types (RowResult, BoundaryMatcher) in jobs that load no model, which must not pay for torch.
if TYPE_CHECKING:
    import torch


class BoundaryMatcher:
    """Finds the stage boundary in generated ids: the ``occurrence``-th appearance of a marker.

    A marker is either a token id sequence (matched on ids) or a string (matched on the decoded text, so a
    marker that a BPE tokenizer merges with its neighbours is still found). The boundary token is the token
    whose addition completes the marker's ``occurrence``-th appearance.
    """

    def __init__(self, occurrence: int = 1, token_ids: list[int] | None = None, text: str | None = None,
                 decode=None):
        if (token_ids is None) == (text is None):
            raise ValueError("a boundary marker is either token ids or a string, not both or neither")
        if occurrence < 1:
            raise ValueError("boundary occurrence counts from 1")
        if text is not None and decode is None:
            raise ValueError("a string boundary marker needs a decode function")
        self.occurrence, self.token_ids, self.text, self.decode = occurrence, token_ids, text, decode

    def reached(self, generated: list[int]) -> bool:
        """Whether the last id of ``generated`` completes the boundary."""
        if self.token_ids is not None:
            n = len(self.token_ids)
            if generated[-n:] != list(self.token_ids):
                return False
            count = sum(generated[i:i + n] == list(self.token_ids) for i in range(len(generated) - n + 1))
            return count == self.occurrence
        last_piece = self.decode(generated[-1:])
        if not last_piece or self.text[-1] not in last_piece:
            return False
        text = self.decode(generated)
        before = self.decode(generated[:-1])
        return text.count(self.text) >= self.occurrence > before.count(self.text)


def stage_end(matcher: BoundaryMatcher, generated: list[int], max_stage_tokens: int, eos: bool) -> str | None:
    """Where a greedy stage stands after its last id: ``"boundary"`` when that id completes the marker's occurrence,
    ``"boundary_missing"`` when ``max_stage_tokens`` ids are spent or the id ends generation (``eos``) first, else
    None (go on). The one stage rule of every decoder that generates a stage: this loop, the llama.cpp engine."""
    if matcher.reached(generated):
        return "boundary"
    if len(generated) >= max_stage_tokens or eos:
        return "boundary_missing"
    return None


@dataclass(frozen=True)
class CacheBuild:
    """How a construction builds a row's boundary cache from its ids: forwards of ``segments(prompt_len, n_cached)``
    tokens in order. ``schedule`` marks the construction that *is* the live schedule (prompt in one forward, then
    one token per step: ``incremental``), whose cache the lockstep schedule makes itself."""

    segments: Callable[[int, int], list[int]]
    schedule: bool = False


@dataclass
class RowResult:
    stage_ids: list[int]  # up to and including the boundary token ([] when there is none)
    suffix_ids: list[int]  # without a boundary: everything generated within the stage budget
    margins: list[float]  # top-2 logit margin at every suffix step (fp32 logits)
    stop_reason: str  # eos | max_new_tokens | nonfinite | boundary_missing | no_prefix
    pad: int | None = None  # the row's layout: left padding and the pending token's buffer position
    position: int | None = None
    fingerprints: tuple[str, list[str], list[str]] | None = None  # of the boundary cache the continuation read
    layers: Layers | None = None  # a copy of that cache (rows in ``keep`` only)

    @property
    def status(self) -> str:
        """``ok`` (the boundary was reached, whatever the suffix did), ``boundary_missing`` or ``nonfinite``."""
        if self.stop_reason == "nonfinite":
            return "nonfinite"
        return "ok" if self.stage_ids else "boundary_missing"


class _TokenCount:
    """Tokens the greedy loop has chosen or fed (stage and suffix, every row) in this process: what progress
    reports read as tokens/s. Never part of a result."""

    def __init__(self):
        self.total = 0


TOKENS = _TokenCount()


@dataclass
class _Row:
    forced: list[int] | None
    generated: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    boundary_at: int | None = None  # index into generated of the boundary token
    done: str | None = None


@dataclass
class _Loop:
    """One batch's decode as the loop's phases share it: the decoder, its batch and rows, the construction's cache
    swapped in at each row's boundary (``built``: None where the rows start from it or read the schedule's own),
    the boundary results so far, and what :func:`decode_rows` was asked for."""

    decoder: Decoder
    prompts: list[list[int]]
    rows: list[_Row]
    max_new_tokens: int
    max_stage_tokens: int
    matcher: BoundaryMatcher | None
    edit: Callable[[int, Layers], None] | None
    keep: set[int] | frozenset
    suffixes: list[list[int] | None] | None
    observe: Callable[[int, int, torch.Tensor], None] | None
    batch: object = None
    built: object = None
    ahead: Lookahead | None = None
    results_at: dict[int, tuple] = field(default_factory=dict)  # row: _at_boundary's (pad, end, fingerprints, copy)


def decode_rows(decoder: Decoder, prompts: list[list[int]], *, max_new_tokens: int,
                stages: list[list[int] | None] | None = None, matcher: BoundaryMatcher | None = None,
                max_stage_tokens: int = 0, build: CacheBuild | None = None,
                edit: Callable[[int, Layers], None] | None = None, keep: set[int] | frozenset = frozenset(),
                suffixes: list[list[int] | None] | None = None,
                observe: Callable[[int, int, torch.Tensor], None] | None = None,
                placed: tuple[list[int], list[Layers | None]] | None = None,
                ) -> list[RowResult]:
    """Each row's boundary and suffix, decoded together.

    ``stages`` None: the ``live`` construction, greedy from each prompt until ``matcher`` finds the boundary
    (within ``max_stage_tokens``). Otherwise row r's stage ids (its boundary token last; None: a row without a
    prefix, left out or kept as filler) and ``build`` says how its boundary cache is made (None: the live
    schedule's own, i.e. ``incremental``). ``edit(row, layers)`` runs at each row's boundary on the cache the row
    will read; ``keep`` names the rows whose boundary cache is also copied into their result.

    ``suffixes`` (teacher forcing after the boundary): row r is fed ``suffixes[r][j]`` at suffix step j instead of
    its greedy choice while the list lasts, then its greedy choices (None: greedy throughout); its ``suffix_ids``
    are the ids fed and its margins its own logits' at each step. ``observe(row, step, logits)`` sees each row's
    finite fp32 logits (vocab,) at every suffix step before the step's id is chosen or forced; the tensor may be
    reused by the next step (copy what is kept). Either turns the lookahead off.

    ``placed`` (pads, caches): instead of building them, row r continues from ``caches[r]``, a boundary cache of
    its prompt and stage ids but the last (as a result's ``layers``), placed at left pad ``pads[r]``
    (:meth:`~stagereplay.decode.protocol.Decoder.place`): the rows of a packed decode, each keeping the layout it
    was recorded in. Only where the decoder continues rows from their boundaries.
    """
    n = len(prompts)
    _check_request(decoder, prompts, stages, matcher, suffixes, build, placed)
    loop = _Loop(decoder, prompts, [_Row(None if stages is None else stages[r]) for r in range(n)], max_new_tokens,
                 max_stage_tokens, matcher, edit, keep, suffixes, observe)
    cut, plan = (None, None) if stages is None else _plan_stages(loop, stages, build)
    first = 0  # the first iteration the loop runs
    if stages is not None and (placed is not None or decoder.independent_rows(n) or (
            not build.schedule and decoder.rows_from_boundaries(n))):
        logits = _start_from_boundaries(loop, cut, plan, placed)
    else:
        logits, first = _start_live(loop, stages, cut, plan, build)
    # (no logits: every row ended at its boundary, no step to take)
    # the lookahead guesses greedy ids and may overwrite a step's logits before they are observed
    if suffixes is None and observe is None and getattr(decoder, "lookahead", False) and logits is not None:
        loop.ahead = Lookahead([row.forced if row.boundary_at is None else None for row in loop.rows], logits.device)
    _iterate(loop, logits, first)
    return _results(loop)


def _check_request(decoder: Decoder, prompts, stages, matcher, suffixes, build, placed) -> None:
    """:func:`decode_rows`'s arguments agree with each other (one stage, suffix and placed cache per prompt)."""
    n = len(prompts)
    if stages is not None and len(stages) != n:
        raise ValueError(f"{len(stages)} stages for {n} prompts")
    if stages is None and matcher is None:
        raise ValueError("the live construction needs a boundary matcher")
    if suffixes is not None and len(suffixes) != n:
        raise ValueError(f"{len(suffixes)} suffixes for {n} prompts")
    if stages is not None and any(s is not None and not s for s in stages):
        raise ValueError("a row's stage ids are empty (give None for a row without a prefix)")
    if placed is not None:
        _check_placed(decoder, n, stages, prompts, placed)
    if stages is not None and build is None and placed is None:
        raise ValueError("a construction over given stage ids needs its CacheBuild")


def _plan_stages(loop: _Loop, stages: list[list[int] | None], build: CacheBuild | None) -> tuple[list, list | None]:
    """Given stage ids: rows without one are done, the stage budget is the longest stage, and each row's boundary
    cache covers its prompt and stage ids but the last (``cut``), built in ``build``'s forwards (``plan``; None
    where every row's cache is one forward, which the decoder runs as one batch forward)."""
    for row in loop.rows:
        row.done = None if row.forced is not None else "no_prefix"
    loop.max_stage_tokens = max([len(s) for s in stages if s is not None], default=0)
    cut = [None if s is None else list(p) + list(s[:-1]) for p, s in zip(loop.prompts, stages)]
    plan = [None if c is None or build is None else build.segments(len(p), len(c) - len(p))
            for p, c in zip(loop.prompts, cut)]
    if all(x is None or len(x) == 1 for x in plan):
        plan = None
    return cut, plan


def _start_from_boundaries(loop: _Loop, cut: list, plan: list | None, placed) -> torch.Tensor | None:
    """Rows start at their boundaries, from the construction's cache (or the caches placed): each row's boundary is
    taken, and its pending token fed (None: no row goes on past its boundary)."""
    decoder = loop.decoder
    loop.batch = decoder.place(*placed) if placed is not None else decoder.build(loop.prompts, cut, plan)
    for r, row in enumerate(loop.rows):
        if row.forced is not None:
            row.generated = list(row.forced)
            row.margins = [0.0] * len(row.forced)
            row.boundary_at = len(row.forced) - 1
            row.done = None if loop.max_new_tokens else "max_new_tokens"
            loop.results_at[r] = _at_boundary(decoder, loop.batch, r, decoder.pad(loop.batch, r) + len(cut[r]),
                                              loop.edit, loop.keep)
    if all(row.done for row in loop.rows):
        return None
    return decoder.step(loop.batch, [row.forced[-1] if not row.done else None for row in loop.rows])


def _start_live(loop: _Loop, stages, cut, plan, build: CacheBuild | None) -> tuple[torch.Tensor, int]:
    """The live schedule: prompts in one forward; a construction other than its own is built beforehand in the same
    layout. Returns the prompts' logits and the first iteration to run."""
    decoder = loop.decoder
    loop.built = None if stages is None or build.schedule else decoder.build(loop.prompts, cut, plan)
    loop.batch, logits = decoder.open(loop.prompts)
    lengths = [len(row.forced) for row in loop.rows if row.forced is not None]
    if loop.built is not None and lengths and min(lengths) > 1 and decoder.advance(loop.batch, min(lengths) - 1):
        # before the batch's first boundary every row is teacher-forced and reads nothing, and each row's cache
        # over these positions is replaced at its boundary: the steps are skipped, not computed
        first = min(lengths) - 1
        for row in loop.rows:
            if row.forced is not None:
                row.generated, row.margins = list(row.forced[:first]), [0.0] * first
        return logits, first
    return logits, 0


def _iterate(loop: _Loop, logits: torch.Tensor | None, first: int) -> None:
    """The loop's iterations from ``first`` until every row is done: read the step's choice (with the lookahead,
    launch the next step first where nothing the host does can change it), do each row's host work, feed the next
    step (taking back the one launched ahead where a row's boundary changed a cache under it)."""
    rows, decoder = loop.rows, loop.decoder
    steps = loop.max_stage_tokens + loop.max_new_tokens
    # iterations whose boundaries change a row's cache before the next step: known for teacher-forced rows
    changes_cache = loop.built is not None or loop.edit is not None
    forced_boundaries = {len(row.forced) - 1 for row in rows if row.forced is not None and row.boundary_at is None}
    for i in range(first, steps + 1):  # i: the iteration, and every teacher-forced row's ids so far
        if all(row.done for row in rows):
            break
        launched = False
        if loop.ahead is None:
            choice, margin, finite = greedy_choice(logits)
        else:
            loop.ahead.read(logits)
            # launch the next step now unless the host must change a cache first, or every row is certain to
            # finish in this iteration (a step past the last one the plain loop takes could overrun the buffer)
            if i < steps and not (changes_cache and i in forced_boundaries) and not _all_finish(loop):
                next_logits = decoder.step(loop.batch, loop.ahead.guess(i))
                launched = True
            choice, margin, finite = loop.ahead.wait()
        tokens: list[int | None] = [None] * len(rows)
        reached = False
        # the host's row loop reads Python numbers: one conversion per step, not one per row (the same values)
        choice, margin, finite = choice.tolist(), margin.tolist(), finite.tolist()
        for r, row in enumerate(rows):
            if not row.done:
                tokens[r], at_boundary = _advance_row(loop, r, logits, choice, margin, finite)
                reached = reached or at_boundary
        if all(row.done for row in rows):
            break
        if launched and not (reached and changes_cache):
            # the step launched ahead fed what the host would feed (finished rows aside)
            logits = next_logits
            continue
        if launched:  # a cache changed under the step launched ahead: take it back and feed it again
            decoder.rewind(loop.batch)
        logits = decoder.step(loop.batch, tokens)


def _all_finish(loop: _Loop) -> bool:
    """Whether every row is done or certain to finish in this iteration (its suffix budget spent)."""
    return all(row.done or (row.boundary_at is not None
                            and len(row.generated) - row.boundary_at >= loop.max_new_tokens) for row in loop.rows)


def _advance_row(loop: _Loop, r: int, logits, choice, margin, finite) -> tuple[int | None, bool]:
    """Row ``r``'s host work in one iteration: its id (teacher-forced, forced from its suffix, or its greedy
    choice) and margin, and where that leaves the row. Returns the id to feed next (None: the row is done) and
    whether the row reached its boundary."""
    row = loop.rows[r]
    teacher = row.forced is not None and row.boundary_at is None
    if not teacher and not finite[r]:  # teacher forcing reads no logits
        row.done = "nonfinite"
        return None, False
    step = None if row.boundary_at is None else len(row.generated) - 1 - row.boundary_at
    if step is not None and loop.observe is not None:
        loop.observe(r, step, logits[r])
    suffix = None if loop.suffixes is None else loop.suffixes[r]
    forcing = step is not None and suffix is not None and step < len(suffix)
    token = row.forced[len(row.generated)] if teacher else suffix[step] if forcing else choice[r]
    row.generated.append(token)
    TOKENS.total += 1
    row.margins.append(margin[r])
    reached = False
    if row.boundary_at is None:
        ended = None if teacher else stage_end(loop.matcher, row.generated, loop.max_stage_tokens,
                                               token in loop.decoder.eos_ids)
        if (teacher and len(row.generated) == len(row.forced)) or ended == "boundary":
            _reach_boundary(loop, r)
            reached = True
        elif ended == "boundary_missing":
            row.done = "boundary_missing"
    elif token in loop.decoder.eos_ids:
        row.done = "eos"
    elif len(row.generated) - 1 - row.boundary_at >= loop.max_new_tokens:
        row.done = "max_new_tokens"
    return (None if row.done else token), reached


def _reach_boundary(loop: _Loop, r: int) -> None:
    """Row ``r`` has just taken its boundary token: the construction's cache replaces the schedule's own over the
    row's positions (where one was built), then the boundary is taken (:func:`_at_boundary`)."""
    import torch

    decoder, batch, row = loop.decoder, loop.batch, loop.rows[r]
    row.boundary_at = len(row.generated) - 1
    end = decoder.pad(batch, r) + len(loop.prompts[r]) + row.boundary_at  # the pending token's position
    if loop.built is not None:
        with torch.inference_mode():
            for (k, v), (bk, bv) in zip(decoder.row_layers(batch, r, end), decoder.row_layers(loop.built, r, end)):
                k.copy_(bk)
                v.copy_(bv)
    loop.results_at[r] = _at_boundary(decoder, batch, r, end, loop.edit, loop.keep)
    if not loop.max_new_tokens:  # the boundary cache was all that was asked for
        row.done = "max_new_tokens"


def _results(loop: _Loop) -> list[RowResult]:
    """Each row's result: its stage ids, suffix and margins split at its boundary, with the boundary's layout,
    fingerprints and kept cache."""
    out = []
    for r, row in enumerate(loop.rows):
        b = row.boundary_at
        if b is None:
            out.append(RowResult([], row.generated, [], row.done or "boundary_missing"))
            continue
        pad, position, fps, layers = loop.results_at[r]
        out.append(RowResult(row.generated[:b + 1], row.generated[b + 1:], row.margins[b + 1:],
                             row.done or "max_new_tokens", pad, position, fps.result(), layers))
    return out


def _check_placed(decoder: Decoder, n: int, stages, prompts, placed) -> None:
    """Placed boundary caches need stage ids (for the pending tokens), one cache per row of the prompt and stage
    but the last id, and a decoder whose rows continue from their own boundaries."""
    pads, caches = placed
    if stages is None:
        raise ValueError("placed boundary caches continue given stage ids; the live construction generates its own")
    if len(pads) != n or len(caches) != n:
        raise ValueError(f"{len(pads)} pads and {len(caches)} placed caches for {n} rows")
    if not (decoder.independent_rows(n) or decoder.rows_from_boundaries(n)):
        raise RegimeError(f"{decoder.record()['decode_regime']} with {n} rows does not continue rows from their own "
                          "boundaries: given boundary caches cannot be placed")
    for r, (cache, stage) in enumerate(zip(caches, stages)):
        if (cache is None) != (stage is None):
            raise ValueError(f"row {r}: a placed cache and stage ids go together (both or neither)")
        if cache is not None and int(cache[0][0].shape[2]) != len(prompts[r]) + len(stage) - 1:
            raise ValueError(f"row {r}: a placed cache of {int(cache[0][0].shape[2])} positions for a prompt of "
                             f"{len(prompts[r])} and a stage of {len(stage)} ids (the cache holds all but the last)")


def _at_boundary(decoder: Decoder, batch, r: int, end: int, edit, keep) -> tuple:
    """Row ``r`` at its boundary (its pending token to be fed at buffer position ``end``): apply ``edit``, then
    fingerprint (and, for kept rows, copy) the cache exactly as the continuation will read it. On a GPU the
    fingerprints are hashed while the decode goes on (:class:`~stagereplay.io.fingerprints.PendingFingerprints`)."""
    import torch

    layers = decoder.row_layers(batch, r, end)
    if edit is not None:
        with torch.inference_mode():
            edit(r, layers)
        layers = decoder.row_layers(batch, r, end)
    copy = [(k.clone(), v.clone()) for k, v in layers] if r in keep else None
    return decoder.pad(batch, r), end, PendingFingerprints(layers), copy


def matcher_from_config(boundary: dict, tokenizer) -> BoundaryMatcher:
    """The config's ``boundary`` block as a matcher: a token id, else a marker string matched on decoded text."""
    occurrence = int(boundary.get("occurrence", 1))
    if boundary.get("token_id") is not None:
        return BoundaryMatcher(occurrence, token_ids=[int(boundary["token_id"])])
    marker = boundary.get("marker")
    if not marker:
        raise ValueError("boundary: set either marker (a string) or token_id")
    return BoundaryMatcher(occurrence, text=marker, decode=lambda ids: tokenizer.decode(ids))
