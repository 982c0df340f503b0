"""The key of one row of each results file, and the refusal of a table in which a key occurs twice
(:class:`DuplicateRowsError`, naming the key): a row counted twice, or one invented beside the real one, would
otherwise be paired with whichever copy came first and counted silently. Every table the report pairs or counts
is checked here first.
"""

from __future__ import annotations

import pandas as pd

from stagereplay.io.keys import ITEM_KEY, LEDGER_KEY

# The key of one row of each results file: the ledger's is the results contract's; the others' follow their stage.
KEYS = {
    "ledger": LEDGER_KEY,
    "audit": LEDGER_KEY,
    "bridge": ITEM_KEY,
    "batch_invariance": (*ITEM_KEY, "construction"),
    "transplant": (*ITEM_KEY, "direction", "layer_set", "component", "positions"),
    "cache_differences": (*ITEM_KEY, "construction_a", "construction_b", "layer", "component"),
    "minimal_transplant": (*ITEM_KEY, "direction"),
    "divergence_onset": (*ITEM_KEY, "layer", "component"),
    "fidelity": (*ITEM_KEY, "reference", "construction", "step"),
}


class DuplicateRowsError(ValueError):
    """A results table in which one key occurs on more than one row."""


def check_unique(frame: pd.DataFrame | None, kind: str, key=None) -> None:
    """Raise :class:`DuplicateRowsError` when two rows of ``frame`` share a key (``key``, else the kind's in
    :data:`KEYS`; a key column the frame lacks is left out of the key), naming the first repeated keys."""
    if frame is None or frame.empty:
        return
    columns = [c for c in (key or KEYS[kind]) if c in frame.columns]
    if not columns:
        return
    repeated = frame[frame.duplicated(columns, keep=False)]
    if repeated.empty:
        return
    counts = repeated.groupby(columns, dropna=False, sort=True).size()
    shown = "; ".join(f"({', '.join(map(str, k if isinstance(k, tuple) else (k,)))}) x{n}"
                      for k, n in counts.head(5).items())
    more = f" and {len(counts) - 5} more" if len(counts) > 5 else ""
    raise DuplicateRowsError(
        f"{kind}: {len(counts)} key(s) occur on more than one row, key ({', '.join(columns)}): {shown}{more}. "
        "Every key must occur once; a row counted twice (a part gathered twice) or an invented row cannot be "
        "paired. Rebuild the file from its stage's parts")
