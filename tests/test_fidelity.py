"""Fidelity along the suffix: the per-step measures, the stage on the shipped toy's divergent items (a byte-identical
pair gives exact zeros, a differing pair does not, the first argmax difference is the ledger's first divergence),
the statistics on hand-made data, the report's wording, and the stage inside the tiny workflow run."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from stagereplay.analysis import separation, stats
from stagereplay.analysis.fidelity import fidelity_section, item_summary
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.experiments.fidelity import FIDELITY_SCHEMA, ReferenceMismatchError, step_measures
from stagereplay.experiments.rows import LEDGER_SCHEMA
from stagereplay.io.ids import first_divergence
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.stages.fidelity import fidelity_items, measure_fidelity
from stagereplay.stages.reconstruct import reconstruct_prefixes
from stagereplay.stages.select import select_items
from stagereplay.stages.settings import FidelitySettings, ReconstructSettings

from toy_divergence import DEFAULT_BOUNDARY, toy_items

REPO = Path(__file__).resolve().parents[1]
N_NEW = 48
CONTRACT = ["item_id", "precision", "reference", "construction", "step", "token_id", "kl_forward", "kl_reverse",
            "kl_sym", "max_abs_logit_diff", "margin_reference", "margin_construction", "argmax_differs",
            "logits_equal", "batch_index", "batch_row", "layout_pad", "layout_position"]


# --- the per-step measures ------------------------------------------------------------------------------------------

def test_byte_equal_logits_give_exact_zeros_and_others_do_not():
    torch.manual_seed(0)
    a = torch.randn(3, 50) * 4
    b = a.clone()
    b[1, 7] = torch.nextafter(b[1, 7], torch.tensor(100.0))  # one ulp at one entry of step 1
    b[2] += torch.randn(50) * 0.5
    m = step_measures(a, b)
    assert list(m["logits_equal"]) == [True, False, False]
    assert m["kl_forward"][0] == 0.0 and m["kl_reverse"][0] == 0.0 and m["kl_sym"][0] == 0.0
    assert m["max_abs_logit_diff"][0] == 0.0
    assert (m["kl_forward"][1:] > 0).all() and (m["kl_reverse"][1:] > 0).all()
    assert m["max_abs_logit_diff"][1] == float(b[1, 7].double() - a[1, 7].double())
    # -0.0 and 0.0 are equal numbers but not equal bytes
    c, d = torch.zeros(1, 4), torch.zeros(1, 4)
    d[0, 2] = -0.0
    assert not step_measures(c, d)["logits_equal"][0]


def test_kl_is_the_textbook_sum_where_that_is_accurate():
    """At differences far above fp32's rounding the identity used gives the plain sum p (log p - log q); tolerance
    1e-12 relative: both are float64 computations of the same quantity, here about 0.1 nats."""
    torch.manual_seed(1)
    a, b = torch.randn(4, 30), torch.randn(4, 30)
    m = step_measures(a, b)
    la, lb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    plain = (la.exp() * (la - lb)).sum(-1).numpy()
    assert np.allclose(m["kl_forward"], plain, rtol=1e-12, atol=0)
    assert np.allclose(m["kl_reverse"], (lb.exp() * (lb - la)).sum(-1).numpy(), rtol=1e-12, atol=0)
    assert np.allclose(m["kl_sym"], (m["kl_forward"] + m["kl_reverse"]) / 2, rtol=0, atol=0)
    top = torch.topk(a, 2, -1).values
    assert (m["margin_reference"] == (top[:, 0] - top[:, 1]).numpy()).all()


def test_kl_at_last_ulp_differences_is_never_negative():
    """fp32 logits a few ulps apart (what fp32 replays show): the plain sum loses its sign in the rounding of the
    log-partition functions, the identity does not."""
    torch.manual_seed(2)
    a = torch.randn(200, 64) * 6
    b = a + (torch.randint(-2, 3, a.shape) * a.abs() * 2 ** -23).float()
    m = step_measures(a, b)
    differs = ~m["logits_equal"]
    assert differs.sum() > 100
    assert (m["kl_forward"][differs] > 0).all() and (m["kl_reverse"][differs] > 0).all()


# --- the stage on the shipped toy ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """The matched experiment (bf16, one item per batch) on three items of the default selection that split between
    live and prefill on this machine and one that does not, as reconstruct_prefixes writes it."""
    divergent, agreeing = toy_items(N_NEW, want=3)
    folder = tmp_path_factory.mktemp("fidelity")
    items = select_items({"source": "synthetic", "size": 5000, "seed": 0}, 200, 0, str(folder / "all.parquet"))
    chosen = folder / "items.parquet"
    write_parquet(items[items["item_index"].isin([*divergent, agreeing])], chosen, {"stage": "test"})
    ledger = folder / "ledger.parquet"
    common = dict(model=str(REPO / "data/toy"), revision="primary", precision="bf16", boundary=DEFAULT_BOUNDARY,
                  max_stage_tokens=32, max_new_tokens=N_NEW, device="cpu", attn_implementation="sdpa",
                  progress=False)
    reconstruct_prefixes(str(chosen), str(ledger), str(folder / "prefixes.parquet"), str(folder / "bridge.parquet"),
                         ReconstructSettings(**common, bridge={"n_rows": 0, "seed": 0}))
    return {"folder": folder, "items": str(chosen), "ledger": str(ledger), "common": common,
            "divergent": divergent, "agreeing": agreeing}


def fidelity_of(toy_run, name, ledger=None, **settings):
    out = toy_run["folder"] / f"{name}.parquet"
    s = FidelitySettings(**toy_run["common"], **settings)
    measure_fidelity(toy_run["items"], ledger or toy_run["ledger"], str(out), s)
    return read_parquet(out), read_provenance(out)


@pytest.fixture(scope="module")
def toy_fidelity(toy_run):
    return fidelity_of(toy_run, "fidelity", constructions=("incremental", "prefill", "chunked"))


def test_the_table_has_the_contract_columns(toy_fidelity):
    table, prov = toy_fidelity
    assert list(table.columns) == FIDELITY_SCHEMA.names
    assert set(CONTRACT) <= set(table.columns)
    assert set(table["reference"]) == {"live"} and set(table["construction"]) == {"incremental", "prefill", "chunked"}
    assert table["kl_forward"].dtype == np.float64 and table["logits_equal"].dtype == bool
    assert prov["stage"] == "measure_fidelity" and prov["fidelity"]["constructions"] == ["incremental", "prefill",
                                                                                          "chunked"]
    assert prov["dtype"] == "bfloat16" and prov["numerics"]["deterministic_algorithms"] is True


def test_a_byte_identical_pair_gives_exact_zeros_on_every_step(toy_fidelity):
    """incremental is live's own schedule (the bridge): every step's logits must be the same bytes."""
    table, _ = toy_fidelity
    same = table[table["construction"] == "incremental"]
    assert len(same) >= 4 * 10
    assert same["logits_equal"].all() and same["cache_equal"].all()
    for column in ("kl_forward", "kl_reverse", "kl_sym", "max_abs_logit_diff"):
        assert (same[column] == 0.0).all(), column
        assert not np.signbit(same[column]).any(), column
    assert not same["argmax_differs"].any()
    assert (same["margin_reference"] == same["margin_construction"]).all()


def test_a_pair_that_differs_has_nonzero_kl(toy_fidelity):
    table, _ = toy_fidelity
    prefill = table[table["construction"] == "prefill"]
    assert (prefill["kl_forward"] > 0).any() and not prefill["logits_equal"].all()
    assert ((prefill["kl_forward"] > 0) == ~prefill["logits_equal"]).all()  # zero exactly where the bytes are equal
    assert (prefill["kl_forward"] >= 0).all() and (prefill["kl_reverse"] >= 0).all()


def test_the_first_argmax_difference_is_the_ledgers_first_divergence(toy_run, toy_fidelity):
    table, _ = toy_fidelity
    ledger = read_parquet(toy_run["ledger"])
    rows = ledger[(ledger["experiment"] == "matched") & (ledger["replica"] == 1)].set_index(
        ["item_index", "construction"])
    items = item_summary(table).set_index(["construction", "item_index"])
    seen_split = 0
    for index in [*toy_run["divergent"], toy_run["agreeing"]]:
        live, prefill = rows.loc[(index, "live")], rows.loc[(index, "prefill")]
        expected = first_divergence(live["suffix_ids"], prefill["suffix_ids"])
        got = items.loc[("prefill", index), "first_divergence"]
        assert (None if pd.isna(got) else int(got)) == expected, index
        seen_split += expected is not None
        steps = table[(table["item_index"] == index) & (table["construction"] == "prefill")].sort_values("step")
        # the forced suffix is live's, step for step, and live's margins are the ledger's as float32 bytes
        assert list(steps["token_id"]) == [int(t) for t in live["suffix_ids"]]
        assert steps["margin_reference"].to_numpy(np.float32).tobytes() == \
            np.asarray(live["margins"], np.float32).tobytes()
    assert seen_split == len(toy_run["divergent"])  # the check saw real splits, not only agreeing suffixes


def test_a_sample_of_items_and_a_refused_reference(toy_run):
    table, prov = fidelity_of(toy_run, "sample", constructions=("prefill",), items=2, items_seed=3)
    assert table["item_index"].nunique() == 2 and prov["fidelity"]["n_items"] == 2
    assert fidelity_items(range(10), "2", 3) == fidelity_items(range(10), 2, 3)
    with pytest.raises(ValueError, match="fidelity.items is 0"):
        fidelity_items(range(10), 0, 0)
    # a ledger whose live prefix is not what the model regenerates is refused, naming the item and the fix
    ledger = read_parquet(toy_run["ledger"])
    index = toy_run["agreeing"]
    at = ledger.index[(ledger["item_index"] == index) & (ledger["construction"] == "live") & (ledger["replica"] == 1)]
    ledger.at[at[0], "stage_ids"] = list(ledger.at[at[0], "stage_ids"])[:-1] + [5]
    tampered = toy_run["folder"] / "tampered.parquet"
    write_parquet(ledger, tampered, read_provenance(toy_run["ledger"]), LEDGER_SCHEMA)
    item_id = ledger.at[at[0], "item_id"]
    with pytest.raises(ReferenceMismatchError, match=rf"item '{item_id}'.*other than the recorded prefix.*rerun "
                                                     "reconstruct_prefixes"):
        fidelity_of(toy_run, "refused", ledger=str(tampered), constructions=("prefill",))


# --- statistics on hand-made data ---------------------------------------------------------------------------------

def test_rank_separation_known_answers():
    perfect = separation.rank_separation([3, 4, 5], [1, 2], n_boot=500)
    assert perfect["auc"] == 1.0 and perfect["complete_separation"] is True
    assert perfect["bootstrap_low"] == perfect["bootstrap_high"] == 1.0
    mixed = separation.rank_separation([1, 3], [2, 4], n_boot=2000, seed=1)
    assert mixed["auc"] == 0.25 and mixed["u"] == 1.0 and mixed["complete_separation"] is False
    assert mixed["bootstrap_low"] <= 0.25 <= mixed["bootstrap_high"]
    assert separation.rank_separation([1, 3], [2, 4], n_boot=2000, seed=1) == mixed  # seeded
    assert separation.rank_separation([1.0], [1.0], n_boot=10)["auc"] == 0.5  # a tie counts half
    ties = separation.rank_separation([2, 2, 3], [1, 2], n_boot=10)
    assert ties["auc"] == pytest.approx((1 + 0.5 + 1 + 0.5 + 1 + 1) / 6, abs=0)
    empty = separation.rank_separation([], [1, 2, float("nan")], n_boot=10)
    assert empty["auc"] is None and "no positive item" in empty["skipped"] and empty["n_missing"] == 1
    assert "no unsplit item" in separation.rank_separation([1], [], names=("split", "unsplit"))["skipped"]


def test_share_by_position_known_answers():
    curve = stats.share_by_position([0, 2, None, None], 4, 3)
    assert curve["positions"] == [1, 2, 3] and curve["split"] == [1, 1, 2] and curve["rate"] == [0.25, 0.25, 0.5]
    assert curve["wilson_low"][2] == stats.proportion(2, 4)["wilson_low"]
    assert stats.share_by_position([], 5, 2)["split"] == [0, 0]
    with pytest.raises(ValueError):
        stats.share_by_position([0, 1, 2], 2, 3)


# --- split predictors that cannot see the split ---------------------------------------------------------------

def steps_of(items: list[dict]) -> pd.DataFrame:
    """Per-step fidelity rows of bf16 live vs prefill from ``items``: {"steps", "split_at", "diff", "margin"}
    (the per-step logit difference and live margin, lists of per-step values)."""
    rows = []
    for index, item in enumerate(items):
        for step in range(item["steps"]):
            rows.append({"item_index": index, "item_id": f"i{index}", "revision": "primary", "precision": "bf16",
                         "reference": "live", "construction": "prefill", "step": step, "token_id": 3,
                         "kl_forward": 1e-3, "kl_reverse": 1e-3, "kl_sym": 1e-3,
                         "max_abs_logit_diff": item["diff"][step], "margin_reference": item["margin"][step],
                         "margin_construction": item["margin"][step],
                         "argmax_differs": item["split_at"] is not None and step >= item["split_at"],
                         "logits_equal": False, "cache_equal": False})
    return pd.DataFrame(rows)


def test_a_predictor_does_not_see_the_split_step():
    """Every item reads out the same at every step but its split step, where the logit difference is large and
    the margin small (as a split makes them): a score over the whole suffix would separate perfectly; the scores
    known before the split do not separate at all."""
    items = []
    for index in range(8):
        split_at = 3 if index < 3 else None
        diff, margin = [0.1] * 6, [1.0] * 6
        if split_at is not None:
            diff[split_at], margin[split_at] = 9.0, 0.001
        items.append({"steps": 6, "split_at": split_at, "diff": diff, "margin": margin})
    block = pair_numbers_of(steps_of(items))["split_predictors"]
    assert block["cases"] == 3 and block["controls"] == 5
    for name in ("logit_diff_boundary", "margin_boundary", "logit_diff_step_before", "margin_step_before"):
        assert block[name]["auc"] == 0.5, name


def test_the_step_before_the_split_is_read_at_the_same_step_for_both_classes():
    """Split items' margin narrows at the step just before their split; unsplit items' margin is as narrow at
    another step only. Read at the same step the narrowing separates; at the boundary nothing does."""
    items = []
    for index in range(8):
        split_at = 4 if index < 3 else None
        margin = [1.0] * 7
        margin[3 if split_at else 5] = 0.01  # unsplit items narrow too, but at step 5
        items.append({"steps": 7, "split_at": split_at, "diff": [0.1] * 7, "margin": margin})
    block = pair_numbers_of(steps_of(items))["split_predictors"]
    assert block["margin_step_before"]["auc"] == 1.0 and block["margin_step_before"]["pairs"] == 15
    assert block["margin_boundary"]["auc"] == 0.5


def test_suffix_length_is_held_even_and_step_zero_splits_are_left_out():
    """An unsplit item whose suffix ended before a split item's first divergence is not compared with it (it was
    never at risk that long), whatever its score; an item split at step 0 is counted apart, never scored."""
    items = [{"steps": 8, "split_at": 5, "diff": [0.5] * 8, "margin": [1.0] * 8},  # splits at 5
             {"steps": 8, "split_at": None, "diff": [0.1] * 8, "margin": [2.0] * 8},  # at risk through 5
             {"steps": 3, "split_at": None, "diff": [0.9] * 3, "margin": [0.2] * 3},  # ended at step 2
             {"steps": 8, "split_at": 0, "diff": [5.0] * 8, "margin": [0.0] * 8}]  # split at the boundary step
    block = pair_numbers_of(steps_of(items))["split_predictors"]
    assert block["split_at_boundary_step"] == 1 and block["cases"] == 1 and block["controls"] == 2
    for name in ("logit_diff_boundary", "margin_boundary", "logit_diff_step_before", "margin_step_before"):
        assert block[name]["pairs"] == 1 and block[name]["auc"] == 1.0, name  # the short item would make it 0.5


def pair_numbers_of(frame: pd.DataFrame) -> dict:
    _, numbers = section_of(frame)
    return numbers["bf16"]["live_vs_prefill"]


def test_constructions_that_read_out_alike_are_shown_once():
    frame = hand_made(equal_b=False)
    twin = frame[frame["construction"] == "prefill"].assign(construction="chunked")
    text, numbers = section_of(pd.concat([frame, twin], ignore_index=True))
    assert "| fp32 | chunked = prefill |" in text and "| fp32 | prefill |" not in text
    assert "`chunked` and `prefill` read out the same" in text
    assert numbers["fp32"]["live_vs_prefill"]["same_readouts_as"] == ["chunked"]
    assert numbers["fp32"]["live_vs_prefix_cached"]["same_readouts_as"] == []


# --- the report's wording ---------------------------------------------------------------------------------------

def hand_made(equal_b: bool) -> pd.DataFrame:
    rows = []
    for construction, equal in (("prefix_cached", True), ("prefill", equal_b)):
        for item in range(3):
            for step in range(4):
                differs = not equal and step == 2
                rows.append({"item_index": item, "item_id": f"i{item}", "revision": "primary", "precision": "fp32",
                             "reference": "live", "construction": construction, "step": step, "token_id": 3,
                             "kl_forward": 1e-14 if differs else 0.0, "kl_reverse": 1e-14 if differs else 0.0,
                             "kl_sym": 1e-14 if differs else 0.0, "max_abs_logit_diff": 2e-6 if differs else 0.0,
                             "margin_reference": 0.5 + item, "margin_construction": 0.5 + item,
                             "argmax_differs": differs and item == 0, "logits_equal": not differs,
                             "cache_equal": equal})
    return pd.DataFrame(rows)


def section_of(frame):
    data = RevisionData("primary", {}, 0)
    data._frames["fidelity"] = frame
    lines, numbers = fidelity_section(data)
    return "\n".join(lines), numbers


def test_the_report_says_bit_identical_only_where_every_logit_vector_is_byte_equal():
    text, numbers = section_of(hand_made(equal_b=False))
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| fp32 | ")
            and line.count("|") == 8}
    assert "bit-identical" in rows["prefix_cached"]
    assert "bit-identical" not in rows["prefill"] and "KL median 0" not in rows["prefill"]
    assert "1e-14" in rows["prefill"]  # fp32's fidelity as a number
    block = numbers["fp32"]["live_vs_prefill"]
    assert block["bit_identical"] is False and block["steps_logits_equal"]["k"] == 9
    assert block["kl_forward_max"] == 1e-14 and block["items_split"]["k"] == 1
    assert numbers["fp32"]["live_vs_prefix_cached"]["bit_identical"] is True
    assert block["split_by_position"]["split"][:4] == [0, 0, 1, 1]
    assert block["split_predictors"]["margin_boundary"]["auc"] == 1.0  # the split item has the smallest margin
    # nothing byte-equal throughout: the word does not appear at all
    nothing = hand_made(equal_b=False)
    nothing = nothing[nothing["construction"] == "prefill"]
    text, _ = section_of(nothing)
    assert "bit-identical" not in text and "no construction matches live bit for bit" in text
    json.dumps(numbers, allow_nan=False)


# --- inside the workflow --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_workflow_measures_fidelity_and_reports_it(shared_tiny_run):
    res = shared_tiny_run / "results/tiny"
    table = pd.read_parquet(res / "primary/fidelity.parquet")
    ledger = pd.read_parquet(res / "primary/ledger.parquet")
    assert list(table.columns) == FIDELITY_SCHEMA.names
    assert set(table["precision"]) == {"bf16", "fp32"}
    assert set(table["construction"]) == {"prefill", "chunked", "prefix_cached"}
    live = ledger[(ledger["experiment"] == "matched") & (ledger["construction"] == "live") & (ledger["replica"] == 1)
                  & (ledger["status"] == "ok")]
    for row in live.to_dict("records"):
        steps = table[(table["item_index"] == row["item_index"]) & (table["precision"] == row["precision"])
                      & (table["construction"] == "prefill")].sort_values("step")
        assert list(steps["token_id"]) == [int(t) for t in row["suffix_ids"]]
        assert (steps["layout_position"] == row["layout_position"]).all()
    parts = read_provenance(res / "primary/fidelity.parquet")["parts"]
    assert {p["dtype"] for p in parts} == {"bfloat16", "float32"}
    report = (res / "report/report.md").read_text()
    assert "### Fidelity along the suffix (beyond the study)" in report and "**Which replay method matches live**" in report
    numbers = json.loads((res / "report/stats.json").read_text())["revisions"]["primary"]["fidelity"]
    assert set(numbers) == {"bf16", "fp32"} and "live_vs_prefix_cached" in numbers["fp32"]
    for name in ("fig9_fidelity", "fig10_split_predictors"):
        assert (res / f"report/figures/{name}.pdf").read_bytes().startswith(b"%PDF-")
        assert f"![{name}](figures/{name}.png)" in report


def test_rows_in_lockstep_compare_in_one_layout():
    """A static batch of three left-padded rows: live generates in lockstep, each construction's cache is swapped in
    at each row's boundary and forced through live's suffix; incremental (the schedule's own cache) is byte-equal
    at every step, and every row keeps its padding and position on both sides."""
    from stagereplay.data.prompts import Prompter
    from stagereplay.data.toy import synthetic_items
    from stagereplay.decode.greedy import matcher_from_config
    from stagereplay.decode.plans import Batch
    from stagereplay.decode.regimes import make_decoder
    from stagereplay.experiments.fidelity import fidelity_batch
    from stagereplay.experiments.matched import matched
    from stagereplay.experiments.rows import RunSettings
    from stagereplay.models.loading import eos_token_ids, load_model, set_determinism
    from stagereplay.models.sources import ModelSource

    set_determinism(1)
    loaded = load_model(ModelSource("local", str(REPO / "data/toy/primary")), "bf16", "cpu")
    decoder = make_decoder(loaded.model, tuple(eos_token_ids(loaded)), "static", max_len=64 + 32 + 12, max_rows=3)
    prompter, matcher = Prompter(loaded.tokenizer), matcher_from_config({"marker": ";", "occurrence": 1},
                                                                        loaded.tokenizer)
    settings = RunSettings("primary", "bf16", 32, 12, decode_regime="static")
    items = [{"item_index": i, "item_id": t.item_id, "question": t.question, "gold_answer": t.gold_answer}
             for i, t in enumerate(synthetic_items(3, 0))]
    batch = Batch(0, tuple(items))
    prompts = [prompter(item["question"]) for item in items]
    ledger = matched(decoder, batch, prompts, settings, loaded.tokenizer, matcher, replicas=(1,)).rows
    recorded = {r["item_index"]: r for r in ledger if r["construction"] == "live"}
    caches = {(r["item_index"], "prefill"): r["cache_fingerprint"] for r in ledger if r["construction"] == "prefill"}
    rows = pd.DataFrame(fidelity_batch(decoder, batch, prompts, settings, matcher, ("incremental", "prefill"),
                                       recorded=recorded, recorded_caches=caches))
    assert set(rows["item_index"]) == {0, 1, 2} and set(rows["batch_rows"]) == {3}
    for index, row in recorded.items():  # each row in the matched experiment's layout, its left padding included
        mine = rows[rows["item_index"] == index]
        assert set(zip(mine["layout_pad"], mine["layout_position"])) == {(row["layout_pad"], row["layout_position"])}
    assert rows["layout_pad"].max() > 0  # some row is padded: the layouts differ by row
    same = rows[rows["construction"] == "incremental"]
    assert same["logits_equal"].all() and (same["kl_forward"] == 0.0).all()
    prefill = rows[rows["construction"] == "prefill"]
    for index, row in recorded.items():
        other = next(r for r in ledger if r["item_index"] == index and r["construction"] == "prefill")
        got = item_summary(prefill[prefill["item_index"] == index])["first_divergence"].iloc[0]
        assert (None if pd.isna(got) else int(got)) == first_divergence(row["suffix_ids"], other["suffix_ids"])
