"""The report's sections on fidelity along the suffix (``fidelity.parquet``, rule ``measure_fidelity``): which
replay construction matches live, how far each one's next-token distributions lie from live's at every suffix
step, and what a split is associated with at the boundary (figures 9 and 10).

Steps are the table's rows; items are the unit of every interval that needs independent trials (an item's steps
are not independent of each other). The step-level share of byte-equal logits is given with its Wilson interval
as asked of it, beside the item-level share whose interval holds. "bit-identical" is written only where every
logit vector of a cell is equal byte for byte; elsewhere the KL divergence is given as a number.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from stagereplay.analysis import separation, stats
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.report_format import format_proportion, join_words, table_head, table_row
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.analysis.row_keys import check_unique
from stagereplay.io.parquet import read_parquet, read_provenance

KL = "kl_forward"
KL_TEXT = "KL(P_live || P_construction) per suffix step, nats, float64 from the fp32 logits"
ITEM_KEYS = ["revision", "precision", "reference", "construction", "item_index"]
CLASSES = ("split", "unsplit")  # the two classes a boundary score is compared across


def pair_name(reference: str, construction: str) -> str:
    return f"{reference}_vs_{construction}"


def item_summary(table: pd.DataFrame | None) -> pd.DataFrame:
    """One row per compared item and pair: its steps, what its boundary state reads out at the first suffix step
    (live's top-2 margin and the max-abs logit difference there: the scores the split association uses), the largest
    KL, whether it split (the argmax differs at some step under teacher forcing) and where first, whether every
    step's logits were byte-equal, and whether the boundary caches were.

    No score is taken over the suffix: a maximum or minimum over every step includes the split step itself (where
    the logit difference is large and the margin small because the split happens there) and grows with the
    suffix's length."""
    columns = ITEM_KEYS + ["item_id", "steps", "margin_boundary", "logit_diff_boundary", "max_kl", "split",
                           "first_divergence", "all_logits_equal", "cache_equal"]
    if table is None or table.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for key, g in table.groupby(ITEM_KEYS, sort=True):
        g = g.sort_values("step")
        differs = g.loc[g["argmax_differs"].astype(bool), "step"]
        first = g.iloc[0]
        rows.append({**dict(zip(ITEM_KEYS, key)), "item_id": first["item_id"], "steps": len(g),
                     "margin_boundary": float(first["margin_reference"]) if first["step"] == 0 else None,
                     "logit_diff_boundary": float(first["max_abs_logit_diff"]) if first["step"] == 0 else None,
                     "max_kl": float(g[KL].max()),
                     "split": bool(len(differs)), "first_divergence": int(differs.min()) if len(differs) else None,
                     "all_logits_equal": bool(g["logits_equal"].all()), "cache_equal": bool(g["cache_equal"].all())})
    return pd.DataFrame(rows, columns=columns)


def split_association(items: pd.DataFrame, steps: pd.DataFrame | None = None) -> dict:
    """Scores known before the split against the split, with suffix length controlled: stats.json's
    ``split_predictors`` block of one precision and pair.

    Two kinds of score, neither of which reads the split step. At the boundary: step 0's (the first decode step,
    which reads the boundary cache and nothing the suffix has made); items split at step 0 are left out and counted,
    their step-0 difference being the split itself. At the step before: a split item's score at step d - 1 (its
    last step before the first divergence d) against each unsplit item's at that same step (a per-step hazard's
    risk set), so both are read at one position. Either way a split item (d >= 1) is compared only with unsplit
    items whose suffix ran past step d (observed unsplit for as long as it took the split item to split), so
    neither class wins by having had more steps. The suffix length itself, scored the same way, is the control: it
    should carry nothing once pairs are matched so. It is an association across items, not a prediction: nothing is
    fitted or held out."""
    first = pd.to_numeric(items["first_divergence"], errors="coerce")
    split = items["split"].astype(bool)
    at_boundary = items[split & (first == 0)]
    cases = items[split & (first > 0) & items["margin_boundary"].notna()]
    controls = items[~split & items["margin_boundary"].notna()]
    divergence = cases["first_divergence"].to_numpy(dtype=float)
    comparable = controls["steps"].to_numpy()[None, :] > divergence[:, None]  # (cases, controls)
    scores = {"margin_boundary": ("smaller", lambda f: -f["margin_boundary"]),
              "logit_diff_boundary": ("larger", lambda f: f["logit_diff_boundary"]),
              "suffix_length": ("larger", lambda f: f["steps"].astype(float))}
    out: dict = {"split_at_boundary_step": len(at_boundary), "cases": len(cases), "controls": len(controls),
                 "method": "AUC over (split, unsplit) pairs in which the unsplit item's suffix ran past the split "
                           "item's first divergence; scores at suffix step 0, or both at the split item's step "
                           "before its divergence; split-at-step-0 items left out"}
    for name, (direction, score) in scores.items():
        out[name] = {**separation.auc_delong(score(cases).tolist(), score(controls).tolist(), names=CLASSES,
                                        comparable=comparable),
                     "score": f"{name}: AUC = P(a split item's is {direction} than a comparable unsplit item's)"}
    for name, column, sign, direction in (("margin_step_before", "margin_reference", -1.0, "smaller"),
                                          ("logit_diff_step_before", "max_abs_logit_diff", 1.0, "larger")):
        case_scores, control_scores = _step_before(steps, cases, controls, column)
        out[name] = {**separation.matched_auc_delong(sign * case_scores, sign * control_scores, comparable),
                     "score": f"{name}: AUC = P(a split item's {column} at its step d - 1 is {direction} than a "
                              "comparable unsplit item's at that step)"}
    return out


def _step_before(steps: pd.DataFrame | None, cases: pd.DataFrame, controls: pd.DataFrame, column: str
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(cases, controls) matrices of ``column`` at each case's step d - 1: the case's own and each control's at
    that step (NaN where a side has no such step)."""
    shape = (len(cases), len(controls))
    if steps is None or steps.empty or not all(shape):
        return np.full(shape, np.nan), np.full(shape, np.nan)
    by_item = {int(i): g.set_index("step")[column] for i, g in steps.groupby("item_index")}
    before = cases["first_divergence"].to_numpy(dtype=int) - 1  # (cases,)
    own = np.asarray([by_item[int(i)].get(s, np.nan) for i, s in zip(cases["item_index"], before)], dtype=float)
    other = np.asarray([[by_item[int(j)].get(s, np.nan) for j in controls["item_index"]] for s in before],
                       dtype=float)
    return np.repeat(own[:, None], len(controls), axis=1), other


READOUT_COLUMNS = ["kl_forward", "kl_reverse", "max_abs_logit_diff", "margin_construction", "argmax_differs",
                   "logits_equal"]
SUMMARY_COLUMNS = ["steps", "margin_boundary", "logit_diff_boundary", "max_kl", "split", "first_divergence"]


def same_constructions(frame: pd.DataFrame, by: list[str], values: list[str]) -> dict[tuple, list[tuple[str, ...]]]:
    """Per ``by`` group (a revision and precision, say): the sets of constructions (two or more) whose rows hold
    the same ``values`` on every item and step, sorted; a construction alike with none is not listed. Drawn or
    tabled once, they are one result, not several."""
    found: dict[tuple, list[tuple[str, ...]]] = {}
    keys = [c for c in ("item_index", "step") if c in frame.columns]
    for group, g in frame.groupby(by, sort=True):
        signature: dict[tuple, list[str]] = {}
        for construction, rows in g.groupby("construction", sort=True):
            records = rows.sort_values(keys)[keys + values].astype(object).where(rows[keys + values].notna(), None)
            signature.setdefault(tuple(map(tuple, records.to_numpy().tolist())), []).append(str(construction))
        alike = [tuple(names) for names in signature.values() if len(names) > 1]
        if alike:
            found[group if isinstance(group, tuple) else (group,)] = alike
    return found


def construction_label(construction: str, groups: list[tuple[str, ...]]) -> str | None:
    """``a = b`` for the first of a set of alike constructions, None for the others (shown once), else the name."""
    for names in groups:
        if construction in names:
            return " = ".join(names) if construction == names[0] else None
    return construction


def suffix_budget(job_record: dict, table: pd.DataFrame) -> int:
    """The suffix budget the stage ran with (the job's provenance record), else the longest suffix it holds."""
    record = job_record.get("fidelity") or {}
    longest = int(table["step"].max()) + 1 if len(table) else 0
    return int(record.get("max_new_tokens") or longest)


def suffix_positions(data: RevisionData, table: pd.DataFrame) -> int:
    return suffix_budget(data.job_record("fidelity"), table)


def items_of_files(paths: dict[str, str] | None) -> pd.DataFrame | None:
    """:func:`item_summary` of every revision's fidelity.parquet that exists, with its suffix budget
    (``positions``); None where there is none."""
    frames = []
    for path in (paths or {}).values():
        if not path or not Path(path).is_file():
            continue
        table = read_parquet(path)
        if table.empty:
            continue
        prov = read_provenance(path)
        items = item_summary(table)
        items["positions"] = suffix_budget((prov.get("parts") or [prov])[0], table)
        frames.append(items)
    return pd.concat(frames, ignore_index=True) if frames else None


def _median(values: pd.Series) -> float | None:
    return float(values.median()) if len(values) else None


def pair_numbers(steps: pd.DataFrame, items: pd.DataFrame, positions: int, seed: int) -> dict:
    """stats.json's block of one precision and pair."""
    n_items = len(items)
    split = items[items["split"]]
    unsplit = items[~items["split"]]
    return {
        "steps": len(steps), "items": n_items,
        "bit_identical": bool(len(steps) and steps["logits_equal"].all()),
        "steps_logits_equal": stats.proportion(int(steps["logits_equal"].sum()), len(steps)),
        "items_all_logits_equal": stats.proportion(int(items["all_logits_equal"].sum()), n_items),
        "items_cache_equal": int(items["cache_equal"].sum()),
        "items_split": stats.proportion(int(items["split"].sum()), n_items),
        "kl": KL_TEXT, "kl_forward_median": _median(steps["kl_forward"]),
        "kl_forward_max": float(steps["kl_forward"].max()) if len(steps) else None,
        "kl_sym_median": _median(steps["kl_sym"]),
        "kl_sym_max": float(steps["kl_sym"].max()) if len(steps) else None,
        "steps_kl_exactly_zero": int((steps["kl_forward"] == 0).sum()),
        "max_abs_logit_diff_median": _median(steps["max_abs_logit_diff"]),
        "max_abs_logit_diff_max": float(steps["max_abs_logit_diff"].max()) if len(steps) else None,
        "split_predictors": split_association(items, steps),
        "split_by_position": stats.share_by_position(list(items["first_divergence"]), n_items, positions),
        "method": "steps: every suffix step of every compared item (steps of one item are not independent: the "
                  "step-level Wilson interval is narrower than the data warrant; items_all_logits_equal is the "
                  "item-level share); items split: the argmax differs at some step under teacher forcing",
    }


def _kl_text(value: float | None) -> str:
    if value is None:
        return "—"
    return "exactly 0" if value == 0 else f"{value:.3g}"


def _fidelity_words(n: dict) -> str:
    """``bit-identical`` where every logit vector was byte-equal; otherwise the KL as a number."""
    if n["bit_identical"]:
        return "bit-identical (every step's logits byte-equal)"
    return f"differs: KL median {_kl_text(n['kl_forward_median'])}, max {_kl_text(n['kl_forward_max'])} nats"


def _auc_text(r: dict) -> str:
    if r["auc"] is None:
        return "—"  # why: the note under the table; stats.json's ``skipped``
    if r["low"] is None:
        why = "complete separation" if r["complete_separation"] else "no spread in the scores"
        return f"{r['auc']:.2f} ({why}: no DeLong interval)"
    return f"{r['auc']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"


def report_positions(positions: int) -> list[int]:
    """The suffix positions the report's table shows of the split-by-position curve: 1, the quarters, the end."""
    return sorted({1, *(max(1, round(positions * q / 4)) for q in (1, 2, 3, 4))}) if positions else []


def fidelity_section(data: RevisionData) -> tuple[list[str], dict]:
    """Which replay construction matches live, fidelity along the suffix, and what a split is associated with."""
    table = data.frame("fidelity")
    check_unique(table, "fidelity")
    if table.empty:
        return ["_fidelity.parquet holds no rows: no item reached the stage boundary at this revision._", ""], {}
    items = item_summary(table)
    positions = suffix_positions(data, table)
    out: dict = {}
    cells = []
    for precision in analysis.sort_precisions(table["precision"]):
        for (reference, construction), g in table[table["precision"] == precision].groupby(
                ["reference", "construction"], sort=True):
            it = items[(items["precision"] == precision) & (items["reference"] == reference)
                       & (items["construction"] == construction)]
            numbers = pair_numbers(g, it, positions, data.seed)
            out.setdefault(precision, {})[pair_name(reference, construction)] = numbers
            cells.append((precision, reference, construction, numbers))
    lines = ["Each compared item's live suffix (greedy, regenerated from the ledger's prompt and checked against its "
             "row) is teacher-forced through every other construction's boundary cache, built over the same prefix "
             "ids in the same batch and layout; at every suffix step the two next-token distributions are compared "
             f"({KL_TEXT}; figure 9). Until the first step whose argmax differs, the forced suffix is the "
             "construction's own greedy one, so that step is the pair's first divergence.", "",
             "**Which replay method matches live**", "",
             *table_head("precision", "construction", "items", "items split", "steps with byte-equal logits",
                         "median KL (nats)", "matches live")]
    alike = same_constructions(table, ["precision"], READOUT_COLUMNS)
    for precision, _, construction, n in cells:
        n["same_readouts_as"] = [c for names in alike.get((precision,), []) if construction in names
                                 for c in names if c != construction]
        label = construction_label(construction, alike.get((precision,), []))
        if label is None:
            continue
        equal = n["steps_logits_equal"]
        lines.append(table_row(precision, label, n["items"], n["items_split"]["k"],
                               f"{equal['k']} / {equal['n']}", _kl_text(n["kl_forward_median"]), _fidelity_words(n)))
    lines.append("")
    for (precision,), groups in alike.items():
        lines.append(f"At {precision}, " + "; ".join(" and ".join(f"`{c}`" for c in names) for names in groups)
                     + " read out the same KL, logit differences, margins and argmax as each other at every step "
                     "of every item: one result, shown once.")
    for precision in dict.fromkeys(c[0] for c in cells):
        mine = [c for c in cells if c[0] == precision]
        exact = [c[2] for c in mine if c[3]["bit_identical"]]
        if exact:
            lines.append(f"At {precision}, {join_words([f'`{c}`' for c in exact])} "
                         f"{'is' if len(exact) == 1 else 'are'} bit-identical with live at every step.")
            continue
        # closest: most byte-equal steps, then the smaller median KL, then the smaller largest KL
        closest = min(mine, key=lambda c: (-c[3]["steps_logits_equal"]["k"] / max(1, c[3]["steps"]),
                                           c[3]["kl_forward_median"], c[3]["kl_forward_max"], c[2]))[3]
        name = next(c[2] for c in mine if c[3] is closest)
        unsplit = [c[2] for c in mine if c[3]["items_split"]["k"] == 0]
        lines.append(f"At {precision}, no construction matches live bit for bit; the closest (most byte-equal steps, "
                     f"then median KL) is `{name}` "
                     f"({closest['steps_logits_equal']['k']} / {closest['steps']} steps byte-equal, KL median "
                     f"{_kl_text(closest['kl_forward_median'])}, max {_kl_text(closest['kl_forward_max'])} nats)"
                     + (f"; {join_words([f'`{c}`' for c in unsplit])} split on no item." if unsplit else "."))
    lines += ["", *table_head("precision", "pair", "steps", "steps with byte-equal logits",
                              "items with every step byte-equal", "median KL", "max KL", "median max-abs logit diff",
                              "max")]
    for precision, reference, construction, n in cells:
        label = construction_label(construction, alike.get((precision,), []))
        if label is None:
            continue
        lines.append(table_row(precision, f"{reference} vs {label}", n["steps"],
                               format_proportion(n["steps_logits_equal"]),
                               format_proportion(n["items_all_logits_equal"]),
                               _kl_text(n["kl_forward_median"]), _kl_text(n["kl_forward_max"]),
                               f"{n['max_abs_logit_diff_median']:.3g}", f"{n['max_abs_logit_diff_max']:.3g}"))
    lines += ["", "The step-level Wilson intervals treat an item's steps as independent, which they are not; the "
              "item-level share beside them is the one whose interval holds.", ""]
    lines += _predictors_lines(cells, positions, alike)
    return lines, out


def _predictors_lines(cells, positions: int, alike: dict) -> list[str]:
    shown = report_positions(positions)
    cells = [(p, r, label, n) for p, r, c, n in cells if (label := construction_label(c, alike.get((p,), [])))]
    lines = ["**What is associated with a split** (association across items, not a prediction)", "",
             "Scores the boundary state reads out at the first suffix step, before any suffix token is compared: "
             "live's top-2 margin and the max-abs logit difference between the two constructions there. Items split "
             "at that very step are left out (their difference there is the split) and counted. A split item is "
             "compared only with unsplit items whose suffix ran past its first divergence, so suffix length is "
             "held even. \"At the step before\": both items' scores at the split item's last step before its "
             "divergence (a per-step hazard's risk set). The suffix length, scored the same way, is the control "
             "column and should read near 0.5. "
             "AUC (Mann-Whitney; 0.5: no association) with DeLong's 95% interval on the logit scale (figure 10, "
             "left).", "",
             *table_head("precision", "pair", "split at step 0 (left out)", "split later / unsplit items",
                         "AUC, margin at the boundary", "AUC, logit difference at the boundary",
                         "AUC, margin at the step before", "AUC, logit difference at the step before",
                         "AUC, suffix length (control)")]
    for precision, reference, construction, n in cells:
        p = n["split_predictors"]
        lines.append(table_row(precision, f"{reference} vs {construction}", p["split_at_boundary_step"],
                               f"{p['cases']} / {p['controls']}", _auc_text(p["margin_boundary"]),
                               _auc_text(p["logit_diff_boundary"]), _auc_text(p["margin_step_before"]),
                               _auc_text(p["logit_diff_step_before"]), _auc_text(p["suffix_length"])))
    lines += ["", "—: no AUC, a class being empty (no item split after step 0, or none unsplit) or no split item "
              "comparable with an unsplit one (none observed past its split step)."]
    if shown:
        lines += ["", f"Items split within the first k suffix tokens, of all compared items (Wilson 95%, pointwise; "
                  f"the whole curve k = 1 .. {positions} is in `stats.json` and figure 10, right): what a shorter "
                  "budget would have shown.", "",
                  *table_head("precision", "pair", *(f"k = {k}" for k in shown))]
        for precision, reference, construction, n in cells:
            curve = n["split_by_position"]
            values = []
            for k in shown:
                i = k - 1
                values.append(f"{curve['split'][i]} / {curve['n']}" + (
                    f" [{100 * curve['wilson_low'][i]:.1f}, {100 * curve['wilson_high'][i]:.1f}]%"
                    if curve["n"] else ""))
            lines.append(table_row(precision, f"{reference} vs {construction}", *values))
    return lines + [""]
