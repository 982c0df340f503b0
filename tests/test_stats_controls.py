"""The statistics behind the report's controls: an exact interval for a paired accuracy difference and its
equivalence test, and the DeLong interval of an AUC; each against the percentile bootstrap it replaces, by a small
simulation at a fixed seed (coverage counted, never timed)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import norm

from stagereplay.analysis import separation, stats


def test_no_discordant_pair_is_not_an_interval_on_zero():
    exact = stats.paired_difference_interval(0, 0, 64)
    assert exact["difference"] == 0.0 and exact["low"] < -0.04 and exact["high"] > 0.04
    boot = stats.paired_accuracy_difference([True] * 64, [True] * 64, n_boot=200)
    assert boot["bootstrap_low"] == boot["bootstrap_high"] == 0.0  # what the exact interval replaces


def test_the_exact_interval_is_ordered_and_refuses_bad_counts():
    r = stats.paired_difference_interval(11, 9, 200)
    assert r["low"] < r["difference"] == 0.01 < r["high"]
    assert stats.paired_difference_interval(9, 11, 200)["low"] == pytest.approx(-r["high"], abs=1e-12)
    with pytest.raises(ValueError, match="a_only \\+ b_only <= n"):
        stats.paired_difference_interval(5, 5, 8)


def test_equivalence_names_what_was_shown():
    assert stats.accuracy_equivalence(0, 0, 200, margin=0.05)["verdict"] == "equivalent"
    assert stats.accuracy_equivalence(0, 0, 20, margin=0.05)["verdict"] == "undecided"  # too few items to tell
    assert stats.accuracy_equivalence(11, 9, 200, margin=0.05)["verdict"] == "undecided"
    assert stats.accuracy_equivalence(20, 2, 200, margin=0.05)["verdict"] == "difference"
    with pytest.raises(ValueError, match="equivalence margin"):
        stats.accuracy_equivalence(0, 0, 10, margin=5)


def _paired(rng, n, a_only, b_only):
    u = rng.uniform(size=n)
    both = (u >= a_only + b_only) & (rng.uniform(size=n) < 0.5)
    return (u < a_only) | both, ((u >= a_only) & (u < a_only + b_only)) | both


def test_exact_paired_interval_covers_where_the_percentile_bootstrap_does_not():
    """64 items, 3% right under a only, none under b only (true difference +3 points): the exact interval covers
    at least its nominal 95%; the percentile bootstrap (its [0, 0] whenever no discordant pair is drawn) does not."""
    rng, true, runs = np.random.default_rng(7), 0.03, 200
    exact = percentile = 0
    for run in range(runs):
        a, b = _paired(rng, 64, 0.03, 0.0)
        boot = stats.paired_accuracy_difference(a, b, n_boot=500, seed=run)
        percentile += boot["bootstrap_low"] <= true <= boot["bootstrap_high"]
        ex = stats.paired_difference_interval(boot["discordant_a_only"], boot["discordant_b_only"], 64)
        exact += ex["low"] <= true <= ex["high"]
    assert exact / runs >= 0.95
    assert percentile / runs < 0.92


def test_delong_interval_covers_near_nominal_where_the_percentile_bootstrap_does_not():
    """9 split against 55 unsplit items, binormal scores (true AUC 0.80): the logit DeLong interval covers within
    [0.92, 0.97] of a nominal 0.95; the percentile bootstrap below it (and below 0.93)."""
    rng, shift, runs = np.random.default_rng(0), 1.2, 300
    true = float(norm.cdf(shift / np.sqrt(2)))
    delong = percentile = 0
    for run in range(runs):
        pos, neg = rng.normal(shift, 1, 9), rng.normal(0, 1, 55)
        d = separation.auc_delong(pos, neg)
        delong += d["low"] is not None and d["low"] <= true <= d["high"]
        b = separation.rank_separation(pos, neg, n_boot=500, seed=run)
        percentile += b["bootstrap_low"] <= true <= b["bootstrap_high"]
    assert 0.92 <= delong / runs <= 0.97
    assert percentile / runs < min(0.93, delong / runs)


def test_delong_known_answers():
    r = separation.auc_delong([1, 3, 5], [2, 0, 0.5])
    assert r["auc"] == pytest.approx(8 / 9) and r["low"] < r["auc"] < r["high"] < 1
    done = separation.auc_delong([3, 4], [1, 2])
    assert done["auc"] == 1.0 and done["complete_separation"] and done["low"] is None
    assert "no negative item" in separation.auc_delong([1], [float("nan")])["skipped"]
