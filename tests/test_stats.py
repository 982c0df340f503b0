"""Checks of the report statistics against values computed independently of statsmodels."""

import json
import math

import numpy as np
import pytest
from scipy.stats import binom

from stagereplay.analysis.stats import (
    first_divergence_summary,
    follow_rate,
    divergence_margin_test,
    paired_accuracy_difference,
    proportion,
    rank_correlation,
)


def wilson_bounds(k, n, alpha=0.05):
    # Closed-form Wilson score interval: (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n).
    z = 1.959963984540054  # norm.ppf(0.975), written out so the test does not share code with the module
    p = k / n
    centre = p + z**2 / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    return (centre - half) / (1 + z**2 / n), (centre + half) / (1 + z**2 / n)


def study_pairs():
    """The reference study's 200 items: 100 both right, 11 only a right, 9 only b right, 80 both wrong."""
    a = [True] * 100 + [True] * 11 + [False] * 9 + [False] * 80
    b = [True] * 100 + [False] * 11 + [True] * 9 + [False] * 80
    return a, b


def test_proportion_zero_of_200_matches_closed_forms():
    result = proportion(0, 200)
    assert result["rate"] == 0.0
    assert result["wilson_low"] == 0.0
    assert result["wilson_high"] == pytest.approx(wilson_bounds(0, 200)[1], abs=1e-12)
    assert round(result["wilson_high"], 4) == 0.0188  # the study's "95% Wilson upper bound 1.88%"
    # With k = 0 the Clopper-Pearson upper bound solves (1 - p)^n = alpha/2.
    assert result["clopper_pearson_low"] == 0.0
    assert result["clopper_pearson_high"] == pytest.approx(1 - 0.025 ** (1 / 200), abs=1e-12)
    assert result["n"] == 200 and result["alpha"] == 0.05 and result["method"]


@pytest.mark.parametrize("k, n", [(20, 200), (166, 200), (1, 3)])
def test_proportion_wilson_matches_closed_form(k, n):
    result = proportion(k, n)
    assert (result["wilson_low"], result["wilson_high"]) == pytest.approx(wilson_bounds(k, n), abs=1e-12)
    assert result["clopper_pearson_low"] <= result["rate"] <= result["clopper_pearson_high"]


def test_proportion_all_successes_mirrors_none():
    result = proportion(200, 200)
    assert result["rate"] == 1.0 and result["wilson_high"] == 1.0 and result["clopper_pearson_high"] == 1.0
    assert result["clopper_pearson_low"] == pytest.approx(0.025 ** (1 / 200), abs=1e-12)
    assert result["wilson_low"] == pytest.approx(1 - proportion(0, 200)["wilson_high"], abs=1e-12)


def test_proportion_of_nothing_is_none_not_an_error():
    result = proportion(0, 0)
    assert result["n"] == 0 and result["rate"] is None
    bounds = ("wilson_low", "wilson_high", "clopper_pearson_low", "clopper_pearson_high")
    assert all(result[key] is None for key in bounds)


@pytest.mark.parametrize("k, n, alpha", [(3, 2, 0.05), (-1, 5, 0.05), (1.0, 5, 0.05), (True, 5, 0.05), (1, 5, 0.0)])
def test_proportion_rejects_bad_input(k, n, alpha):
    with pytest.raises(ValueError):
        proportion(k, n, alpha)


def test_paired_difference_reproduces_reference_study():
    a, b = study_pairs()
    result = paired_accuracy_difference(a, b)
    assert result["n"] == 200
    assert result["accuracy_a"] == pytest.approx(0.555) and result["accuracy_b"] == pytest.approx(0.545)
    assert result["difference"] == pytest.approx(0.01)
    assert (result["discordant_a_only"], result["discordant_b_only"]) == (11, 9)
    # Tolerance 0.01: the percentile ends move with bootstrap Monte-Carlo error (one resample step is 0.005, and the
    # seed picks which side of a step an end lands on), not with any approximation in the method.
    assert result["bootstrap_low"] == pytest.approx(-0.035, abs=0.01)
    assert result["bootstrap_high"] == pytest.approx(0.055, abs=0.01)
    # Exact McNemar: two-sided binomial test of 9 out of 20 discordant pairs at p = 1/2.
    assert result["mcnemar_p"] == pytest.approx(min(1.0, 2 * binom.cdf(9, 20, 0.5)), abs=1e-12)
    assert (result["n_boot"], result["seed"], result["alpha"]) == (10000, 0, 0.05)


def test_paired_bootstrap_is_seeded():
    a, b = study_pairs()
    first = paired_accuracy_difference(a, b, seed=1)
    assert paired_accuracy_difference(a, b, seed=1) == first
    others = [paired_accuracy_difference(a, b, seed=s) for s in (2, 3, 4)]
    # Percentile ends sit on a 0.005 grid, so one other seed could tie; three all tying would mean the seed is ignored.
    assert any((o["bootstrap_low"], o["bootstrap_high"]) != (first["bootstrap_low"], first["bootstrap_high"])
               for o in others)


def test_paired_bootstrap_over_many_items_runs_in_chunks():
    # 30,000 items put the (replicates, items) index matrix over its chunk size; the chunks must still add up to one CI.
    rng = np.random.default_rng(7)
    a, b = rng.random(30_000) < 0.6, rng.random(30_000) < 0.5
    result = paired_accuracy_difference(a, b, n_boot=500)
    assert result["bootstrap_low"] < result["difference"] < result["bootstrap_high"]


def test_paired_difference_without_discordant_pairs():
    result = paired_accuracy_difference([True, False, True], [True, False, True], n_boot=100)
    assert result["difference"] == 0.0 and result["mcnemar_p"] == 1.0
    assert result["bootstrap_low"] == result["bootstrap_high"] == 0.0


@pytest.mark.parametrize("a, b", [([True, False], [True]), ([], []), ([True, 2], [True, False]),
                                  ([[True]], [[True]])])
def test_paired_difference_rejects_bad_input(a, b):
    with pytest.raises(ValueError):
        paired_accuracy_difference(a, b, n_boot=10)


def test_follow_rate_counts_and_donor_proportion():
    result = follow_rate(["donor"] * 43 + ["recipient"] * 2 + ["neither"])
    assert (result["n"], result["donor"], result["recipient"], result["neither"]) == (46, 43, 2, 1)
    assert result["follows_donor"] == proportion(43, 46)
    assert follow_rate(["donor"] * 24)["follows_donor"]["rate"] == 1.0
    assert follow_rate([])["follows_donor"]["rate"] is None
    with pytest.raises(ValueError):
        follow_rate(["donor", "cache"])


def test_first_divergence_summary():
    result = first_divergence_summary([4, None, 0, 10, 2, float("nan"), 6])
    assert (result["n"], result["n_none"]) == (5, 2)
    assert (result["min"], result["q1"], result["median"], result["q3"], result["max"]) == (0, 2.0, 4.0, 6.0, 10)
    empty = first_divergence_summary([None, None])
    assert (empty["n"], empty["n_none"], empty["median"]) == (0, 2, None)


def test_results_are_json_ready():
    a, b = study_pairs()
    results = [proportion(0, 200), proportion(0, 0), paired_accuracy_difference(a, b, n_boot=50),
               follow_rate(["donor", "neither"]), first_divergence_summary([1, None])]
    # allow_nan=False also catches a NaN that would slip into stats.json as invalid JSON.
    for result in results:
        assert json.loads(json.dumps(result, allow_nan=False)) == result
        assert "n" in result and "method" in result


def test_divergence_margin_test_is_per_item_and_leaves_the_divergence_step_out():
    # Four items. Item 1: divergence 0.05 against other steps (1, 2, 3): median 2, below. Item 2: 0.2 against
    # (0.1, 0.3): median 0.2, a tie (left out of the sign test). Item 3: 5.0 against (1.0,): above. Item 4: 0.01
    # against (0.5, 0.6, 0.7, 0.8): median 0.65, below. Item 5 has no other step and is counted apart.
    items = [(0.05, [1.0, 2.0, 3.0]), (0.2, [0.1, 0.3]), (5.0, [1.0]), (0.01, [0.5, 0.6, 0.7, 0.8]), (0.3, [])]
    result = divergence_margin_test(items)
    assert (result["n"], result["n_no_other_step"], result["n_ties"]) == (4, 1, 1)
    assert (result["below_item_median"], result["above_item_median"]) == (2, 1)
    # Exact sign test by hand: P(X >= 2), X ~ Binomial(3, 1/2) = (3 + 1) / 8.
    assert result["sign_test_p_less"] == pytest.approx(4 / 8, abs=1e-12)
    assert result["sign_test_p_less"] == pytest.approx(binom.sf(1, 3, 0.5), abs=1e-12)
    # within-item percentiles 0, 1/2, 1, 0: median 0.25
    assert result["median_within_item_percentile"] == pytest.approx(0.25)
    assert result["median_of_item_medians"] == pytest.approx(np.median([2.0, 0.2, 1.0, 0.65]))
    assert "sign test" in result["method"] and "left out" in result["method"]
    assert json.loads(json.dumps(result, allow_nan=False)) == result


def test_divergence_margin_test_does_not_pool_steps_of_one_item():
    """One item with many steps must weigh as much as one with few: pooling steps (the old Mann-Whitney test of
    divergence margins against every step) let a long suffix decide the test on its own."""
    few = [(0.01, [1.0])] * 3  # three items whose divergence is below their other steps
    long_item = [(0.5, list(np.linspace(0.0, 0.4, 500)))]  # one item above its 500 other steps
    result = divergence_margin_test(few + long_item)
    assert result["n"] == 4 and (result["below_item_median"], result["above_item_median"]) == (3, 1)
    assert result["sign_test_p_less"] == pytest.approx(binom.sf(2, 4, 0.5), abs=1e-12)


def test_divergence_margin_test_without_divergences():
    result = divergence_margin_test([])
    assert result["n"] == 0 and result["median_divergence"] is None and result["sign_test_p_less"] is None
    assert divergence_margin_test([(None, [1.0]), (float("nan"), [1.0])])["n"] == 0


def test_rank_correlation_with_a_seeded_bootstrap_interval():
    monotone = rank_correlation([1, 2, 3, 4, 5], [0.1, 0.4, 0.5, 2.0, 9.0], n_boot=500, seed=3)
    # scipy computes rho in floating point: 1 to within a few ulps
    assert monotone["rho"] == pytest.approx(1.0, abs=1e-12) and monotone["p_value"] < 0.05 and monotone["n"] == 5
    # resamples of one repeated item have no rank correlation: left out of the interval and counted
    assert monotone["bootstrap_high"] == pytest.approx(1.0, abs=1e-12) and monotone["n_boot_undefined"] > 0
    assert rank_correlation([1, 2, 3, 4, 5], [5, 4, 3, 2, 1], n_boot=500, seed=3)["rho"] == pytest.approx(-1.0)
    noisy = [0.3, 0.1, 0.8, 0.5, 0.9, 0.2, 0.7], [2.0, 1.0, 3.5, 1.5, 2.5, 0.5, 4.0]
    assert rank_correlation(*noisy, seed=1) == rank_correlation(*noisy, seed=1)  # reproducible
    short = rank_correlation([1.0, None, 2.0], [3.0, 1.0, float("nan")])
    assert short["n"] == 1 and short["n_missing"] == 2 and short["rho"] is None
    with pytest.raises(ValueError, match="paired"):
        rank_correlation([1, 2, 3], [1, 2])
