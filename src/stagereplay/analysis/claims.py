"""The report's sections on the reference study's ledger claims: the matched experiment (claims 1-3: replicas
exact, suffixes that differ, labels that differ and the accuracy difference), the fixed-prefix 2x2 (claim 4), the
bridge (claim 5), and the items excluded from those comparisons and why.

Each section is a function of :class:`~stagereplay.analysis.revision_data.RevisionData` returning its Markdown
lines and its ``stats.json`` numbers; :data:`stagereplay.analysis.report.SECTIONS` lists them. The audit
(claim 6) is in :mod:`stagereplay.analysis.audit_report`, the transplants (claim 7) in
:mod:`stagereplay.analysis.transplant_report`.
"""

from __future__ import annotations

import pandas as pd

from stagereplay.analysis import stats, study
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.report_format import (count_true, format_accuracy, format_int, format_proportion,
                                                join_words, table_head, table_row)
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.analysis.row_keys import check_unique
from stagereplay.analysis.truncation import budget_stop_lines, budget_stops
from stagereplay.io.provenance import recorded_batch_plan


def _pair_statistics(cmp: pd.DataFrame, seed: int) -> tuple[dict, dict, dict | None]:
    """Suffix disagreements, label flips and the paired accuracy difference of one comparison table."""
    n = len(cmp)
    dis = stats.proportion(int(cmp["disagree"].sum()), n)
    flips = stats.proportion(int(cmp["label_differs"].sum()), n)
    acc = (stats.paired_accuracy_difference(cmp["correct_a"].tolist(), cmp["correct_b"].tolist(), seed=seed)
           if n else None)
    return dis, flips, acc


def _budget_stop_lines(data: RevisionData, out: dict) -> list[str]:
    """Beside a section's accuracies: its precisions' suffixes that stopped at max_new_tokens (``out``'s numbers)."""
    lines = budget_stop_lines({p: v["suffixes_at_max_new_tokens"] for p, v in out.items()}, data.max_new_tokens)
    return [part for line in lines for part in ("", line)]


def _replica_rows(data: RevisionData, experiment: str) -> tuple[list[str], dict]:
    rep = analysis.replica_agreement(data.ledger)
    rep = rep[rep["experiment"] == experiment]
    lines, out = [], {}
    for r in rep.itertuples(index=False):
        out.setdefault(r.precision, {})[r.construction] = {
            "n": int(r.n), "identical": int(r.identical),
            "method": "replica pairs compared on stage ids, cache fingerprint and suffix fingerprint (sha256 bytes)"}
        ref = ("all exact" if study.REPLICAS_EXACT.get(r.precision) else "—") if experiment == "matched" else "—"
        lines.append(table_row(r.precision, r.construction, ref, f"{r.identical} / {r.n} bit-identical"))
    return lines, out


def matched_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claims 1-3: replicas exact; live vs prefill suffixes that differ; labels that differ and the accuracy."""
    ledger, seed = data.ledger, data.seed
    matched = ledger[ledger["experiment"] == "matched"]
    if matched.empty:
        return ["_No matched-experiment rows in the ledger._", ""], {}
    pairs = data.pairs[data.pairs["experiment"] == "matched"]
    out: dict = {}
    rep_lines, rep = _replica_rows(data, "matched")
    claim1 = ["#### Claim: matched experiment, replicas on both sides exact", "",
              *table_head("precision", "construction", "reference study", "this run: replica pairs"), *rep_lines, ""]
    claim2 = ["#### Claim: live cache vs one-shot prefill of identical tokens, suffixes that differ", "",
              *table_head("precision", "reference study", "this run")]
    claim3 = ["#### Claim: correctness labels that differ, and the accuracy difference (live − prefill)", "",
              *table_head("precision", "", "reference study", "this run")]
    for precision in analysis.sort_precisions(matched["precision"]):
        sub = matched[matched["precision"] == precision]
        live1 = sub[(sub["construction"] == "live") & (sub["replica"] == 1)]
        missing = live1[live1["status"] == "boundary_missing"]
        nonfinite = sub[sub["status"] == "nonfinite"]["item_id"].unique()
        cmp = pairs[pairs["precision"] == precision]
        n = len(cmp)
        dis, flips, acc = _pair_statistics(cmp, seed)
        out[precision] = {"n_items": len(live1), "n_compared": n, "boundary_missing": int(len(missing)),
                          "nonfinite_items": int(len(nonfinite)), "suffix_disagreements": dis,
                          "label_flips": flips, "accuracy_difference": acc, "replicas": rep.get(precision, {}),
                          "first_divergence": stats.first_divergence_summary(
                              cmp.loc[cmp["disagree"], "first_divergence"].tolist()),
                          "suffixes_at_max_new_tokens": budget_stops(cmp), "max_new_tokens": data.max_new_tokens}
        ref_dis = study.MATCHED_DISAGREEMENTS.get(precision)
        ref_flips = study.MATCHED_LABEL_FLIPS.get(precision)
        claim2.append(table_row(precision, ref_dis if ref_dis else "—", format_proportion(dis)))
        claim3.append(table_row(precision, "labels that differ", ref_flips if ref_flips else "—",
                                format_proportion(flips)))
        claim3.append(table_row(precision, "accuracy live / prefill, difference",
                                study.accuracy_text(precision) if precision in study.MATCHED_ACCURACY else "—",
                                format_accuracy(acc) if acc else "no compared items"))
    counts = "; ".join(f"{p}: {v['n_items']} items, {v['n_compared']} compared" for p, v in out.items())
    lines = [f"Items per precision: {counts} (exclusions listed below).", "", *claim1, *claim2, "", *claim3,
             *_budget_stop_lines(data, out), ""]
    return lines, out


def _other_prefixes(ledger: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """Per precision: items whose fixed-prefix rows have another prefix fingerprint than their matched rows, of the
    items with both (replica 1); only precisions where some differ."""
    rows = ledger[(ledger["replica"] == 1) & ledger["prefix_fingerprint"].notna()]
    found = {}
    for precision, group in rows.groupby("precision", sort=False):
        matched = group[group["experiment"] == "matched"].groupby("item_index")["prefix_fingerprint"].first()
        fixed = group[group["experiment"] == "fixed_prefix"].groupby("item_index")["prefix_fingerprint"].first()
        both = matched.index.intersection(fixed.index)
        differ = int((matched[both] != fixed[both]).sum())
        if differ:
            found[str(precision)] = (differ, len(both))
    return found


def fixed_prefix_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claim 4: the fixed-prefix 2x2 (construction x precision) over identical token states."""
    ledger, seed = data.ledger, data.seed
    fixed = ledger[ledger["experiment"] == "fixed_prefix"]
    header = ["#### Claim: fixed-prefix 2x2 (construction x precision), all token states held fixed", ""]
    if fixed.empty:
        return header + ["_The ledger holds no `fixed_prefix` rows: the fixed-prefix stage has not run for this "
                         "revision._", ""], {}
    pairs = data.pairs[data.pairs["experiment"] == "fixed_prefix"]
    rep_lines, rep = _replica_rows(data, "fixed_prefix")
    a, b = analysis.fixed_prefix_pair(ledger)
    study_pair = (a, b) == analysis.STUDY_FIXED_PREFIX
    identical = analysis.identical_caches(ledger)
    out: dict = {}
    lines = header + table_head("precision", "reference study: suffixes that differ",
                                f"this run: {a} vs {b}, suffixes that differ", "labels that differ",
                                f"accuracy {a} / {b}, difference ({a} − {b})", "first divergence (median [IQR])")
    for precision in analysis.sort_precisions(fixed["precision"]):
        cmp = pairs[pairs["precision"] == precision]
        n = len(cmp)
        dis, flips, acc = _pair_statistics(cmp, seed)
        fd = stats.first_divergence_summary(cmp.loc[cmp["disagree"], "first_divergence"].tolist())
        nonfinite = fixed[(fixed["precision"] == precision) & (fixed["status"] == "nonfinite")]
        same = data.coinciding.get((data.revision, precision))
        out[precision] = {"constructions": [a, b], "n_compared": n, "suffix_disagreements": dis, "label_flips": flips,
                          "accuracy_difference": acc, "first_divergence": fd, "replicas": rep.get(precision, {}),
                          "nonfinite_rows": int(len(nonfinite)),
                          "nonfinite_items": int(nonfinite["item_index"].nunique()),
                          "same_rows_as_matched": bool(same), "suffixes_at_max_new_tokens": budget_stops(cmp),
                          "max_new_tokens": data.max_new_tokens,
                          "identical_caches": identical.get((data.revision, precision), [])}
        fd_text = f"{fd['median']:g} [{fd['q1']:g}, {fd['q3']:g}] (n={fd['n']})" if fd["n"] else "—"
        mark = " (= matched)" if same else ""
        reference = study.fixed_prefix_text(precision) if study_pair else "— (the study compared incremental vs prefill)"
        lines.append(table_row(f"{precision}{mark}", reference, format_proportion(dis), format_proportion(flips),
                               format_accuracy(acc) if acc else "no compared items", fd_text))
    lines += _budget_stop_lines(data, out)
    shared = [p for p in out if out[p]["same_rows_as_matched"]]
    if shared:
        lines += ["", f"(= matched): at {join_words(shared)}, the fixed-prefix rows repeat the matched experiment's "
                  "rows item for item (the same cache and suffix fingerprints on both sides, the same margins): that "
                  "cell is the matched comparison again, not a second measurement, and the margin test and figures 2 "
                  "and 3 count it once, as matched."]
    other = _other_prefixes(ledger)
    if other:
        lines += ["", "Other prefixes than the matched rows': " + "; ".join(
            f"at {p}, {k} of {n} items' fixed-prefix rows continue other prefix ids than its matched rows"
            for p, (k, n) in other.items()) + ". The fixed-prefix rows continue the prefix ids held fixed (the "
            "reference precision's generation), the matched rows each precision's own, so their accuracies differ "
            "between the matched and the fixed-prefix table."]
        for p, (k, n) in other.items():
            out[p]["items_with_other_prefix_than_matched"] = {"k": k, "n": n}
    overflowed = {p: v["nonfinite_rows"] for p, v in out.items() if v["nonfinite_rows"]}
    if overflowed:
        lines += ["", "Rows with non-finite logits (marked `nonfinite`, never compared): " + ", ".join(
            f"{p}: {k} rows of {out[p]['nonfinite_items']} items" for p, k in overflowed.items()) + "."]
    lines += _replay_lines(data, out)
    lines += ["", "Replicas of each cell:", "",
              *table_head("precision", "construction", "reference study", "this run: replica pairs"), *rep_lines, ""]
    return lines, out


def _replay_lines(data: RevisionData, out: dict) -> list[str]:
    """With more than two fixed-prefix constructions: each replay construction against the reference (incremental,
    the stand-in for live), per precision, counted as the 2x2 counts; its numbers go to ``out[precision]``."""
    comparisons = analysis.replay_comparisons(data.ledger)
    if len(comparisons) < 2:
        return []  # two constructions: the 2x2 above is the only comparison
    reference = comparisons[0][1]
    cells = analysis.replay_cells(data.ledger)
    cells = cells[cells["revision"] == data.revision]
    stand_in = (" (the stand-in for `live` where the bridge above finds it bit-exact with the live cache)"
                if reference == "incremental" else "")
    identical = analysis.identical_caches(data.ledger)
    lines = ["", f"Each replay construction against `{reference}`{stand_in}, over the same prefix ids, in the same "
             "batches and layout, counted as in the 2x2: items whose suffix ids differ. Constructions whose boundary "
             "caches are byte-identical on every item are one result, named once (a = b).", "",
             *table_head("precision", "construction", f"suffixes that differ from {reference}", "labels that differ")]
    for r in cells.itertuples(index=False):
        dis = stats.proportion(int(r.k), int(r.n))
        flips = stats.proportion(int(r.label_flips), int(r.n))
        out.setdefault(r.precision, {}).setdefault("against_reference", {})[r.construction_b] = {
            "constructions": [r.construction_a, r.construction_b], "n_compared": int(r.n),
            "suffix_disagreements": dis, "label_flips": flips}
        groups = [g["constructions"] for g in identical.get((data.revision, r.precision), [])]
        label = next((" = ".join(names) if r.construction_b == names[0] else None
                      for names in groups if r.construction_b in names), r.construction_b)
        if label is not None and reference not in label.split(" = "):
            lines.append(table_row(r.precision, label, format_proportion(dis), format_proportion(flips)))
    named = [f"{p}: " + " = ".join(f"`{c}`" for c in g["constructions"]) + f", byte-identical on all {g['n']} items"
             for (revision, p), groups in identical.items() if revision == data.revision for g in groups]
    if named:
        lines += ["", "Boundary caches byte-identical (the same fingerprint on every item): " + "; ".join(named) + "."]
    same = {}
    for r in cells.itertuples(index=False):
        if r.n and not r.k:
            same.setdefault(r.precision, []).append(f"`{r.construction_b}`")
    lines += ["", (f"Suffixes identical to `{reference}`'s on every compared item: "
                   + "; ".join(f"{p}: {join_words(names)}" for p, names in same.items()) + "." if same else
                   f"No replay construction continued as `{reference}` on every compared item.")]
    return lines


def bridge_rows_asked(provenance: dict) -> int | None:
    """``bridge.n_rows`` as the generation jobs that wrote the bridge (or its gathered parts) record it; None where
    the provenance does not say."""
    asked = set()
    for prov in provenance.get("parts") or [provenance]:
        bridge = (prov.get("config") or {}).get("bridge", "unrecorded")
        if bridge != "unrecorded":
            asked.add(int((bridge or {}).get("n_rows") or 0))
    return asked.pop() if len(asked) == 1 else None


def _bridge_reading(groups: list[tuple[str, pd.DataFrame]], asked: int | None = None) -> list[str]:
    """What this run's bridge rows show, in sentences built from their counts (``asked``: bridge.n_rows)."""
    if not groups or all(len(g) == 0 for _, g in groups):
        if asked == 0:
            return ["No bridge row was asked for (bridge.n_rows: 0), so the incremental cache was not compared with "
                    "the live one; set bridge.n_rows above 0 to compare them."]
        return ["No bridge row reached the boundary: there is no cache to compare."]
    inc = [(p, count_true(g, "bit_exact"), len(g)) for p, g in groups]
    words = join_words([f"{k} / {n} rows in {p}" for p, k, n in inc])
    lines = ["The `incremental` rebuild feeds the prompt in one forward pass and the stage tokens one at a time, the "
             "same chunks as the live generation; in this run it equals the retained live cache byte for byte on "
             f"{words}."]
    if all(k == n for _, k, n in inc):
        lines.append("So here `incremental` may stand in for `live` at a precision that did not generate the prefix "
                     "(the fixed-prefix 2x2).")
    else:
        lines.append("It does not on every row, so the fixed-prefix 2x2's `incremental` cells are not `live` cells "
                     "in this run.")
    if all("prefill_bit_exact" in g.columns for _, g in groups):
        pre = [(p, count_true(g, "prefill_bit_exact"), len(g)) for p, g in groups]
        same = [p for p, k, n in pre if n and k == n]
        differ = [p for p, k, n in pre if n and k == 0]
        some = [(p, k, n) for p, k, n in pre if n and 0 < k < n]
        parts = []
        if same:
            parts.append(f"equals the live cache on every row in {join_words(same)}: in this run's regime the one-shot "
                         "construction does not change the cache there")
        if differ:
            parts.append(f"differs from the live cache on every row in {join_words(differ)}")
        if some:
            parts.append("equals it on " + join_words([f"{k} / {n} rows in {p}" for p, k, n in some]))
        lines.append("The contrast, a one-shot `prefill` of the same ids (one forward pass, other matrix shapes), "
                     + "; ".join(parts) + ".")
    return [" ".join(lines)]


def bridge_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claim 5: the bridge, token-by-token incremental cache against the retained live cache."""
    bridge = data.frame("bridge")
    check_unique(bridge, "bridge")
    no_boundary = 0
    if "status" in bridge.columns:  # rows whose item never reached the boundary have no cache to compare
        no_boundary = int((bridge["status"] != "ok").sum())
        bridge = bridge[bridge["status"] == "ok"]
    exact = count_true(bridge, "bit_exact")
    stat = stats.proportion(exact, len(bridge))
    # one column per precision: the bridge is a claim about each precision's caches, not about their sum
    groups = ([(str(p), g) for p, g in bridge.groupby("precision", sort=True)]
              if "precision" in bridge.columns and len(bridge) else [("this run", bridge)])
    by_precision = {name: stats.proportion(count_true(g, "bit_exact"), len(g))
                    for name, g in groups if name != "this run"}

    def row(label: str, reference: str, column: str) -> str:
        return table_row(label, reference, *(f"{count_true(g, column)} / {len(g)}" for _, g in groups))

    lines = ["#### Claim: bridge, token-by-token incremental cache vs retained live cache", "",
             *table_head("", "reference study", *(name for name, _ in groups)),
             row("rows bit-exact (every layer's K and V bytes)", str(study.BRIDGE_BIT_EXACT), "bit_exact")]
    if "suffix_equal" in bridge.columns:
        lines.append(row("continuations identical", "—", "suffix_equal"))
    if "prefill_bit_exact" in bridge.columns:
        lines.append(row("contrast: one-shot prefill bit-exact with live", "—", "prefill_bit_exact"))
    bad = bridge[~bridge["bit_exact"].fillna(False).astype(bool)]
    if len(bad):
        lines += ["", "Rows that are not bit-exact:", "",
                  *table_head("item", "precision", "first layer", "component", "first position")]
        lines += [table_row(f"`{r.item_id}`", r.precision, format_int(r.first_layer_differs), r.component_differs,
                            format_int(r.first_position_differs)) for r in bad.itertuples(index=False)]
    if no_boundary:
        lines += ["", f"{no_boundary} bridge row(s) drawn for items that never reached the boundary are not counted."]
    lines += [""] + _bridge_reading([g for g in groups], bridge_rows_asked(data.provenance("bridge")))
    plan = recorded_batch_plan(data.paths["bridge"]) if data.paths.get("bridge") and data.has("bridge") else None
    if plan is not None:
        lines += ["", f"Batched run (batch size {plan['batch_size']}, plan seed {plan['seed']}): each live row is "
                  "compared with the incremental rebuild in its own recorded batch (stage ids teacher-forced in the "
                  "live run's lockstep schedule, rows without a boundary fed padding); the prefill contrast is the "
                  "row's batched one-shot prefill."]
    return lines + [""], {"bit_exact": stat, "bit_exact_by_precision": by_precision,
                          "not_bit_exact_items": [str(i) for i in bad["item_id"]],
                          "prefill_bit_exact_by_precision": {
                              name: stats.proportion(count_true(g, "prefill_bit_exact"), len(g))
                              for name, g in groups if name != "this run" and "prefill_bit_exact" in g.columns},
                          "batch_plan": None if plan is None else {k: plan[k] for k in ("seed", "batch_size")}}


def exclusions_section(data: RevisionData) -> tuple[list[str], dict]:
    """Items left out of the comparisons, and why."""
    excluded = analysis.exclusions(data.ledger)
    if excluded.empty:
        return ["No item was excluded: every item has status ok on both constructions of every comparison.", ""], {
            "n": 0, "items": []}
    lines = table_head("item", "experiment", "precision", "reason")
    lines += [table_row(f"`{r.item_id}`", r.experiment, r.precision, r.reason)
              for r in excluded.itertuples(index=False)]
    items = [{"item_id": str(r.item_id), "experiment": r.experiment, "precision": r.precision, "reason": r.reason}
             for r in excluded.itertuples(index=False)]
    return lines + [""], {"n": len(items), "items": items}
