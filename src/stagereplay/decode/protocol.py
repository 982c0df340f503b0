"""The decoder protocol: what every decode regime offers the greedy loop, and nothing more.

A decoder steps a loaded model over a *batch of rows*; batch 1 is a batch of one row. Rows live in a batch object
that only the decoder understands (a list of ``DynamicCache`` for the eager regime, one left-padded K/V buffer for
the static ones). The greedy loop (:mod:`stagereplay.decode.greedy`) and everything above it see only these
methods, so no experiment knows which regime, or how many rows, it runs on. Numerics (default, invariant) are a
property of the loaded model that the decoder drives; the regime a decoder runs is its :meth:`Decoder.record`.

Modelled on transformers' ``CacheLayerMixin`` and lm-eval's ``LM``: a small declared interface, checked by
``isinstance`` against :class:`Decoder` in the tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch for the annotations only: the experiments' tables import this module in jobs without torch
    import torch

# one row's boundary cache: (K, V) per layer, each (1, kv_heads, positions, head_dim)
Layers = list[tuple["torch.Tensor", "torch.Tensor"]]


class RegimeError(ValueError):
    """A decode regime that is unknown or cannot run here."""


@runtime_checkable
class Decoder(Protocol):
    eos_ids: tuple[int, ...]
    n_layers: int
    numerics: str  # default | invariant: the regime of the model the decoder drives
    lookahead: bool  # whether the greedy loop may launch a step from device-side ids and take it back (rewind)

    def record(self) -> dict:
        """The regime as results record it (``decode_regime``, buffer length, rows, attention, ...)."""

    def independent_rows(self, rows: int) -> bool:
        """Whether rows of a batch of ``rows`` can sit at different positions (a row's continuation may then start
        at its own boundary); otherwise rows step in lockstep and a row's cache is swapped in at its boundary."""

    def rows_from_boundaries(self, rows: int) -> bool:
        """Whether the rows of a batch from ``build`` may continue each from its own boundary, stepping together
        each at its own position, with the bits the lockstep live schedule gives them (a built construction then
        decodes its suffixes only). The live schedule's own construction (``incremental``) is made by the schedule
        wherever ``independent_rows`` is false."""

    def open(self, prompts: list[list[int]]) -> tuple[Any, torch.Tensor]:
        """A new batch with each row's prompt fed in one forward; the last position's fp32 logits (rows, vocab)."""

    def step(self, batch: Any, tokens: list[int | None]) -> torch.Tensor:
        """Feed one token per row (None: an idle row, whose result no longer matters); fp32 logits (rows, vocab).
        With ``lookahead``, ``tokens`` may also be a (rows,) id tensor on the model's device."""

    def advance(self, batch: Any, steps: int) -> bool:
        """Move ``batch`` on by ``steps`` one-token steps whose results nothing reads (every row's cache over their
        positions is replaced before it is read), without computing them where the decoder can: True if it did,
        False if the caller must feed them."""

    def rewind(self, batch: Any) -> None:
        """Take back the last ``step`` (with ``lookahead`` only): the next step feeds the same positions again."""

    def build(self, prompts: list[list[int]], cached: list[list[int] | None],
              segments: list[list[int]] | None) -> Any:
        """Boundary caches of a batch in the layout ``open(prompts)`` gives: row r's ``cached[r]`` ids (its prompt
        and stage but the last token; None: a row without a prefix) fed in forwards of ``segments[r]`` tokens
        (None: every row's ids in one forward). The next ``step`` feeds each row at its own boundary."""

    def place(self, pads: list[int], caches: list[Layers | None]) -> Any:
        """A batch of ``len(pads)`` rows in which row r holds a copy of ``caches[r]`` (a boundary cache, as
        ``row_layers`` gives it) at buffer positions from ``pads[r]`` on, each row's next step at its own boundary:
        the layout a built batch gives the row, without computing it (None: an idle row). Only where
        ``rows_from_boundaries`` holds for that many rows; the next ``step`` feeds each row its pending token."""

    def row_layers(self, batch: Any, row: int, end: int) -> Layers:
        """Row ``row``'s cache over its positions up to buffer position ``end`` (exclusive), as views: writing
        into them changes what the row's continuation reads."""

    def pad(self, batch: Any, row: int) -> int:
        """Buffer positions before row ``row``'s first token (its left padding in the batch layout)."""
