"""The controls the tests and the bench scripts apply to a table before comparing it byte for byte: one value moved
by the least step there is, so that a comparison that cannot fail is seen to fail."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def one_ulp_up(value: float) -> float:
    """``value`` as float32, moved up by one unit in the last place."""
    return float(np.nextafter(np.float32(value), np.float32(np.inf)))


def margins_nudged(margins: list[float]) -> list[float]:
    """A row's margins with its first moved up by one ulp of float32."""
    return [one_ulp_up(margins[0]), *margins[1:]]


def first_margin_nudged(table: pa.Table) -> pa.Table:
    """An Arrow table of ledger rows with the first margin of its first row that has one moved up by one ulp."""
    margins = table["margins"].combine_chunks()
    values = margins.flatten().to_numpy().copy()
    values[0] = one_ulp_up(values[0])
    return table.set_column(table.column_names.index("margins"), "margins",
                            pa.ListArray.from_arrays(margins.offsets, pa.array(values, pa.float32())))


def first_verdict_flipped(table: pa.Table) -> pa.Table:
    """An Arrow table of audit records with the first record's ``reproduced`` flipped."""
    values = table["reproduced"].to_numpy(zero_copy_only=False).copy()
    values[0] = not values[0]
    return table.set_column(table.column_names.index("reproduced"), "reproduced", pa.array(values))
