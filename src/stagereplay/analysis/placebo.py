"""The transplants' controls in numbers: for a set of transplants of divergent items, how often the donor's bytes
carry the donor's continuation, how often their placebo does (the same spec, the difference moved within its span),
and whether the two differ, by McNemar's exact test on the items where exactly one of them carried.

Units and assumptions: one pair of outcomes per divergent item (one direction, one spec), the items drawn
independently of any outcome (the outcome-blind selection), so the discordant pairs are independent trials and,
under the null that the donor's bytes carry no better than their placebo, each is the donor's with probability 1/2:
the exact binomial (McNemar) test holds. A no-op transplant (its bytes identical in donor and recipient) is evidence
of nothing: it is counted apart and left out of both rates.
"""

from __future__ import annotations

import pandas as pd
from statsmodels.stats.contingency_tables import mcnemar

from stagereplay.analysis import stats

METHOD = ("paired per item: donor's bytes vs their placebo (the donor-minus-recipient difference shifted within the "
          "span); McNemar's exact test on the discordant pairs; no-ops left out")


def has_controls(frame: pd.DataFrame) -> bool:
    """Whether a transplant table holds the placebo arm (files written before the controls do not)."""
    return {"placebo_outcome", "noop"} <= set(frame.columns)


def paired_counts(donor_follows, placebo_follows) -> dict:
    """The 2x2 of (donor carried, placebo carried) over items, with the exact McNemar p-value (1.0 when no pair is
    discordant: nothing tells the two apart)."""
    donor = [bool(x) for x in donor_follows]
    placebo = [bool(x) for x in placebo_follows]
    if len(donor) != len(placebo):
        raise ValueError(f"paired outcomes need as many placebo runs as donor runs, got {len(placebo)} and {len(donor)}")
    both = sum(d and p for d, p in zip(donor, placebo))
    only_donor = sum(d and not p for d, p in zip(donor, placebo))
    only_placebo = sum(p and not d for d, p in zip(donor, placebo))
    neither = len(donor) - both - only_donor - only_placebo
    p_value = 1.0
    if only_donor + only_placebo:
        p_value = float(mcnemar([[both, only_donor], [only_placebo, neither]], exact=True).pvalue)
    return {"n": len(donor), "donor": both + only_donor, "placebo": both + only_placebo, "both": both,
            "only_donor": only_donor, "only_placebo": only_placebo, "neither": neither, "p_value": p_value,
            "donor_rate": stats.proportion(both + only_donor, len(donor)),
            "placebo_rate": stats.proportion(both + only_placebo, len(donor)), "method": METHOD}


def controlled_rates(group: pd.DataFrame) -> dict:
    """The controls of one group of transplant rows (divergent items, one direction and spec): no-ops counted
    apart, then :func:`paired_counts` over the rest."""
    noop = group["noop"].fillna(False).astype(bool)
    kept = group[~noop]
    out = paired_counts(kept["outcome"] == "donor", kept["placebo_outcome"] == "donor")
    out["noop"] = int(noop.sum())
    return out


def reading(cell: dict, alpha: float = 0.05) -> str:
    """What one row shows, in words: carried beyond its placebo, not separable from it, or a no-op."""
    if cell["n"] == 0:
        return "no-op: the transplanted bytes are identical in donor and recipient on every item"
    if cell["p_value"] < alpha and cell["only_donor"] > cell["only_placebo"]:
        return "carries beyond its placebo"
    if cell["donor"] == 0 and cell["placebo"] == 0:
        return "carries on no item"
    return "not separable from its placebo"
