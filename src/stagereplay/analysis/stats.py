"""Statistics for the report: interval bounds on rates, paired accuracy comparisons, transplant follow rates,
the margin test at first divergences, rank correlations across items (the separation of two classes by a score,
the AUC: :mod:`.separation`).

Every function takes plain Python values (counts, per-item booleans, outcome strings, positions) and returns a
JSON-serialisable dict of Python ints, floats and None that can go straight into ``stats.json``. Each dict names its
``method`` and sample size ``n``, and its ``alpha`` and ``seed`` where they apply, so a number in the report can be
traced to how it was computed.

This module knows nothing of torch, the ledger or Snakemake: callers read the Parquet files and hand in the columns.
scipy and statsmodels are imported by the functions that compute with them: the item browser imports the tables
(and so this module) and computes no statistic, and their imports are most of its start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral

import numpy as np

FOLLOW_OUTCOMES = ("donor", "recipient", "neither")
# Bounds the (chunk, n) index matrix of the bootstrap to about 32 MB however many items there are.
BOOTSTRAP_INDICES_PER_CHUNK = 4_000_000


def check_alpha(alpha: float) -> float:
    """``alpha`` as a float, refused outside (0, 1)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    return float(alpha)


def check_count(name: str, value) -> int:
    """``value`` as an int, refused where it is not an integer (a bool included)."""
    # bool is an Integral too, but a True passed as a count is a caller's bug, not a count of 1.
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def proportion(k: int, n: int, alpha: float = 0.05) -> dict:
    """Rate k/n with two-sided 1-alpha Wilson and Clopper-Pearson (exact) intervals; None throughout when n == 0."""
    k, n, alpha = check_count("k", k), check_count("n", n), check_alpha(alpha)
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    result = {"k": k, "n": n, "rate": None, "wilson_low": None, "wilson_high": None,
              "clopper_pearson_low": None, "clopper_pearson_high": None, "alpha": alpha,
              "method": "wilson score and clopper-pearson intervals (statsmodels proportion_confint)"}
    if n == 0:
        return result
    from statsmodels.stats.proportion import proportion_confint

    wilson = proportion_confint(k, n, alpha=alpha, method="wilson")
    exact = proportion_confint(k, n, alpha=alpha, method="beta")
    # Clipped because the Wilson formula can land a rounding error outside [0, 1] at k == 0 or k == n.
    low_high = [min(1.0, max(0.0, float(b))) for b in (*wilson, *exact)]
    result.update(rate=k / n, wilson_low=low_high[0], wilson_high=low_high[1],
                  clopper_pearson_low=low_high[2], clopper_pearson_high=low_high[3])
    return result


def _as_correctness(name: str, values) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of booleans, got shape {array.shape}")
    # Refuses 2 or 0.5 rather than letting a bool cast read them as correct.
    if array.size and not np.isin(array, (0, 1)).all():
        raise ValueError(f"{name} must hold only booleans (or 0/1)")
    return array.astype(bool)


def paired_accuracy_difference(correct_a: Sequence[bool], correct_b: Sequence[bool], n_boot: int = 10000,
                               seed: int = 0, alpha: float = 0.05) -> dict:
    """Accuracy of construction a minus that of b over the same items, with a paired bootstrap CI and exact McNemar.

    The difference is a proportion (0.01 is one point). ``exact_low``/``exact_high`` are the exact interval of
    :func:`paired_difference_interval`, the one the report states; ``bootstrap_low``/``bootstrap_high`` the
    percentile interval of a bootstrap that resamples items (each keeps its a/b pair; reproducible from ``seed``),
    kept for figure 6 and comparison: it covers below its level at small n and is [0, 0] with no discordant pair.
    """
    a, b = _as_correctness("correct_a", correct_a), _as_correctness("correct_b", correct_b)
    if a.size != b.size:
        raise ValueError(f"correct_a and correct_b must be paired by item, got lengths {a.size} and {b.size}")
    if a.size == 0:
        raise ValueError("need at least one item")
    n_boot, seed, alpha = check_count("n_boot", n_boot), check_count("seed", seed), check_alpha(alpha)
    if n_boot < 1:
        raise ValueError(f"n_boot must be positive, got {n_boot}")
    n = int(a.size)

    per_item = a.astype(np.int8) - b.astype(np.int8)  # (n,) in {-1, 0, 1}
    rng = np.random.default_rng(seed)
    chunk = max(1, BOOTSTRAP_INDICES_PER_CHUNK // n)
    boot = np.empty(n_boot)
    for start in range(0, n_boot, chunk):
        size = min(chunk, n_boot - start)
        indices = rng.integers(0, n, size=(size, n))  # (replicates, items)
        boot[start:start + size] = per_item[indices].mean(axis=1)
    low, high = np.quantile(boot, [alpha / 2, 1 - alpha / 2])

    a_only, b_only = int(np.sum(a & ~b)), int(np.sum(~a & b))
    # From the discordant counts, so 11 vs 9 of 200 reads 0.01 in stats.json rather than 0.010000000000000009.
    difference = (a_only - b_only) / n
    both_right, both_wrong = int(np.sum(a & b)), int(np.sum(~a & ~b))
    from statsmodels.stats.contingency_tables import mcnemar

    # With no discordant pairs the exact test has nothing to test; 1.0 is its limit and keeps stats.json free of NaN.
    p = 1.0 if a_only + b_only == 0 else float(
        mcnemar([[both_right, a_only], [b_only, both_wrong]], exact=True).pvalue)
    exact = paired_difference_interval(a_only, b_only, n, alpha)
    return {"n": n, "accuracy_a": float(a.mean()), "accuracy_b": float(b.mean()),
            "difference": difference, "bootstrap_low": float(low), "bootstrap_high": float(high),
            "exact_low": exact["low"], "exact_high": exact["high"],
            "discordant_a_only": a_only, "discordant_b_only": b_only, "mcnemar_p": min(1.0, p),
            "n_boot": n_boot, "seed": seed, "alpha": alpha,
            "method": "paired percentile bootstrap over items (it covers below its level at small n and reads [0, 0] "
                      "with no discordant pair); exact conservative interval from the discordant pairs "
                      "(paired_difference_interval); exact (binomial) McNemar test"}


def follow_rate(outcomes: Sequence[str], alpha: float = 0.05) -> dict:
    """Counts of transplant outcomes and the rate at which continuations follow their cache donor."""
    unknown = sorted({o for o in outcomes if o not in FOLLOW_OUTCOMES}, key=repr)
    if unknown:
        raise ValueError(f"transplant outcomes must be among {FOLLOW_OUTCOMES}, got {unknown!r}")
    counts = {o: sum(1 for x in outcomes if x == o) for o in FOLLOW_OUTCOMES}
    n = sum(counts.values())
    return {"n": n, **counts, "follows_donor": proportion(counts["donor"], n, alpha), "alpha": check_alpha(alpha),
            "method": "outcome counts; donor-following rate with wilson and clopper-pearson intervals"}


def first_divergence_summary(positions: Sequence[int | None]) -> dict:
    """Median, quartiles and range of first-divergence positions; None (and NaN, as pandas reads nulls) are skipped.

    Quartiles use numpy's default linear interpolation, so they can fall between two integer positions.
    """
    kept = [p for p in positions if p is not None and not (isinstance(p, float) and math.isnan(p))]
    result = {"n": len(kept), "n_none": len(positions) - len(kept), "median": None, "q1": None, "q3": None,
              "min": None, "max": None, "method": "order statistics of non-null positions (numpy linear quantiles)"}
    if kept:
        values = np.asarray(kept, dtype=float)
        q1, median, q3 = np.quantile(values, [0.25, 0.5, 0.75])
        result.update(median=float(median), q1=float(q1), q3=float(q3),
                      min=int(values.min()), max=int(values.max()))
    return result


def divergence_margin_test(items: Sequence[tuple[float, Sequence[float]]], alpha: float = 0.05) -> dict:
    """Are first divergences near-ties? One pair of values per item, tested across items.

    ``items`` holds, per disagreeing item, the baseline construction's top-2 margin at the first divergence and
    its margins at every *other* decode step of the same suffix (the divergence step left out). Each item gives one
    paired value: its divergence margin against the median of its other steps. Items are independent; the steps of
    one item are not, so they are never pooled.

    The test is the exact sign test (scipy.stats.binomtest) of H0 "the divergence margin lies below the item's
    median other-step margin as often as above it", one-sided towards "below". It holds when the divergence step
    is, under H0, exchangeable with the item's other steps; it assumes nothing of the margins' distribution. Items
    whose two values tie, and items with no other step, are counted and left out. The Wilcoxon signed-rank test
    (scipy.stats.wilcoxon) of the same pairs is given beside it (it further assumes differences symmetric about
    0 under H0). ``within_item_percentile`` is, per item, the share of its other steps with a margin at most the
    divergence margin; its median is reported.
    """
    alpha = check_alpha(alpha)
    divergence, medians, percentiles = [], [], []
    no_other = 0
    for margin, others in items:
        if margin is None or (isinstance(margin, float) and math.isnan(margin)):
            continue
        rest = np.asarray([m for m in others if m is not None and not math.isnan(m)], dtype=float)
        if not rest.size:
            no_other += 1
            continue
        divergence.append(float(margin))
        medians.append(float(np.median(rest)))
        percentiles.append(float(np.mean(rest <= margin)))
    d, m = np.asarray(divergence), np.asarray(medians)
    below, above = int(np.sum(d < m)), int(np.sum(d > m))
    result = {"n": int(d.size), "n_no_other_step": no_other, "n_ties": int(d.size) - below - above,
              "below_item_median": below, "above_item_median": above,
              "median_divergence": None, "median_of_item_medians": None, "median_within_item_percentile": None,
              "sign_test_p_less": None, "wilcoxon_p_less": None, "alpha": alpha,
              "method": "per item: margin at the first divergence vs the median margin of the same suffix's other "
                        "decode steps (divergence step left out); exact one-sided sign test across items "
                        "(scipy.stats.binomtest, ties dropped); Wilcoxon signed-rank (scipy.stats.wilcoxon, "
                        "alternative='less') beside it"}
    if d.size:
        result.update(median_divergence=float(np.median(d)), median_of_item_medians=float(np.median(m)),
                      median_within_item_percentile=float(np.median(percentiles)))
    from scipy.stats import binomtest, wilcoxon

    if below + above:
        result["sign_test_p_less"] = float(binomtest(below, below + above, 0.5, alternative="greater").pvalue)
    if np.any(d != m):
        result["wilcoxon_p_less"] = float(wilcoxon(d, m, alternative="less", zero_method="wilcox").pvalue)
    return result


def _spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's rho of each row pair of (replicates, n) arrays; NaN where a row is constant."""
    from scipy.stats import rankdata

    rx = rankdata(x, axis=1)
    ry = rankdata(y, axis=1)
    rx -= rx.mean(axis=1, keepdims=True)
    ry -= ry.mean(axis=1, keepdims=True)
    denominator = np.sqrt((rx ** 2).sum(axis=1) * (ry ** 2).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, (rx * ry).sum(axis=1) / denominator, np.nan)


def rank_correlation(x: Sequence[float], y: Sequence[float], n_boot: int = 10000, seed: int = 0,
                     alpha: float = 0.05) -> dict:
    """Spearman's rank correlation of paired values (one pair per item), its two-sided p-value
    (scipy.stats.spearmanr) and a seeded percentile bootstrap interval that resamples items (each keeps its pair).

    Pairs with a missing value are dropped and counted. Resamples in which a side is constant have no rank
    correlation; they are left out of the interval and counted (``n_boot_undefined``). Below 3 pairs, or with a
    constant side, everything is None.
    """
    n_boot, seed, alpha = check_count("n_boot", n_boot), check_count("seed", seed), check_alpha(alpha)
    if len(x) != len(y):
        raise ValueError(f"x and y must be paired by item, got lengths {len(x)} and {len(y)}")
    pairs = [(float(a), float(b)) for a, b in zip(x, y)
             if a is not None and b is not None and not (math.isnan(float(a)) or math.isnan(float(b)))]
    result = {"n": len(pairs), "n_missing": len(x) - len(pairs), "rho": None, "p_value": None,
              "bootstrap_low": None, "bootstrap_high": None, "n_boot": n_boot, "n_boot_undefined": None,
              "seed": seed, "alpha": alpha,
              "method": "spearman rank correlation (scipy.stats.spearmanr, two-sided p); percentile bootstrap over "
                        "items, resamples with a constant side left out"}
    a, b = (np.asarray(v) for v in zip(*pairs)) if pairs else (np.empty(0), np.empty(0))
    if len(pairs) < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return result
    from scipy.stats import spearmanr

    test = spearmanr(a, b)
    rng = np.random.default_rng(seed)
    n = len(pairs)
    chunk = max(1, BOOTSTRAP_INDICES_PER_CHUNK // n)
    boot = np.empty(n_boot)
    for start in range(0, n_boot, chunk):
        indices = rng.integers(0, n, size=(min(chunk, n_boot - start), n))  # (replicates, items)
        boot[start:start + len(indices)] = _spearman_rows(a[indices], b[indices])
    defined = boot[np.isfinite(boot)]
    low, high = np.quantile(defined, [alpha / 2, 1 - alpha / 2]) if defined.size else (None, None)
    result.update(rho=float(test.statistic), p_value=float(test.pvalue),
                  bootstrap_low=None if low is None else float(low),
                  bootstrap_high=None if high is None else float(high),
                  n_boot_undefined=int(n_boot - defined.size))
    return result


def share_by_position(first_divergences: Sequence[int | None], n: int, positions: int, alpha: float = 0.05) -> dict:
    """The share of ``n`` items split within the first k suffix tokens, for k = 1 .. ``positions``: an item whose
    first divergence (0-based suffix step; None: never) is below k counts, with a Wilson interval per k
    (pointwise, not a band over all k). Every item counts in every k's denominator: an item whose
    suffix ended unsplit cannot split later."""
    n, positions = check_count("n", n), check_count("positions", positions)
    steps = [int(p) for p in first_divergences if p is not None and not (isinstance(p, float) and math.isnan(p))]
    if len(steps) > n or any(p < 0 for p in steps):
        raise ValueError(f"{len(steps)} first divergences for {n} items (each at a step >= 0)")
    curve = [proportion(sum(p < k for p in steps), n, alpha) for k in range(1, positions + 1)]
    return {"n": n, "positions": list(range(1, positions + 1)), "split": [c["k"] for c in curve],
            "rate": [c["rate"] for c in curve], "wilson_low": [c["wilson_low"] for c in curve],
            "wilson_high": [c["wilson_high"] for c in curve], "alpha": alpha,
            "method": "per suffix position k: items whose first divergence is within the first k tokens, of all "
                      "compared items; pointwise wilson score intervals (statsmodels proportion_confint)"}


def paired_difference_interval(a_only: int, b_only: int, n: int, alpha: float = 0.05) -> dict:
    """An exact (conservative) interval for the difference of two paired proportions, a − b, from the discordant
    counts alone: ``a_only`` items right under a only, ``b_only`` under b only, of ``n`` items.

    The difference is d (2q − 1), with d the discordance rate and q the share of discordant items right under a. d
    gets a Clopper-Pearson interval from (a_only + b_only) of n, q one from a_only of the discordant items (its
    conditional distribution given their number is binomial), each at 1 − alpha/2; the difference's bounds are the
    extremes of d (2q − 1) over both intervals, so by Bonferroni the interval covers with probability at least
    1 − alpha at any n and any number of discordant pairs. With none discordant it is not [0, 0]: it is bounded by
    how often a discordance could have gone unseen (the exact upper bound of d). The bootstrap's percentile interval
    is [0, 0] there and covers far below its nominal level at small n (tests/test_stats.py simulates both).
    """
    a_only, b_only, n, alpha = (check_count("a_only", a_only), check_count("b_only", b_only),
                                check_count("n", n), check_alpha(alpha))
    m = a_only + b_only
    if n < 1 or m > n or min(a_only, b_only) < 0:
        raise ValueError(f"need 0 <= a_only + b_only <= n and n >= 1, got a_only={a_only}, b_only={b_only}, n={n}")
    from statsmodels.stats.proportion import proportion_confint

    d_low, d_high = (float(x) for x in proportion_confint(m, n, alpha=alpha / 2, method="beta"))
    q_low, q_high = ((float(x) for x in proportion_confint(a_only, m, alpha=alpha / 2, method="beta"))
                     if m else (0.0, 1.0))
    ends = [d * (2 * q - 1) for d in (d_low, d_high) for q in (q_low, q_high)]
    return {"n": n, "discordant_a_only": a_only, "discordant_b_only": b_only, "difference": (a_only - b_only) / n,
            "low": max(-1.0, min(ends)), "high": min(1.0, max(ends)), "alpha": alpha,
            "method": "exact conservative interval from the discordant pairs: clopper-pearson for the discordance "
                      "rate and for the share of discordant items right under a (each at 1 - alpha/2, Bonferroni), "
                      "difference = discordance (2 share - 1)"}


def accuracy_equivalence(a_only: int, b_only: int, n: int, margin: float, alpha: float = 0.05) -> dict:
    """Two one-sided tests (TOST) at level ``alpha`` of "|accuracy a − accuracy b| < ``margin``" for paired items:
    equivalence is shown where the 1 − 2 alpha interval of :func:`paired_difference_interval` lies inside
    (−margin, margin). A difference is shown where the 1 − alpha interval excludes 0. Neither: no difference shown,
    equivalence not shown either (the data cannot tell). ``verdict`` is "difference", "equivalent" or "undecided".
    """
    margin = float(margin)
    if not 0.0 < margin < 1.0:
        raise ValueError(f"the equivalence margin is a difference of proportions in (0, 1), got {margin!r}")
    two_sided = paired_difference_interval(a_only, b_only, n, alpha)
    tost = paired_difference_interval(a_only, b_only, n, 2 * check_alpha(alpha))
    if two_sided["low"] > 0 or two_sided["high"] < 0:
        verdict = "difference"
    elif -margin < tost["low"] and tost["high"] < margin:
        verdict = "equivalent"
    else:
        verdict = "undecided"
    return {"verdict": verdict, "margin": margin, "interval": two_sided, "tost_interval": tost, "alpha": alpha,
            "method": "difference: the exact 1 - alpha interval excludes 0; equivalence: TOST, the exact 1 - 2 alpha "
                      "interval inside (-margin, margin)"}
