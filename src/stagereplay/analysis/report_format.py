"""How the report writes its numbers: proportions with their Wilson interval, percentages, paired accuracy
differences, item ids and word lists in the Markdown, and the seed every statistic carries in ``stats.json``; and
the rows of its tables, each cell escaped so that no value (a boundary marker ``"\\n\\n"``, a ``|`` in a path) can
end its row or add a cell.

Shared by the report's section modules (:mod:`claims`, :mod:`audit_report`, :mod:`transplant_report`,
:mod:`beyond_study`, :mod:`divergence_location`, :mod:`fidelity`, :mod:`findings`, :mod:`run_identity`),
:mod:`report` and :mod:`compare`, so that one number reads the same everywhere and every table stays a table.
"""

from __future__ import annotations

import unicodedata

import pandas as pd

NOT_RECORDED = "not recorded"


def format_proportion(p: dict) -> str:
    if p["n"] == 0:
        return "0 / 0"
    return (f"{p['k']} / {p['n']} ({100 * p['rate']:.1f}%, Wilson 95% "
            f"[{100 * p['wilson_low']:.1f}, {100 * p['wilson_high']:.1f}])")


def format_percent(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def format_accuracy(acc: dict) -> str:
    return (f"{format_percent(acc['accuracy_a'])}% / {format_percent(acc['accuracy_b'])}%, "
            f"{format_percent(acc['difference'], True)} points, "
            f"exact 95% interval [{format_percent(acc['exact_low'], True)}, "
            f"{format_percent(acc['exact_high'], True)}], "
            f"exact McNemar p = {acc['mcnemar_p']:.3g} ({acc['discordant_a_only']} vs {acc['discordant_b_only']} "
            "discordant)")


def format_int(value) -> str:
    """An integer column value that pandas may have read as a float (nullable ints), or a dash."""
    return "—" if value is None or pd.isna(value) else str(int(value))


def format_ids(values, limit: int = 30) -> str:
    values = [f"`{v}`" for v in values]
    return ", ".join(values[:limit]) + (f" ... ({len(values)} in all)" if len(values) > limit else "")


def count_true(frame: pd.DataFrame, column: str) -> int:
    """True values of a boolean column that may hold nulls (a null is not True)."""
    return int(frame[column].fillna(False).astype(bool).sum()) if len(frame) else 0


def join_words(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def table_cell(value) -> str:
    """``value`` as the text of one Markdown table cell: a ``|`` escaped (``\\|``), and a line break, tab or other
    control character written as its escape, so that a newline reads ``\\n`` (in a code span too) instead of ending
    the row."""
    return "".join("\\|" if ch == "|" else ch.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(ch) in ("Cc", "Zl", "Zp") else ch for ch in str(value))


def table_row(*cells) -> str:
    """One row of a Markdown table, every cell through :func:`table_cell`; an empty cell reads ``| |``."""
    return "|" + "|".join(f" {text} " if text else " " for text in map(table_cell, cells)) + "|"


def table_head(*columns) -> list[str]:
    """A Markdown table's header row and the rule under it."""
    return [table_row(*columns), table_row(*("---" for _ in columns))]
