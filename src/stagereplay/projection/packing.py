"""The transplant stages' packed decodes, priced (``transplant.pack``, :mod:`stagereplay.experiments.packing`).

Packed, a batch's transplants, placebos and shams fill the row slots of decodes that continue each from its
recipient's recorded boundary cache: per batch, ceil(tasks / rows) decodes of the batch's row count, each its
suffix steps from the boundary (no prompt forward, no stage replayed), every task's boundary cache fingerprinted.
The minimal search packs a round's boxes and placebos of both directions together, and its shams apart.
"""

from __future__ import annotations

import math

from stagereplay.projection.counts import Work, decoded
from stagereplay.projection.shape import RunShape


def packed(shape: RunShape) -> bool:
    """Whether the run packs its transplant decodes: as recorded (a run from before packing did not), else the
    config's ``transplant.pack``, refused where batched rows do not continue from their own boundaries."""
    asked = shape.count("transplant_packed", lambda r: r["transplant"].get("packed", False),
                        lambda: shape.config["transplant"].get("pack", True))
    return bool(asked) and (not shape.lockstep or shape.schedule == "suffix")


def decodes(tasks: float, rows: int) -> float:
    """Packed decodes of ``rows`` slots that ``tasks`` transplants fill (a fraction of a task still takes one)."""
    return float(math.ceil(tasks / rows - 1e-9)) if tasks > 0 else 0.0


def placed_cell(shape: RunShape, rows: int, tasks: float) -> Work:
    """One packed decode of ``rows`` rows carrying ``tasks`` transplants: each row's suffix from its boundary."""
    if shape.lockstep:
        return decoded(rows, shape.W + shape.S - 1, shape.N_b, boundary_rows=tasks)
    return decoded(1, shape.P + shape.S - 1, shape.N, boundary_rows=tasks)


def packed_work(shape: RunShape, rows: int, tasks: float) -> Work:
    """``tasks`` transplants of one batch of ``rows`` rows in packed decodes."""
    n = decodes(tasks, rows if shape.lockstep else 1)
    return placed_cell(shape, rows, tasks / n if n else 0.0) * n
