"""Suffixes cut short by the token budget: of the items a cell (experiment, precision) compares, how many of each
construction's suffixes stopped at ``max_new_tokens`` before EOS, and what the report says of them beside the
accuracies (the claim tables, the Findings row, figure 6's caption).

An answer read from such a suffix is read from a continuation that had not finished: where many are cut, an
accuracy measures the budget as much as the constructions, and the report warns. This module reads pair tables
(:func:`stagereplay.analysis.tables.pair_table`) and stats.json's numbers, never a results file.
"""

from __future__ import annotations

import pandas as pd

from stagereplay.analysis import stats
from stagereplay.analysis.report_format import count_true, join_words

# From this share of a cell's suffixes on (of either construction), its accuracy is flagged as one of truncated
# answers.
LARGE_SHARE = 0.25


def budget_stops(cmp: pd.DataFrame) -> dict[str, dict] | None:
    """Per construction of one cell's pair table: its suffixes that stopped at max_new_tokens, a proportion of the
    compared items; None where nothing was compared or the ledger records no stop reason."""
    if cmp.empty or cmp["truncated_a"].isna().any():
        return None
    a, b = cmp["construction_a"].iloc[0], cmp["construction_b"].iloc[0]
    return {a: stats.proportion(count_true(cmp, "truncated_a"), len(cmp)),
            b: stats.proportion(count_true(cmp, "truncated_b"), len(cmp))}


def is_large(stops: dict | None) -> bool:
    return bool(stops) and any(p["n"] and p["k"] >= LARGE_SHARE * p["n"] for p in stops.values())


def _counts(stops: dict) -> str:
    return join_words([f"{p['k']} / {p['n']} {construction}" for construction, p in stops.items()])


def budget_stop_lines(cells: dict[str, dict | None], max_new_tokens: int | None = None) -> list[str]:
    """The paragraphs beside the accuracies of ``cells`` (a cell's name -> :func:`budget_stops`): how many suffixes
    stopped at the budget and, where that is a large share, a warning naming the cells; nothing where no cell
    records a stop reason."""
    cells = {name: stops for name, stops in cells.items() if stops}
    if not cells:
        return []
    budget = "`max_new_tokens`" + (f" ({max_new_tokens})" if max_new_tokens else "")
    if not any(p["k"] for stops in cells.values() for p in stops.values()):
        return [f"No compared suffix stopped at {budget}: every answer was read from a suffix that ended at EOS."]
    counts = "; ".join(f"{name}: {_counts(stops)}" for name, stops in cells.items())
    lines = [f"Compared suffixes that stopped at {budget} before EOS: {counts}."]
    large = [name for name, stops in cells.items() if is_large(stops)]
    if large:
        lines.append(f"**Accuracy on truncated answers** at {join_words(large)}: at least {LARGE_SHARE:.0%} of a "
                     "construction's suffixes there stopped at the token budget, so their answers were read from "
                     "continuations that had not finished; the accuracies and their difference measure the budget as "
                     "much as the constructions. Raise `max_new_tokens` to compare finished answers.")
    return lines


def budget_stop_caveat(stops: dict | None) -> str:
    """What the Findings row of an accuracy adds where a large share of its suffixes were cut ('' otherwise)."""
    if not is_large(stops):
        return ""
    return f"; {_counts(stops)} suffixes cut at max_new_tokens: **accuracy on truncated answers**"
