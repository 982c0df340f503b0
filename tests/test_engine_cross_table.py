"""The engine report's cross-table (stagereplay.analysis.cross_table and engine_report.crossed): both marginals, the
count expected under independence, the odds ratio and Fisher's exact p, each checked against a hand computation, and
the cases where the odds ratio is undefined. Needs no engine."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from stagereplay.analysis.cross_table import cross_table, odds_ratio_text
from stagereplay.analysis.engine_report import crossed


def outcomes(*flags: int) -> dict[int, bool]:
    return {i: bool(f) for i, f in enumerate(flags)}


def test_marginals_expected_count_odds_ratio_and_fisher_p_match_a_hand_computation():
    # 8 items: A splits on 0, 1, 2; B on 0, 1, 3. Table [[both 2, A only 1], [B only 1, neither 4]].
    a = outcomes(1, 1, 1, 0, 0, 0, 0, 0)
    b = outcomes(1, 1, 0, 1, 0, 0, 0, 0)
    cell = cross_table(a, b)
    assert {k: cell[k] for k in ("n", "a_splits", "b_splits", "both", "a_only", "b_only", "neither")} == {
        "n": 8, "a_splits": 3, "b_splits": 3, "both": 2, "a_only": 1, "b_only": 1, "neither": 4}
    assert cell["expected_both"] == 3 * 3 / 8  # 1.125 items under independence
    assert cell["odds_ratio"] == (2 * 4) / (1 * 1)
    # Hypergeometric with margins 3 and 3 of 8: P(both = x) = C(3, x) C(5, 3 - x) / C(8, 3), C(8, 3) = 56:
    # x = 0, 1, 2, 3 -> 10, 30, 15, 1 (/56). Two-sided: the tables no more likely than the observed x = 2 (15).
    assert cell["fisher_p"] == pytest.approx((10 + 15 + 1) / 56, rel=1e-12)
    assert cell["undefined"] is None


def test_the_study_shaped_overlap_is_close_to_what_independence_gives():
    # 64 items, A splits on 9, B on 48, both on 8 (the shape of an earlier GPU table): 6.75 expected by chance
    a = {i: i < 9 for i in range(64)}
    b = {i: i < 8 or 9 <= i < 49 for i in range(64)}
    cell = cross_table(a, b)
    assert (cell["a_splits"], cell["b_splits"], cell["both"], cell["neither"]) == (9, 48, 8, 15)
    assert cell["expected_both"] == 9 * 48 / 64
    assert cell["odds_ratio"] == (8 * 15) / (1 * 40)
    assert 0.4 < cell["fisher_p"] < 0.5


@pytest.mark.parametrize("a, b, why", [
    (outcomes(1, 0, 1, 0), outcomes(0, 0, 0, 0), "B never splits"),
    (outcomes(1, 1, 1, 1), outcomes(1, 0, 1, 0), "A always splits"),
    ({}, outcomes(1, 0), "no item on both sides"),
])
def test_the_odds_ratio_is_undefined_where_a_marginal_is_0_or_n(a, b, why):
    cell = cross_table(a, b)
    assert cell["odds_ratio"] is None and cell["fisher_p"] is None and why in cell["undefined"]
    assert odds_ratio_text(cell) == f"undefined: {cell['undefined']}"


def test_an_empty_off_diagonal_cell_gives_an_infinite_odds_ratio_and_a_valid_test():
    cell = cross_table(outcomes(1, 1, 0, 0, 0), outcomes(1, 1, 1, 0, 0))  # A only: 0
    assert math.isinf(cell["odds_ratio"]) and 0 < cell["fisher_p"] <= 1
    assert odds_ratio_text(cell).startswith("inf")


def rows(experiment: str, construction: str, precision: str, suffixes: list[list[int]], **extra) -> list[dict]:
    return [{"item_index": i, "item_id": f"item-{i}", "revision": "r", "experiment": experiment,
             "precision": precision, "construction": construction, "replica": 1, "status": "ok",
             "suffix_ids": s, "margins": [1.0] * len(s), "correct": False, "stop_reason": "max_new_tokens", **extra}
            for i, s in enumerate(suffixes)]


def test_the_reports_cross_table_reads_the_reference_ids_rows_and_the_pipelines_fixed_prefix():
    base = [[1, 2]] * 8
    engine_split = [[9, 9] if i < 3 else [1, 2] for i in range(8)]
    ours_split = [[9, 9] if i in (0, 1, 3) else [1, 2] for i in range(8)]
    ref = dict(stage_source="reference")
    engine = pd.DataFrame(rows("llama_cpp_reference_stage", "incremental", "kv_f16", base, **ref)
                          + rows("llama_cpp_reference_stage", "prefill", "kv_f16", engine_split, **ref)
                          + rows("llama_cpp_own_stage", "live", "kv_f16", base, stage_source="engine")
                          + rows("llama_cpp_own_stage", "prefill", "kv_f16", base, stage_source="engine"))
    ledger = pd.DataFrame(rows("fixed_prefix", "incremental", "bf16", base)
                          + rows("fixed_prefix", "prefill", "bf16", ours_split))
    cell = crossed(engine, ledger).iloc[0].to_dict()
    assert (cell["engine_precision"], cell["precision"], cell["n"], cell["a_splits"], cell["b_splits"],
            cell["both"], cell["expected_both"], cell["odds_ratio"]) == ("kv_f16", "bf16", 8, 3, 3, 2, 1.125, 8.0)
