"""Packed decodes: every row slot of a decode carries work.

A transplant decode used to run the recipient's whole recorded batch again to change the few rows selected in it,
so most of its row slots repeated work already done. A packed decode fills each slot with a *task*: one row's
boundary cache as recorded (a recipient's), an edit of it, continued from its boundary through the one recipe
(:func:`~stagereplay.experiments.recipe.continue_placed`). Tasks of different rows, specs, directions, arms (the
placebo, the sham) and search rounds share a decode.

Each task keeps the layout its row was recorded in: its left pad and boundary position, its recorded batch's row
count and the decoder's buffer. Only the slot changes, and a row's bits do not depend on its slot given that
layout: proven byte for byte (ids, margins as float32 bytes, cache fingerprints) by tests/test_packing.py on CPU
and by ``bench/transplant_speed.py`` on the GPU, each with a control that moves a row out of its layout and must
be caught. Every run checks it again: its shams (a recipient's own bytes written back) are packed beside the
transplants and must reproduce the recipient's own recorded result byte for byte, or the stage stops.

Where a decoder cannot continue rows from given boundary caches (a static decoder built with
``suffix_schedule=False``), packing is refused and the stages run the unpacked path (:func:`packing_refusal`
says why; provenance records it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from stagereplay.decode.greedy import RowResult
from stagereplay.decode.protocol import Decoder, Layers
from stagereplay.experiments.recipe import DecodeSettings, continue_placed


@dataclass(frozen=True)
class Task:
    """One slot's work: row ``prompt`` + ``stage`` (its pending token last), its boundary ``cache`` (never changed:
    the decode holds a copy) at left pad ``pad`` in a batch of ``rows`` rows, with ``edit(layers)`` applied to
    that copy at the boundary (None: continued as recorded)."""

    key: Hashable
    rows: int
    pad: int
    prompt: list[int]
    stage: list[int]
    cache: Layers
    edit: Callable[[Layers], None] | None = None


@dataclass
class Packed:
    result: RowResult
    decode: int  # which packed decode of the call ran the task (0, 1, ...)
    shared: int  # tasks in that decode (the slots that carried work)


def packing_refusal(decoder: Decoder, rows: int) -> str | None:
    """Why ``decoder`` cannot pack decodes of ``rows`` rows, or None where it can."""
    if decoder.independent_rows(rows) or decoder.rows_from_boundaries(rows):
        return None
    return (f"decode_regime {decoder.record().get('decode_regime')} with {rows} rows does not continue rows from "
            "their own boundaries (a static decoder built with suffix_schedule=False): a row's continuation there "
            "is the lockstep schedule's, which a packed decode cannot give")


def decodes(tasks: list[Task]) -> list[list[Task]]:
    """The packed decodes of ``tasks``: in order, tasks of one recorded row count together, that many a decode."""
    groups: dict[int, list[Task]] = {}
    for task in tasks:
        groups.setdefault(task.rows, []).append(task)
    return [group[i:i + rows] for rows, group in groups.items() for i in range(0, len(group), rows)]


def run_packed(decoder: Decoder, tasks: list[Task], settings: DecodeSettings) -> dict[Hashable, Packed]:
    """Every task continued in packed decodes (:func:`decodes`); task key -> its result, decode and company."""
    keys = [t.key for t in tasks]
    if len(set(keys)) != len(keys):
        raise ValueError("packed tasks need distinct keys")
    refusal = packing_refusal(decoder, max([t.rows for t in tasks], default=1))
    if refusal:
        raise ValueError(refusal)
    out: dict[Hashable, Packed] = {}
    for index, chunk in enumerate(decodes(tasks)):
        rows, idle = chunk[0].rows, chunk[0].rows - len(chunk)
        edits = {slot: task.edit for slot, task in enumerate(chunk) if task.edit is not None}

        def edit(slot: int, layers: Layers) -> None:
            if slot in edits:
                edits[slot](layers)

        results = continue_placed(
            decoder, [t.prompt for t in chunk] + [[0]] * idle, [t.stage for t in chunk] + [None] * idle,
            [t.pad for t in chunk] + [0] * idle, [t.cache for t in chunk] + [None] * idle, settings, edit=edit)
        assert len(results) == rows
        for task, result in zip(chunk, results):
            out[task.key] = Packed(result, index, len(chunk))
    return out
