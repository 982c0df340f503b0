"""Where A splits, does B split: two yes/no outcomes per item on the same items, as a 2x2 table with its base rates.

A conditional share alone ("B splits on 8 of the 9 items where A does") says nothing when B splits on most items
anyway. :func:`cross_table` gives both marginals, the number of items on which both would split were the two
independent given those marginals (``a_splits * b_splits / n``), and the odds ratio with Fisher's exact test
(``scipy.stats.fisher_exact``, two-sided), which conditions on both marginals and so holds at any count. Its
assumption: the items are independent of one another, each counted once.

The odds ratio is undefined where a marginal is 0 or n (one side never or always splits: a row or column of the
table is empty, and the table holds no evidence either way); it is then None, and ``undefined`` says why. With
non-degenerate marginals and one empty cell it is 0 or infinite, and the test still holds.

Knows nothing of engines, ledgers or constructions: it takes per-item outcomes.
"""

from __future__ import annotations

import math


def cross_table(a: dict[int, bool], b: dict[int, bool]) -> dict:
    """The 2x2 of ``a`` and ``b`` (item: splits) on the items both hold, with marginals, the count of ``both``
    expected under independence, the odds ratio ``(both * neither) / (a_only * b_only)`` and Fisher's exact
    two-sided p (None, with ``undefined`` naming why, where a marginal is 0 or n)."""
    common = sorted(set(a) & set(b))
    n = len(common)
    both = sum(bool(a[i]) and bool(b[i]) for i in common)
    a_only = sum(bool(a[i]) and not b[i] for i in common)
    b_only = sum(bool(b[i]) and not a[i] for i in common)
    neither = n - both - a_only - b_only
    a_splits, b_splits = both + a_only, both + b_only
    out = {"n": n, "a_splits": a_splits, "b_splits": b_splits, "both": both, "a_only": a_only, "b_only": b_only,
           "neither": neither, "expected_both": a_splits * b_splits / n if n else None, "odds_ratio": None,
           "fisher_p": None, "undefined": None,
           "method": "Fisher's exact test, two-sided, conditional on both marginals (scipy.stats.fisher_exact)"}
    if not n:
        out["undefined"] = "no item on both sides"
        return out
    degenerate = [f"{name} {'never' if k == 0 else 'always'} splits" for name, k in (("A", a_splits), ("B", b_splits))
                  if k in (0, n)]
    if degenerate:
        out["undefined"] = " and ".join(degenerate) + ": a marginal is 0 or n, the table holds no evidence either way"
        return out
    from scipy.stats import fisher_exact

    result = fisher_exact([[both, a_only], [b_only, neither]], alternative="two-sided")
    out["odds_ratio"], out["fisher_p"] = float(result.statistic), float(result.pvalue)
    return out


def odds_ratio_text(cell: dict) -> str:
    """The odds ratio as a table shows it: a number, ``inf``/``0`` (an empty cell), or why it is undefined."""
    value = cell["odds_ratio"]
    if value is None:
        return f"undefined: {cell['undefined']}"
    if math.isinf(value):
        return "inf (an off-diagonal cell is empty)"
    return f"{value:.3g}"
