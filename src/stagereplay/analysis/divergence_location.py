"""Where the divergence lives (beyond the study): the minimal sufficient transplants (figure 7) and the onset of
the difference between the two constructions' boundary caches (figure 8), as tidy tables and report sections.

Units: the minimal transplant has one row per divergent item and direction; its proportions are given per
direction, over items, so no item counts twice in one interval. The onset has one value per divergent item and
precision. Items are chosen by divergence, so neither says how often caches differ (figure 4's seeded sample does).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from stagereplay.analysis import stats
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.report_format import format_ids, format_proportion, table_head, table_row
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.analysis.row_keys import check_unique

VERDICT_NOT_SEPARABLE = "not separable from its placebo"  # stages.minimal_transplant.VERDICTS[1]

GUARANTEE = ("The search is a greedy bisection (K alone, then V alone; the lower, then the upper half of the layer "
             "band; the same for the span of cache positions; in passes until none narrows), within a budget of "
             "transplant runs per item and direction. The set it returns was run and carried the donor's "
             "continuation; where the budget did not run out, none of its halves (along layers or positions) and "
             "neither K nor V alone carries it. That is minimal against halving, not a global minimum: another "
             "part, a union of pieces or a part that is no half of a half may be smaller and suffice.")


PLACEBO_RULE = ("Every box the search tries also runs its placebo in the same batch layout: the donor-minus-recipient "
                "difference over the box, its positions shifted cyclically by half the box's span (a one-position "
                "span: negated), written onto the recipient. A box counts as sufficient only where the donor's bytes "
                "carry the donor's continuation and its placebo does not; where the whole cache's placebo carries it "
                "too, the item is *not separable from its placebo*: any push of that size tips it, so no part of the "
                "cache can be said to carry the divergence.")


def _rows(frame: pd.DataFrame | None) -> pd.DataFrame:
    return frame if frame is not None else pd.DataFrame()


def localised(frame: pd.DataFrame) -> pd.Series:
    """Rows whose search returned a box that carried the donor's continuation beyond its placebo (files written
    before the placebo control: every row whose whole cache sufficed)."""
    if "verdict" in frame.columns:
        return frame["verdict"] == "localised"
    return frame["full_sufficient"].astype(bool)


def minimal_coverage(minimal: pd.DataFrame | None) -> pd.DataFrame:
    """Per (revision, precision, component k/v, layer, offset): how many minimal sets (rows with one found) include
    that part of the cache, among the rows whose cache has a position at that offset. ``offset`` is the cache
    position minus the prompt's length: negative in the prompt, 0 at the first stage token."""
    cols = ["revision", "precision", "component", "layer", "offset", "n", "included", "share"]
    frame = _rows(minimal)
    if frame.empty or not localised(frame).any():
        return pd.DataFrame(columns=cols)
    check_unique(frame, "minimal_transplant")
    found = frame[localised(frame)]
    counts: dict[tuple, list[int]] = {}
    for r in found.itertuples(index=False):
        for component in ("k", "v"):
            in_component = r.component in ("kv", component)
            for layer in range(int(r.num_layers)):
                for position in range(int(r.cache_length)):
                    key = (r.revision, r.precision, component, layer, position - int(r.prompt_length))
                    cell = counts.setdefault(key, [0, 0])
                    cell[0] += 1
                    cell[1] += int(in_component and r.layer_lo <= layer < r.layer_hi
                                   and r.position_lo <= position < r.position_hi)
    rows = [(*key, n, k, k / n) for key, (n, k) in sorted(counts.items())]
    return pd.DataFrame(rows, columns=cols)


def onset_items(onset: pd.DataFrame | None) -> pd.DataFrame:
    """One row per (revision, precision, item) of the onset table: its onset, the margins at the first divergence
    and the difference at the last layer (the larger of K's and V's), and at the onset layer."""
    cols = ["revision", "precision", "item_index", "item_id", "onset_layer", "onset_position", "prompt_length",
            "n_positions", "onset_in_prompt", "first_divergence", "margin_a", "margin_b", "last_layer",
            "last_max_abs", "last_rms", "onset_rms"]
    frame = _rows(onset)
    if frame.empty:
        return pd.DataFrame(columns=cols)
    check_unique(frame, "divergence_onset")
    rows = []
    for (revision, precision, item_index), g in frame.groupby(["revision", "precision", "item_index"], sort=True):
        first = g.iloc[0]
        last_layer = int(g["layer"].max())
        last = g[g["layer"] == last_layer]
        layer = None if pd.isna(first["onset_layer"]) else int(first["onset_layer"])
        position = None if pd.isna(first["onset_position"]) else int(first["onset_position"])
        rows.append({"revision": revision, "precision": precision, "item_index": int(item_index),
                     "item_id": first["item_id"], "onset_layer": layer, "onset_position": position,
                     "prompt_length": int(first["prompt_length"]), "n_positions": int(first["n_positions"]),
                     "onset_in_prompt": None if position is None else position < int(first["prompt_length"]),
                     "first_divergence": None if pd.isna(first["first_divergence"]) else int(first["first_divergence"]),
                     "margin_a": None if pd.isna(first["margin_a"]) else float(first["margin_a"]),
                     "margin_b": None if pd.isna(first["margin_b"]) else float(first["margin_b"]),
                     "last_layer": last_layer, "last_max_abs": float(last["max_abs"].max()),
                     "last_rms": float(last["rms"].max()),
                     "onset_rms": None if layer is None else float(g.loc[g["layer"] == layer, "rms"].max())})
    return pd.DataFrame(rows, columns=cols)


def identical_layers(onset: pd.DataFrame | None) -> dict[str, list[int]]:
    """Per precision, the layers whose K and V are bit-identical between the two constructions in every divergent
    item of the onset table."""
    if onset is None or onset.empty:
        return {}
    differs = onset.groupby(["precision", "layer"])["bit_equal"].agg(lambda equal: bool(equal.astype(bool).all()))
    return {str(p): [int(layer) for (q, layer), all_equal in differs.items() if q == p and all_equal]
            for p in onset["precision"].unique()}


def _share(frame: pd.DataFrame, mask) -> dict:
    return stats.proportion(int(np.asarray(mask, dtype=bool).sum()), len(frame))


def _quartiles(values) -> str:
    values = [float(v) for v in values if v is not None and not pd.isna(v)]
    if not values:
        return "—"
    q1, median, q3 = np.quantile(values, [0.25, 0.5, 0.75])
    return f"{median:.3g} [{q1:.3g}, {q3:.3g}]"


def minimal_transplant_section(data: RevisionData) -> tuple[list[str], dict]:
    """The distribution over items of the minimal sufficient transplants (figure 7)."""
    frame = data.frame("minimal_transplant")
    check_unique(frame, "minimal_transplant")
    search = data.job_record("minimal_transplant").get("config") or {}
    budget = search.get("budget")
    if budget == 0:
        return ["_Not searched: `transplant.minimal.budget` is 0._", ""], {"status": "off", "budget": 0}
    if frame.empty:
        return ["_No divergent item among the transplant selection: nothing to search._", ""], {
            "status": "no divergent item", "budget": budget}
    controlled = "verdict" in frame.columns
    lines = [GUARANTEE, "", *([PLACEBO_RULE, ""] if controlled else []),
             f"Budget: {budget} transplant runs per item and direction (each with its placebo), the whole-cache one "
             "included. Proportions are per direction, over divergent items (Wilson 95%).", "",
             *table_head("precision", "direction", "items", "whole cache suffices", "its placebo too (not separable)",
                         "localised beyond placebo", "budget ran out",
                         "minimal against halving", "K or V alone", "one layer", "stage positions only",
                         "prompt positions only", "share of the K/V state, median [IQR]", "runs, median [IQR]")]
    out: dict = {"status": "searched", "budget": budget, "guarantee": GUARANTEE, "cells": {}}
    for (precision, direction), g in frame.groupby(["precision", "direction"], sort=True):
        found = g[localised(g)]
        cell = _minimal_cell(g, found, controlled)
        out["cells"].setdefault(precision, {})[direction] = cell
        lines.append(table_row(precision, direction, len(g), format_proportion(cell["whole_cache_sufficient"]),
                               format_proportion(cell["not_separable"]) if controlled else "not run",
                               format_proportion(cell["localised"]),
                               f"{cell['budget_exhausted']['k']} / {len(g)}",
                               format_proportion(cell["locally_minimal"]),
                               format_proportion(cell["k_or_v_alone"]), format_proportion(cell["single_layer"]),
                               format_proportion(cell["stage_positions_only"]),
                               format_proportion(cell["prompt_positions_only"]), _quartiles(found["share_of_state"]),
                               _quartiles(g["runs"])))
    same = identical_layers(data.frame("divergence_onset")) if data.has("divergence_onset") else {}
    out["layers_bit_identical_in_every_divergent_item"] = same
    lines += _layer_lines(out["cells"], same)
    lines += _unlocalised_lines(frame, out, controlled)
    return lines + _minimal_sets_table(frame) + [""], out


def _minimal_cell(g: pd.DataFrame, found: pd.DataFrame, controlled: bool) -> dict:
    """One precision and direction's proportions (over its items ``g``; ``found``: those localised) and quartiles."""
    inseparable = (g["verdict"] == VERDICT_NOT_SEPARABLE) if controlled else pd.Series(False, index=g.index)
    prompt = found["prompt_length"].astype(int)
    stage_only = found["position_lo"].astype(int) >= prompt
    prompt_only = found["position_hi"].astype(int) <= prompt
    cell = {
        "n": len(g), "whole_cache_sufficient": _share(g, g["full_sufficient"]),
        "not_separable": _share(g, inseparable) if controlled else None,
        "localised": _share(g, localised(g)),
        "budget_exhausted": _share(g, g["budget_exhausted"]),
        "locally_minimal": _share(found, found["locally_minimal"]),
        "k_or_v_alone": _share(found, found["component"] != "kv"),
        "components": {c: int((found["component"] == c).sum()) for c in ("kv", "k", "v")},
        "single_layer": _share(found, (found["layer_hi"].astype(int) - found["layer_lo"].astype(int)) == 1),
        "stage_positions_only": _share(found, stage_only),
        "prompt_positions_only": _share(found, prompt_only),
        "share_of_state": stats.first_divergence_summary(list(found["share_of_state"])),
        "runs": stats.first_divergence_summary([int(x) for x in g["runs"]]),
        "layer_included": {},
    }
    cell["share_of_state"]["method"] = cell["runs"]["method"] = "order statistics (numpy linear quantiles)"
    if len(found):
        num_layers = int(found["num_layers"].max())
        for layer in range(num_layers):
            inside = (found["layer_lo"].astype(int) <= layer) & (layer < found["layer_hi"].astype(int))
            cell["layer_included"][str(layer)] = _share(found, inside)
    return cell


def _layer_lines(cells: dict, same: dict[str, list[int]]) -> list[str]:
    """How many minimal sets include each layer, per precision and direction; layers bit-identical in every
    divergent item (``same``) marked."""
    layer_lines = []
    for precision, by_direction in cells.items():
        for direction, cell in by_direction.items():
            if cell["layer_included"]:
                shares = ", ".join(f"layer {layer}{'*' if int(layer) in same.get(precision, []) else ''}: "
                                   f"{p['k']}/{p['n']}" for layer, p in cell["layer_included"].items())
                layer_lines.append(f"- {precision} {direction}: {shares}")
    if not layer_lines:
        return []
    lines = ["", "Minimal sets that include each layer (figure 7 adds the positions):", "", *layer_lines]
    marked = {p: layers for p, layers in same.items() if layers and p in cells}
    if marked:
        where = "; ".join(f"{p}: layer(s) {', '.join(map(str, v))}" for p, v in marked.items())
        lines += ["", "\\* Bit-identical in both constructions' caches of every divergent item "
                  f"(divergence_onset.parquet): {where}. "
                  "A minimal set includes such a layer only because its band of layers reaches it: the "
                  "transplant changes nothing there."]
    return lines


def _unlocalised_lines(frame: pd.DataFrame, out: dict, controlled: bool) -> list[str]:
    """The items whose whole-cache transplant did not carry the donor's continuation, and those not separable from
    their placebo (recorded in ``out``)."""
    lines = []
    missed = frame[~frame["full_sufficient"].astype(bool)]
    out["whole_cache_insufficient"] = [f"{r.item_id} {r.direction}" for r in missed.itertuples(index=False)]
    if len(missed):
        lines += ["", "**Finding:** the whole-cache transplant did not carry the donor's continuation (no search "
                  f"possible; a fault of the construction or layout): {format_ids(out['whole_cache_insufficient'])}."]
    if controlled:
        tied = frame[frame["verdict"] == VERDICT_NOT_SEPARABLE]
        out["not_separable"] = [f"{r.item_id} {r.direction}" for r in tied.itertuples(index=False)]
        if len(tied):
            lines += ["", "Not separable from its placebo (the whole cache's placebo carried the donor's continuation "
                      f"too, so the search could not tell): {format_ids(out['not_separable'])}."]
    else:
        lines += ["", "_This file predates the placebo control: its boxes are sufficient, not shown to carry more "
                  "than any push of their size._"]
    return lines


def _minimal_sets_table(frame: pd.DataFrame) -> list[str]:
    """The first 40 minimal sets found, one per item and direction."""
    found = frame[localised(frame)].sort_values(["precision", "item_index", "direction"])
    lines = ["", *table_head("item", "precision", "direction", "minimal set",
                             "positions (cache; prompt / stage share)", "runs")]
    for r in found.head(40).itertuples(index=False):
        stage = "—" if pd.isna(r.share_of_stage) else f"{100 * r.share_of_stage:.0f}%"
        prompt = "—" if pd.isna(r.share_of_prompt) else f"{100 * r.share_of_prompt:.0f}%"
        lines.append(table_row(f"`{r.item_id}`", r.precision, r.direction,
                               f"layers {r.layer_set} · {r.component.upper()}",
                               f"[{int(r.position_lo)}, {int(r.position_hi)}) of {r.cache_length}; {prompt} / {stage}",
                               f"{r.runs}{' (budget ran out)' if r.budget_exhausted else ''}"))
    if len(found) > 40:
        lines.append(table_row(f"... {len(found) - 40} more in minimal_transplant.parquet", "", "", "", "", ""))
    return lines


def divergence_onset_section(data: RevisionData) -> tuple[list[str], dict]:
    """Where the two constructions' caches of the divergent items first differ, how the difference grows with
    depth, and how it relates to the margin at the first divergent token (figure 8)."""
    frame = data.frame("divergence_onset")
    items = onset_items(frame)
    if items.empty:
        return ["_No divergent item of the transplant pair: no onset to measure._", ""], {"n": 0}
    profile = analysis.cache_difference_profile(frame)
    lines = ["Both transplant constructions' boundary caches of every divergent item, compared layer by layer (K "
             "and V bytes; max-abs and RMS of the difference in fp64). The onset is the first layer whose K or V "
             "differs and the first differing position in it. Items are chosen by divergence: this describes "
             "divergent items, not how often caches differ (figure 4). Last-layer differences take the larger of "
             "K and V; margins are the first construction's top-2 margin at the first divergent suffix token.", "",
             *table_head("precision", "items", "caches bit-identical", "onset layer (items per layer)",
                         "onset in the prompt", "onset position, median [IQR]", "RMS grows from onset to last layer",
                         "margin at divergence vs last-layer max-abs: Spearman rho (bootstrap 95%)")]
    out: dict = {}
    for precision, g in items.groupby("precision", sort=True):
        differs = g[g["onset_layer"].notna()]
        layers = differs["onset_layer"].astype(int)
        grows = differs["last_rms"].astype(float) > differs["onset_rms"].astype(float)
        corr = stats.rank_correlation(list(g["margin_a"]), list(g["last_max_abs"]), seed=data.seed)
        cell = {
            "n": len(g), "bit_identical": int(g["onset_layer"].isna().sum()),
            "onset_layer_counts": {str(k): int(v) for k, v in layers.value_counts().sort_index().items()},
            "onset_at_layer_0": _share(differs, layers == 0),
            "onset_in_prompt": _share(differs, differs["onset_in_prompt"].astype(bool)),
            "onset_position": stats.first_divergence_summary([int(x) for x in differs["onset_position"]]),
            "rms_grows_to_last_layer": _share(differs, grows),
            "margin_vs_last_layer_max_abs": corr,
            "per_layer": {},
        }
        cell["onset_position"]["method"] = "order statistics (numpy linear quantiles)"
        for (component, layer), p in profile[profile["precision"] == precision].groupby(["component", "layer"]):
            sub = frame[(frame["precision"] == precision) & (frame["component"] == component)
                        & (frame["layer"] == layer)]
            cell["per_layer"].setdefault(component, []).append({
                "layer": int(layer), "n": int(p["n"].iloc[0]), "n_differ": int(p["n_differ"].iloc[0]),
                "max_abs_median": float(sub["max_abs"].median()), "rms_median": float(sub["rms"].median()),
                "max_abs_max": float(sub["max_abs"].max())})
        out[precision] = cell
        counts = ", ".join(f"L{k}: {v}" for k, v in cell["onset_layer_counts"].items()) or "—"
        rho = ("—" if corr["rho"] is None else
               f"{corr['rho']:+.2f} ({corr['bootstrap_low']:+.2f}, {corr['bootstrap_high']:+.2f}), n={corr['n']}")
        lines.append(table_row(precision, len(g), cell["bit_identical"], counts,
                               format_proportion(cell["onset_in_prompt"]), _quartiles(differs["onset_position"]),
                               format_proportion(cell["rms_grows_to_last_layer"]), rho))
    lines += ["", "Growth with depth: per layer, the median over divergent items (bit-identical layers count as 0) of "
              "the max-abs and RMS difference.", "",
              *table_head("precision", "layer", "items whose K / V differ", "median max-abs K / V",
                          "median RMS K / V")]
    for precision, cell in out.items():
        k_rows, v_rows = cell["per_layer"].get("k", []), cell["per_layer"].get("v", [])
        for k, v in zip(k_rows, v_rows):
            lines.append(table_row(precision, k["layer"], f"{k['n_differ']} / {v['n_differ']} of {k['n']}",
                                   f"{k['max_abs_median']:.3g} / {v['max_abs_median']:.3g}",
                                   f"{k['rms_median']:.3g} / {v['rms_median']:.3g}"))
    return lines + [""], out
