"""Where the divergence lives: the minimal-transplant search (with a fake runner and on the toy), explicit position
spans, the divergence onset, their report sections and figures."""

from pathlib import Path

import pandas as pd
import pytest
import torch

from stagereplay.experiments.minimal_transplant import Box, candidates, search, search_together, span_shares
from stagereplay.experiments.transplant import transplant_edit
from stagereplay.experiments.transplant_specs import TransplantSpec, position_range

REPO = Path(__file__).resolve().parents[1]
# the suffix budget of the toy tests: items of the default selection split within it (tests/toy_divergence.py)
N_NEW = 16


def planted(layers=None, component=None, positions=None):
    """A fake runner: a box suffices when it holds every planted layer, component and position."""
    calls = []

    def sufficient(box: Box) -> bool:
        calls.append(box)
        return ((layers is None or set(layers) <= set(box.layers))
                and (component is None or box.component in ("kv", component))
                and (positions is None or set(positions) <= set(range(box.position_lo, box.position_hi))))

    return sufficient, calls


def test_bisection_finds_a_planted_part_and_proves_its_halves_insufficient():
    sufficient, calls = planted(layers=[2], component="k", positions=[15])
    result = search(sufficient, num_layers=4, cache_length=23, budget=40)
    assert result.full_sufficient and result.locally_minimal and not result.budget_exhausted
    assert result.box == Box(2, 3, "k", 15, 16)  # exactly the planted part: the halvings reach it
    assert result.runs == len(calls) == len(set(calls)) == len(result.trials)  # each box run once
    tried = dict(result.trials)
    assert tried[result.box] and all(not tried[c] for axis in ("component", "layers", "positions")
                                     for c in candidates(result.box, axis))
    assert search(planted(layers=[2], component="k", positions=[15])[0], 4, 23, 40) == result  # deterministic


def test_bisection_is_minimal_against_halving_not_globally():
    # the part that suffices straddles the midpoint of the positions: no half suffices, so the search keeps all 8
    result = search(planted(component="v", positions=[3, 4])[0], num_layers=1, cache_length=8, budget=40)
    assert result.locally_minimal and result.box == Box(0, 1, "v", 0, 8)


def test_budget_and_whole_cache_failures_are_reported():
    sufficient, calls = planted(layers=[2], component="v", positions=[5])
    result = search(sufficient, num_layers=4, cache_length=23, budget=4)
    assert result.budget_exhausted and not result.locally_minimal and result.runs == len(calls) == 4
    assert dict(result.trials)[result.box]  # what it returns was run and sufficed
    never = search(lambda box: False, num_layers=4, cache_length=23, budget=4)
    assert never.box is None and not never.full_sufficient and never.runs == 1
    with pytest.raises(ValueError, match="budget of at least one"):
        search(sufficient, 4, 23, 0)


def test_searches_in_lockstep_try_what_each_search_alone_tries():
    """The stage runs the searches of a batch's rows together, one decode per round: each must try exactly the
    boxes, in the order, and return the result it gets alone, also when the searches end after different rounds."""
    plants = {0: dict(layers=[2], component="k", positions=[15]), 1: dict(component="v", positions=[3, 4]),
              2: dict(layers=[0, 3]), 3: dict(layers=[1], component="v", positions=[5])}
    shapes = {0: (4, 23), 1: (1, 8), 2: (4, 23), 3: (4, 23)}
    for budget in (4, 40):
        runners = {key: planted(**plant)[0] for key, plant in plants.items()}
        rounds = []

        def sufficient(boxes):
            rounds.append(sorted(boxes))
            return {key: runners[key](box) for key, box in boxes.items()}

        together = search_together(sufficient, shapes, budget)
        alone = {key: search(planted(**plants[key])[0], *shapes[key], budget) for key in plants}
        assert together == alone
        assert len(rounds) == max(r.runs for r in alone.values())  # one round per box of the longest search
        assert len({r.runs for r in alone.values()}) > 1 or budget == 4  # they end after different rounds


def test_span_shares():
    assert span_shares(10, 15, prompt_length=12, cache_length=20) == {
        "share_of_cache": 5 / 20, "share_of_prompt": 2 / 12, "share_of_stage": 3 / 8}
    assert span_shares(0, 4, prompt_length=4, cache_length=4)["share_of_stage"] is None


def test_explicit_position_spans_write_only_their_positions():
    assert position_range((3, 7), prompt_len=5, cache_len=9) == (3, 7)
    assert position_range((0, 5), 5, 9) == position_range("prompt", 5, 9)
    for bad in ((4, 4), (-1, 3), (2, 10)):
        with pytest.raises(ValueError, match="position span"):
            position_range(bad, 5, 9)
    donor = [(torch.ones(1, 2, 9, 4), torch.ones(1, 2, 9, 4) * 2) for _ in range(3)]  # (1, kv_heads, seq, head_dim)
    layers = [(torch.zeros(1, 2, 9, 4), torch.zeros(1, 2, 9, 4)) for _ in range(3)]
    transplant_edit(0, TransplantSpec("minimal", (1,), "v", (3, 7)), donor, prompt_len=5)(0, layers)
    for i, (k, v) in enumerate(layers):
        assert not k.any()
        expected = torch.zeros(9)
        if i == 1:
            expected[3:7] = 2
        assert torch.equal(v[0, 0, :, 0], expected)


# ---- on the embedded toy: the stages, through the one recipe ---------------------------------------------------------
@pytest.fixture(scope="module")
def divergent_ledger(tmp_path_factory):
    """A bf16 ledger of two items whose constructions diverge and one whose do not, as the workflow makes it; and the
    divergent items (which ones split depends on the CPU's bf16 kernels: tests/toy_divergence.py)."""
    from toy_divergence import DEFAULT_BOUNDARY, toy_items

    from stagereplay.io.parquet import read_parquet, write_parquet
    from stagereplay.stages.gather import gather_ledger
    from stagereplay.stages.reconstruct import reconstruct_prefixes
    from stagereplay.stages.select import select_items
    from stagereplay.stages.settings import ReconstructSettings, from_params

    folder = tmp_path_factory.mktemp("divergent_ledger")
    model = dict(model=str(REPO / "data/toy"), revision="primary", device="cpu", progress=False)
    select_items({"source": "synthetic", "size": 5000, "seed": 0}, 200, 0, str(folder / "all.parquet"))
    items = read_parquet(folder / "all.parquet")
    divergent, agreeing = toy_items(N_NEW)
    items = items[items["item_index"].isin([*divergent, agreeing])].reset_index(drop=True)
    write_parquet(items, folder / "items.parquet", {"stage": "test: three items of the default selection"})
    reconstruct_prefixes(str(folder / "items.parquet"), str(folder / "part.parquet"), str(folder / "prefixes.parquet"),
                         str(folder / "bridge.parquet"), from_params(ReconstructSettings, dict(
                             model, precision="bf16", boundary=DEFAULT_BOUNDARY, max_stage_tokens=32,
                             max_new_tokens=N_NEW, bridge={"n_rows": 0, "seed": 0})))
    gather_ledger([str(folder / "part.parquet")], str(folder / "ledger.parquet"))
    return folder, model, divergent


@pytest.mark.slow
def test_minimal_transplants_and_onset_on_the_toy(divergent_ledger, tmp_path):
    from stagereplay.analysis.divergence_location import (divergence_onset_section, minimal_coverage,
                                                          minimal_transplant_section, onset_items)
    from stagereplay.analysis.revision_data import RevisionData
    from stagereplay.experiments.minimal_transplant import Box
    from stagereplay.stages.divergence_onset import ONSET_SCHEMA, measure_divergence_onset
    from stagereplay.stages.minimal_transplant import MINIMAL_TRANSPLANT_SCHEMA, VERDICTS, find_minimal_transplants
    from stagereplay.stages.settings import MinimalTransplantSettings, OnsetSettings, from_params
    from stagereplay.stages.transplant_selection import select_transplant_items

    folder, model, divergent = divergent_ledger
    ledger = str(folder / "ledger.parquet")
    selection = select_transplant_items(ledger, str(tmp_path / "selection.parquet"), revision="primary",
                                        precision="bf16", select="sample:3", seed=0)
    assert set(selection.loc[selection["divergent"], "item_index"]) == set(divergent)
    out = tmp_path / "minimal_transplant.parquet"
    df = find_minimal_transplants(str(tmp_path / "selection.parquet"), ledger, str(out), from_params(
        MinimalTransplantSettings, dict(model, precision="bf16", max_new_tokens=N_NEW, budget=24)))
    assert list(pd.read_parquet(out).columns) == MINIMAL_TRANSPLANT_SCHEMA.names
    assert len(df) == 2 * len(divergent) and set(df["item_index"]) == set(divergent)  # the agreeing item is not searched
    assert df["full_sufficient"].all() and (df["runs"] <= 24).all() and (df["runs"] == df["trials"].map(len)).all()
    assert set(df["verdict"]) <= set(VERDICTS) and (df["verdict"] != VERDICTS[2]).all()
    assert (df["sham_cache_fingerprint"].notna()).all()
    for r in df.itertuples():
        assert r.trial_outcomes[0] == "donor" and r.trials[0].startswith("layers all · KV")
        assert len(r.trial_placebo_outcomes) == len(r.trial_noops) == r.runs
        assert r.whole_placebo_follows == (r.trial_placebo_outcomes[0] == "donor")
        if r.verdict != "localised":  # the whole cache's placebo carried too: no box can be told from a push
            assert r.whole_placebo_follows and pd.isna(r.layer_lo) and r.runs == 1
            continue
        assert r.locally_minimal != r.budget_exhausted
        # the set found was run, carried the donor, and its placebo did not
        box = Box(int(r.layer_lo), int(r.layer_hi), r.component, int(r.position_lo), int(r.position_hi))
        carried = [t for t, o, p in zip(r.trials, r.trial_outcomes, r.trial_placebo_outcomes)
                   if o == "donor" and p != "donor"]
        assert box.label(r.num_layers) in carried
        assert 0 < r.share_of_state <= 1
    off = find_minimal_transplants(str(tmp_path / "selection.parquet"), ledger, str(tmp_path / "off.parquet"),
                                   from_params(MinimalTransplantSettings, dict(model, precision="bf16",
                                                                               max_new_tokens=N_NEW, budget=0)))
    assert off.empty

    onset_path = tmp_path / "divergence_onset.parquet"
    onset = measure_divergence_onset(ledger, str(onset_path), from_params(OnsetSettings, dict(
        model, max_new_tokens=N_NEW)))
    assert list(pd.read_parquet(onset_path).columns) == ONSET_SCHEMA.names
    assert set(onset["item_index"]) == set(divergent) and set(onset["precision"]) == {"bf16"}
    items = onset_items(onset)
    assert len(items) == len(divergent) and items["margin_a"].notna().all() and items["first_divergence"].notna().all()
    for r in items.itertuples():  # the onset is the first layer and position whose bytes differ
        rows = onset[(onset["item_index"] == r.item_index) & ~onset["bit_equal"]]
        assert r.onset_layer == rows["layer"].min()
        assert r.onset_position == rows.loc[rows["layer"] == r.onset_layer, "first_position_differs"].min()

    coverage = minimal_coverage(df)
    assert (coverage["included"] <= coverage["n"]).all() and coverage["included"].sum() > 0
    data = RevisionData("primary", {"minimal_transplant": str(out), "divergence_onset": str(onset_path)})
    lines, numbers = minimal_transplant_section(data)
    assert numbers["budget"] == 24 and numbers["cells"]["bf16"]["live->prefill"]["n"] == len(divergent)
    assert "not a global minimum" in "\n".join(lines)
    lines, numbers = divergence_onset_section(data)
    assert numbers["bf16"]["n"] == len(divergent) and "Spearman" in "\n".join(lines)


# ---- the report's sections on synthetic tables ------------------------------------------------------------------------
def test_sections_count_per_direction_and_say_when_the_search_is_off(tmp_path):
    from report_data import synthetic_minimal_transplant, synthetic_onset, write, write_with

    from stagereplay.analysis.divergence_location import divergence_onset_section, minimal_transplant_section
    from stagereplay.analysis.revision_data import RevisionData
    from stagereplay.stages.minimal_transplant import MINIMAL_TRANSPLANT_SCHEMA

    minimal = synthetic_minimal_transplant()
    data = RevisionData("primary", {
        "minimal_transplant": write_with(minimal, tmp_path / "m.parquet", {"config": {"budget": 24}}),
        "divergence_onset": write(synthetic_onset(), tmp_path / "o.parquet")})
    lines, numbers = minimal_transplant_section(data)
    cell = numbers["cells"]["bf16"]["live->prefill"]
    assert cell["n"] == 5 and cell["budget_exhausted"]["k"] == 1 and cell["locally_minimal"]["k"] == 4
    assert cell["k_or_v_alone"]["k"] == 3 and cell["components"] == {"kv": 2, "k": 2, "v": 1}
    # a file without the placebo's verdicts says so, never reads its boxes as localised beyond a control
    assert cell["not_separable"] is None and "predates the placebo control" in "\n".join(lines)
    assert cell["single_layer"]["k"] == 2 and cell["stage_positions_only"]["k"] == 5
    assert cell["k_or_v_alone"]["wilson_low"] is not None and cell["layer_included"]["0"]["k"] == 3
    assert "not a global minimum" in "\n".join(lines)
    lines, numbers = divergence_onset_section(data)
    onset = numbers["bf16"]
    assert onset["n"] == 6 and onset["onset_layer_counts"] == {"0": 1, "1": 5}
    assert onset["onset_at_layer_0"]["k"] == 1 and onset["rms_grows_to_last_layer"]["k"] == 6
    assert onset["margin_vs_last_layer_max_abs"]["n"] == 6
    # with the verdicts, an item whose whole cache's placebo carried too is named, and counts as not localised
    tied = minimal.assign(verdict=["not separable from its placebo"] + ["localised"] * (len(minimal) - 1))
    controlled = RevisionData("primary", {"minimal_transplant": write_with(tied, tmp_path / "t.parquet",
                                                                     {"config": {"budget": 24}})})
    _, numbers = minimal_transplant_section(controlled)
    first = numbers["cells"][tied["precision"].iloc[0]][tied["direction"].iloc[0]]
    assert first["not_separable"]["k"] == 1 and first["localised"]["k"] == first["n"] - 1
    assert numbers["not_separable"] == [f"{tied['item_id'].iloc[0]} {tied['direction'].iloc[0]}"]

    empty = pd.DataFrame(columns=MINIMAL_TRANSPLANT_SCHEMA.names)
    off = RevisionData("primary", {"minimal_transplant": write_with(empty, tmp_path / "off.parquet",
                                                                    {"config": {"budget": 0}})})
    lines, numbers = minimal_transplant_section(off)
    assert numbers["status"] == "off" and "budget` is 0" in lines[0]
