"""How well a score separates two classes of items, for the report: the AUC, P(positive > negative) + P(tie) / 2,
with a percentile bootstrap interval (:func:`rank_separation`) or DeLong's variance and a Wald interval
(:func:`auc_delong`; :func:`matched_auc_delong` where a pair's scores depend on the pair).

Like :mod:`.stats`, every function takes plain values and returns a JSON-serialisable dict naming its ``method``,
its sample sizes and its ``alpha`` (and ``seed`` where it resamples); scipy is imported by the functions that
compute with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from stagereplay.analysis.stats import BOOTSTRAP_INDICES_PER_CHUNK, check_alpha, check_count


def rank_separation(positive: Sequence[float], negative: Sequence[float], n_boot: int = 10000, seed: int = 0,
                    alpha: float = 0.05, names: tuple[str, str] = ("positive", "negative")) -> dict:
    """How well a score separates two classes of items: the AUC, P(score of a positive item > score of a
    negative one) + P(tie) / 2, from the Mann-Whitney U statistic (scipy.stats.mannwhitneyu: U of the positives
    over n_positive x n_negative), its two-sided p-value, and a seeded percentile bootstrap interval that resamples
    each class apart (stratified: the class sizes are kept).

    Missing values are dropped and counted. With a class empty there is no AUC: everything is None and
    ``skipped`` says why (naming the class by ``names``). Where the sample separates completely (AUC 0 or 1) every resample does too, so the
    percentile interval is the point itself and carries no uncertainty: ``complete_separation`` says so.
    """
    n_boot, seed, alpha = check_count("n_boot", n_boot), check_count("seed", seed), check_alpha(alpha)

    def kept(values):
        return np.asarray([float(v) for v in values if v is not None and not math.isnan(float(v))], dtype=float)

    pos, neg = kept(positive), kept(negative)
    result = {"n_positive": int(pos.size), "n_negative": int(neg.size),
              "n_missing": len(positive) + len(negative) - int(pos.size) - int(neg.size),
              "auc": None, "u": None, "p_value": None, "bootstrap_low": None, "bootstrap_high": None,
              "complete_separation": None, "skipped": None, "n_boot": n_boot, "seed": seed, "alpha": alpha,
              "method": "AUC = U / (n_positive n_negative), Mann-Whitney U of the positives (scipy.stats.mannwhitneyu, "
                        "two-sided p, ties counted half); percentile bootstrap resampling each class apart"}
    if not pos.size or not neg.size:
        empty = names[0] if not pos.size else names[1]
        result["skipped"] = f"no {empty} item: an AUC compares the two classes and needs both"
        return result
    from scipy.stats import mannwhitneyu

    test = mannwhitneyu(pos, neg, alternative="two-sided")
    auc = float(test.statistic) / (pos.size * neg.size)
    # (n_positive, n_negative): 1 where the positive scores higher, 1/2 on a tie
    wins = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    rng = np.random.default_rng(seed)
    boot = np.empty(n_boot)
    chunk = max(1, BOOTSTRAP_INDICES_PER_CHUNK // (pos.size + neg.size))
    for start in range(0, n_boot, chunk):
        size = min(chunk, n_boot - start)
        w_pos = rng.multinomial(pos.size, np.full(pos.size, 1 / pos.size), size=size)  # (replicates, n_positive)
        w_neg = rng.multinomial(neg.size, np.full(neg.size, 1 / neg.size), size=size)  # (replicates, n_negative)
        boot[start:start + size] = np.einsum("bi,ij,bj->b", w_pos, wins, w_neg) / (pos.size * neg.size)
    low, high = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    result.update(auc=auc, u=float(test.statistic), p_value=float(test.pvalue), bootstrap_low=float(low),
                  bootstrap_high=float(high), complete_separation=bool(auc in (0.0, 1.0)))
    return result


def _delong(wins: np.ndarray, comparable: np.ndarray, alpha: float, result: dict) -> dict:
    """Fills ``result`` with the AUC over the comparable (positive, negative) pairs of ``wins`` (1 where the
    positive scores higher, 1/2 on a tie; (n_positive, n_negative)), DeLong's variance of it (DeLong, DeLong and
    Clarke-Pearson 1988, structural components: with every pair comparable, the textbook estimator) and the Wald
    interval on the logit scale."""
    if not comparable.any():
        result["skipped"] = "no positive item may be compared with a negative one"
        return result
    wins = wins * comparable
    rows, columns = comparable.sum(axis=1), comparable.sum(axis=0)
    auc = float(wins.sum()) / int(comparable.sum())
    v_pos = wins.sum(axis=1)[rows > 0] / rows[rows > 0]
    v_neg = wins.sum(axis=0)[columns > 0] / columns[columns > 0]
    variance = (float(v_pos.var(ddof=1)) / v_pos.size if v_pos.size > 1 else 0.0) + (
        float(v_neg.var(ddof=1)) / v_neg.size if v_neg.size > 1 else 0.0)
    result.update(auc=auc, se=math.sqrt(variance), pairs=int(comparable.sum()),
                  complete_separation=auc in (0.0, 1.0))
    if 0.0 < auc < 1.0 and variance > 0:
        from scipy.stats import norm

        z = float(norm.ppf(1 - alpha / 2))
        centre, spread = math.log(auc / (1 - auc)), math.sqrt(variance) / (auc * (1 - auc))
        result.update(low=1 / (1 + math.exp(-(centre - z * spread))), high=1 / (1 + math.exp(-(centre + z * spread))))
    return result


def _auc_record(n_positive: int, n_negative: int, n_missing: int, alpha: float, method: str) -> dict:
    return {"n_positive": n_positive, "n_negative": n_negative, "n_missing": n_missing, "pairs": 0, "auc": None,
            "se": None, "low": None, "high": None, "complete_separation": None, "skipped": None, "alpha": alpha,
            "method": method}


def auc_delong(positive: Sequence[float], negative: Sequence[float], alpha: float = 0.05,
               names: tuple[str, str] = ("positive", "negative"), comparable=None) -> dict:
    """The AUC of a score separating two classes of independent items, P(positive > negative) + P(tie) / 2, with
    DeLong's variance and a Wald interval on the logit scale (so it stays inside (0, 1)).

    Why not the percentile bootstrap: with 9 against 55 items it covered 84-90% at a nominal 95% in simulation;
    this interval covers about 94% there (tests/test_stats_controls.py runs that simulation at a fixed seed).
    ``comparable`` (n_positive, n_negative) booleans, where given, keeps only the pairs that may be compared (a
    negative item observed long enough to have become positive when the positive one did); the variance is then
    DeLong's over those pairs. Where the sample separates completely (AUC 0 or 1) DeLong's variance is 0 and there
    is no interval: the bounds are None and ``complete_separation`` says so. Missing values are refused where a
    mask is given and otherwise dropped and counted; with a class (or every pair) empty the AUC is None and
    ``skipped`` says why.
    """
    alpha = check_alpha(alpha)

    def kept(values):
        return np.asarray([float(v) for v in values if v is not None and not math.isnan(float(v))], dtype=float)

    pos, neg = kept(positive), kept(negative)
    missing = len(positive) + len(negative) - int(pos.size) - int(neg.size)
    result = _auc_record(int(pos.size), int(neg.size), missing, alpha,
                         "AUC (Mann-Whitney, ties half) over the comparable pairs, with DeLong's variance; Wald "
                         "interval on the logit scale")
    if comparable is None:
        comparable = np.ones((pos.size, neg.size), dtype=bool)
    else:
        comparable = np.asarray(comparable, dtype=bool)
        if missing or comparable.shape != (pos.size, neg.size):
            raise ValueError(f"comparable must be ({len(positive)}, {len(negative)}) booleans for scores without "
                             f"missing values, got shape {comparable.shape} and {missing} missing")
    if not pos.size or not neg.size:
        result["skipped"] = f"no {names[0] if not pos.size else names[1]} item: an AUC needs both classes"
        return result
    # (n_positive, n_negative): 1 where the positive scores higher, 1/2 on a tie
    wins = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    return _delong(wins, comparable, alpha, result)


def matched_auc_delong(positive: np.ndarray, negative: np.ndarray, comparable: np.ndarray,
                       alpha: float = 0.05) -> dict:
    """:func:`auc_delong` where a pair's two scores depend on the pair: ``positive[i, j]`` and ``negative[i, j]``
    are positive item i's and negative item j's scores as compared with each other (both taken at the step where
    i turned positive, say); ``comparable`` (n_positive, n_negative) says which pairs count. Items stay the unit:
    DeLong's structural components are per item, over its comparable pairs."""
    alpha = check_alpha(alpha)
    positive, negative = np.asarray(positive, dtype=float), np.asarray(negative, dtype=float)
    comparable = np.asarray(comparable, dtype=bool)
    if not positive.shape == negative.shape == comparable.shape or positive.ndim != 2:
        raise ValueError(f"positive, negative and comparable must be one (n_positive, n_negative) shape, got "
                         f"{positive.shape}, {negative.shape} and {comparable.shape}")
    comparable = comparable & np.isfinite(positive) & np.isfinite(negative)
    result = _auc_record(int(positive.shape[0]), int(positive.shape[1]), 0, alpha,
                         "AUC over the comparable pairs, each pair's scores taken at its own matched step (ties "
                         "half), with DeLong's variance per item; Wald interval on the logit scale")
    with np.errstate(invalid="ignore"):
        wins = (positive > negative) + 0.5 * (positive == negative)
    if not positive.size:
        result["skipped"] = f"no {'positive' if not positive.shape[0] else 'negative'} item: an AUC needs both classes"
        return result
    return _delong(np.nan_to_num(wins), comparable, alpha, result)
