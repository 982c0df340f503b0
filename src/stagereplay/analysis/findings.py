"""The report's opening summary: each claim of the reference study, this run's figure with its interval, and whether
the study's conclusion holds here, built from the numbers the report writes to ``stats.json`` (nothing recomputed).

"Holds" is the study's qualitative conclusion, never a match of counts: the study measured one 48-layer model on its
GPU, a run measures its own model on its own hardware, so how many items split is the run's own figure (the CPU's
kernels alone change it, docs/NUMERICS.md). Each row says which conclusion it checks, and says what was shown: an
interval that includes 0 shows no difference, never that a claim "holds" (the accuracy row names an equivalence
test with its margin instead); counts pooled over directions say so; a split count names the token budget that
moves it. The second table, "beyond the study", leads with this run's own numbers, each beside its control
(:data:`BEYOND_ROWS`, one builder per row). This module knows nothing of the results files but the transplant table
the localisation row reads: it reads the dict :func:`stagereplay.analysis.report.build_report` assembles.
"""

from __future__ import annotations

from stagereplay import catalogue
from stagereplay.analysis import stats, study
from stagereplay.analysis.report_format import format_percent, table_head, table_row
from stagereplay.analysis.truncation import budget_stop_caveat

HOLDS, DOES_NOT_HOLD, NOT_MEASURED, NOT_SHOWN = "yes", "**no**", "not measured", "not shown"
DEFAULT_EQUIVALENCE_MARGIN = 0.05  # the config's accuracy_equivalence_margin default (workflow/schemas)


def _count(stat: dict | None) -> str:
    """k / n (rate, Wilson 95% interval) of a proportion from stats.json."""
    if not stat or not stat.get("n"):
        return "no item compared"
    return (f"{stat['k']} / {stat['n']} ({format_percent(stat['rate'])}%, Wilson 95% "
            f"[{format_percent(stat['wilson_low'])}, {format_percent(stat['wilson_high'])}]%)")


def _points(value: float) -> str:
    return f"{value * 100:+.1f}"


def _replicas(numbers: dict) -> tuple[int, int, int]:
    """Replica pairs bit-identical, of all compared, pooled over every experiment, precision and construction, and
    the number of cells pooled."""
    same = total = cells = 0
    for experiment in ("matched", "fixed_prefix"):
        for cell in (numbers.get(experiment) or {}).values():
            for pair in (cell.get("replicas") or {}).values() if isinstance(cell, dict) else ():
                same, total, cells = same + pair["identical"], total + pair["n"], cells + 1
    return same, total, cells


def _budget(cell: dict) -> str:
    """The token budget that moves a split count, as the claim names it ('' where not recorded)."""
    budget = cell.get("max_new_tokens")
    return f", max_new_tokens {budget}" if budget else ""


def _accuracy_row(acc: dict, cell: dict, where: str, margin: float) -> tuple[str, str, str, str]:
    """The accuracy claim, said as what was shown: a difference (the exact interval excludes 0), equivalence within
    ``margin`` (TOST), or neither; never "holds" from an interval that merely includes 0."""
    test = stats.accuracy_equivalence(acc["discordant_a_only"], acc["discordant_b_only"], acc["n"], margin)
    ci, tost, points = test["interval"], test["tost_interval"], f"±{margin * 100:g} points"
    figure = (f"{_points(acc['difference'])} (n {acc['n']}; exact 95% interval [{_points(ci['low'])}, "
              f"{_points(ci['high'])}]; {acc['discordant_a_only']} vs {acc['discordant_b_only']} discordant pairs, "
              f"exact McNemar p = {acc['mcnemar_p']:.3g})" + budget_stop_caveat(cell.get("suffixes_at_max_new_tokens")))
    if test["verdict"] == "difference":
        verdict = f"{DOES_NOT_HOLD} (a difference shown: the exact interval excludes 0)"
    elif test["verdict"] == "equivalent":
        verdict = (f"{HOLDS} (equivalent within {points}: TOST, the exact 90% interval [{_points(tost['low'])}, "
                   f"{_points(tost['high'])}] lies inside the margin)")
    else:
        verdict = (f"{NOT_SHOWN} (no difference shown, and equivalence within {points} not shown either: the exact "
                   f"90% interval [{_points(tost['low'])}, {_points(tost['high'])}] reaches past the margin)")
    return ("bf16: accuracy difference live − prefill, points" + where, study.accuracy_text("bf16"), figure, verdict)


def _pooled(by_direction: dict) -> str:
    """``k / n, pooled over 2 directions: k1 / n1 + k2 / n2`` from the per-direction follow rates."""
    parts = [rate for rate in by_direction.values() if rate["n"]]
    donor, n = sum(rate["donor"] for rate in parts), sum(rate["n"] for rate in parts)
    if len(parts) < 2:
        return f"{donor} / {n}" + (f" ({next(iter(by_direction))} only)" if len(by_direction) == 1 else "")
    return (f"{donor} / {n}, pooled over {len(parts)} directions: "
            + " + ".join(f"{rate['donor']} / {rate['n']}" for rate in parts))


def revision_rows(revision: str, numbers: dict, named: bool,
                  margin: float = DEFAULT_EQUIVALENCE_MARGIN) -> list[tuple[str, str, str, str]]:
    """(claim, reference study, this run, holds) for one revision's numbers; ``named``: the claim names it;
    ``margin``: the accuracy's equivalence margin (a difference of proportions)."""
    rows = []
    where = f" (`{revision}`)" if named else ""
    matched = numbers.get("matched") or {}
    same, total, cells = _replicas(numbers)
    if total:
        pooled = f", pooled over {cells} cells (experiment x precision x construction)" if cells > 1 else ""
        rows.append(("replicas on both sides bit-exact" + where, "yes", f"{same} / {total} replica pairs{pooled}",
                     HOLDS if same == total else DOES_NOT_HOLD))
    cell = matched.get("bf16") if isinstance(matched.get("bf16"), dict) else None
    if cell:
        ref = study.MATCHED_DISAGREEMENTS["bf16"]
        dis = cell["suffix_disagreements"]
        rows.append((f"bf16 live vs prefill of identical tokens: suffixes differ{_budget(cell)}" + where, str(ref),
                     _count(dis),
                     (HOLDS if dis["k"] else DOES_NOT_HOLD) + " (the study: the split occurs; how often depends on "
                     "model and CPU)"))
        flips = cell["label_flips"]
        rows.append(("bf16: correctness labels that differ" + where, str(study.MATCHED_LABEL_FLIPS["bf16"]),
                     _count(flips), (HOLDS if flips["k"] else DOES_NOT_HOLD) + " (the study: some labels differ)"))
        acc = cell.get("accuracy_difference")
        if acc:
            rows.append(_accuracy_row(acc, cell, where, margin))
    fixed = numbers.get("fixed_prefix") or {}
    for precision, expect_split in (("bf16", True), ("fp32", False)):
        cell = fixed.get(precision)
        if not isinstance(cell, dict) or "suffix_disagreements" not in cell:
            continue
        dis = cell["suffix_disagreements"]
        a, b = cell.get("constructions", ["incremental", "prefill"])
        holds = bool(dis["k"]) == expect_split
        why = "disagreements recur" if expect_split else "no suffix differs"
        rows.append((f"fixed-prefix {precision}, {a} vs {b}: suffixes differ{_budget(cell)}" + where,
                     study.fixed_prefix_text(precision), _count(dis),
                     f"{HOLDS if holds else DOES_NOT_HOLD} (the study: {why})"))
    bridge = numbers.get("bridge") or {}
    if isinstance(bridge.get("bit_exact"), dict) and bridge["bit_exact"].get("n"):
        exact = bridge["bit_exact"]
        rows.append(("bridge: incremental cache bit-exact with the live cache" + where,
                     str(study.BRIDGE_BIT_EXACT), f"{exact['k']} / {exact['n']}",
                     HOLDS if exact["k"] == exact["n"] else DOES_NOT_HOLD))
    audit = numbers.get("audit") or {}
    if isinstance(audit.get("reproduced"), dict) and audit["reproduced"].get("n"):
        done = audit["reproduced"]
        rows.append(("saved-ledger audit: every row reproduced" + where,
                     f"{study.AUDIT_TRAJECTORIES} trajectories",
                     f"{done['k']} / {done['n']} ledger rows", HOLDS if done["k"] == done["n"] else DOES_NOT_HOLD))
    transplant = numbers.get("transplant") or {}
    for precision, by_direction in (transplant.get("all_layers") or {}).items():
        n = sum(rate["n"] for rate in by_direction.values())
        donor = sum(rate["donor"] for rate in by_direction.values())
        at = f" {precision}" if len(transplant["all_layers"]) > 1 else ""
        rows.append((f"all-layer transplant{at}: divergent continuations follow their cache donor" + where,
                     study.transplant_text(), _pooled(by_direction) if n else "no divergent item",
                     (HOLDS if donor == n else DOES_NOT_HOLD) if n else NOT_MEASURED))
    return rows


def findings_section(revisions: dict[str, dict], margin: float = DEFAULT_EQUIVALENCE_MARGIN
                     ) -> tuple[list[str], list[dict]]:
    """The "Findings" table of the study's claims from the per-revision numbers of stats.json
    (``stats["revisions"]``), and its record; ``margin`` is the config's ``accuracy_equivalence_margin``."""
    named = len(revisions) > 1
    rows = [row for revision, numbers in revisions.items() for row in revision_rows(revision, numbers, named, margin)]
    if not rows:
        return [], []
    lines = ["## Findings", "",
             "Each claim of the reference study, this run's figure and whether the study's conclusion holds here (the "
             "sections below give every number; intervals are 95%). Counts are compared in kind, not in size: the "
             "study measured another model on other hardware. \"not shown\": the data cannot tell either way.", "",
             *table_head("claim", "reference study", "this run", "holds here")]
    lines += [table_row(*row) for row in rows]
    record = [{"claim": claim, "reference_study": reference, "this_run": figure, "holds": verdict_word(holds)}
              for claim, reference, figure, holds in rows]
    return lines + [""], record


def verdict_word(holds: str) -> str:
    """The record's word for a "holds here" cell: yes, no, not measured or not shown."""
    words = {HOLDS: "yes", DOES_NOT_HOLD: "no", NOT_MEASURED: "not measured", NOT_SHOWN: "not shown"}
    return next(word for start, word in words.items() if holds.startswith(start))


def beyond_study_section(revisions: dict[str, dict], data: dict | None = None) -> tuple[list[str], list[dict]]:
    """The "Beyond the study" table: this run's own headline numbers, each beside its control, one row builder of
    :data:`BEYOND_ROWS` after another, and its record. ``data`` maps a revision to its
    :class:`~stagereplay.analysis.revision_data.RevisionData` (the localisation row reads its transplant table)."""
    named = len(revisions) > 1
    rows = [row for revision, numbers in revisions.items() for build in BEYOND_ROWS
            for row in build(revision, numbers, (data or {}).get(revision), named)]
    if not rows:
        return [], []
    lines = ["## Beyond the study", "",
             "This run's own headline numbers, which the reference study did not measure, each beside the control "
             "that says what it would read without the effect, and what it can and cannot show.", "",
             *table_head("finding", "this run", "control", "what it can and cannot show"),
             *(table_row(*row) for row in rows), ""]
    return lines, [{"finding": f, "this_run": r, "control": c, "reading": w} for f, r, c, w in rows]


BeyondRow = tuple[str, str, str, str]  # (finding, this run, control, what it can and cannot show)


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def _at(revision: str, named: bool) -> str:
    return f" (`{revision}`)" if named else ""


def engine_rows(revision: str, numbers: dict, data, named: bool) -> list[BeyondRow]:
    """Where an engine of the catalogue ran: its own live vs replay splits, beside its replicas and this pipeline's
    split on the same items."""
    rows = []
    for entry in catalogue.ENGINES:
        rows += _engine_rows(entry.words, entry.precision_word, numbers.get(f"engine_{entry.name}") or {}, revision,
                             named)
    return rows


def _engine_rows(label: str, word: str, engine: dict, revision: str, named: bool) -> list[BeyondRow]:
    splits = [s for s in engine.get("splits") or [] if s.get("n")]
    if not splits:
        return []
    replicas = engine.get("replicas") or []
    same, total = sum(int(r["identical"]) for r in replicas), sum(int(r["n"]) for r in replicas)
    rows = []
    # the engine's sides: "<label>, its own stage" and "<label>, reference ids" (a bare label in older stats)
    for cell in (s for s in splits if s["side"] == label or s["side"].startswith(f"{label}, ")):
        pipeline = [s for s in splits if s["side"] == "stagereplay" and s["precision"] == cell["precision"]]
        beside = "; ".join(f"this pipeline's {s['construction_a']} vs {s['construction_b']}: {_count(s)}"
                           for s in pipeline)
        rows.append((f"{label} {cell['construction_a']} vs {cell['construction_b']} ({cell['precision']} {word}): "
                     f"suffixes differ" + _at(revision, named), _count(cell),
                     f"engine replicas bit-identical: {same} / {total}" + (f"; {beside}" if beside else ""),
                     "a split inside one serving engine on the same prefix ids (replicas exact, so not noise); "
                     "it cannot say which engine state matches a real deployment's"))
    return rows


def fidelity_rows(revision: str, numbers: dict, data, named: bool) -> list[BeyondRow]:
    """Per precision: how far each replay construction's next-token distributions lie from live's, with the
    constructions byte-equal with live (the measure's zero) as the control; alike constructions named once."""
    rows = []
    for precision, pairs in (numbers.get("fidelity") or {}).items():
        if not isinstance(pairs, dict) or not pairs:
            continue
        shown, seen = [], set()
        for name, n in pairs.items():
            construction = name.split("_vs_", 1)[1]
            if construction in seen or not isinstance(n, dict) or "items_split" not in n:
                continue
            alike = [construction, *n.get("same_readouts_as", [])]
            seen.update(alike)
            what = ("bit-identical at every step" if n["bit_identical"] else
                    f"KL median {_number(n.get('kl_forward_median'))} nats, items split {n['items_split']['k']} / "
                    f"{n['items_split']['n']}")
            shown.append(f"{' = '.join(f'`{c}`' for c in alike)}: {what}")
        exact = [name.split("_vs_", 1)[1] for name, n in pairs.items() if isinstance(n, dict) and n.get("bit_identical")]
        control = (f"{', '.join(f'`{c}`' for c in exact)} byte-equal with live on every step: the measure reads "
                   "exactly 0 where nothing differs" if exact else
                   "no construction byte-equal with live here: no zero control in this cell")
        rows.append((f"fidelity to live along the suffix, {precision}" + _at(revision, named), "; ".join(shown),
                     control, "how far each replay's distributions lie from live's under live's own tokens; "
                     "teacher-forced, so it cannot say how far free-running suffixes drift"))
    return rows


def association_rows(revision: str, numbers: dict, data, named: bool) -> list[BeyondRow]:
    """Per precision and pair with split items: the boundary margin's association with a later split, beside the
    suffix-length control."""
    rows = []
    for precision, pairs in (numbers.get("fidelity") or {}).items():
        seen: set[str] = set()
        for name, n in (pairs or {}).items():
            block = n.get("split_predictors") if isinstance(n, dict) else None
            construction = name.split("_vs_", 1)[-1]
            if construction in seen or not block or not block.get("cases") or block["margin_boundary"]["auc"] is None:
                continue
            alike = [construction, *n.get("same_readouts_as", [])]
            seen.update(alike)
            name = name.split("_vs_", 1)[0] + "_vs_" + " = ".join(alike)
            margin, length = block["margin_boundary"], block["suffix_length"]
            before = block.get("margin_step_before")
            rows.append((f"split associated with a small live margin before it, {precision} "
                         f"{name.replace('_vs_', ' vs ')}" + _at(revision, named),
                         f"AUC {_auc(margin)} at the boundary"
                         + (f", {_auc(before)} at the step before the split" if before else "")
                         + f" ({block['cases']} split after step 0 vs {block['controls']} unsplit; "
                         f"{block['split_at_boundary_step']} split at step 0 left out)",
                         f"suffix length, scored the same way: AUC {_auc(length)} (0.5: length carries nothing)",
                         "an association across items from what is known before the split (no suffix step "
                         "scored); not a prediction: nothing fitted or held out"))
    return rows


def _auc(r: dict) -> str:
    if r["auc"] is None:
        return "—"
    return f"{r['auc']:.2f}" + (f" [{r['low']:.2f}, {r['high']:.2f}]" if r["low"] is not None else
                                 " (no DeLong interval)")


def localisation_rows(revision: str, numbers: dict, data, named: bool) -> list[BeyondRow]:
    """The localisation net of its placebo: how many partial-transplant rows (precision x direction x part of the
    cache) carry the donor's continuation beyond their placebo, against what chance gives; and the minimal search's
    verdicts. Files written before the placebo control say that it was not run (never a placebo invented)."""
    rows = []
    transplant = numbers.get("transplant") or {}
    sweep = transplant.get("sweep") or []
    if sweep:
        claim = "parts of the cache that carry the divergence beyond their placebo" + _at(revision, named)
        read = transplant.get("localisation_net_of_placebo")
        if read is None:
            rows.append((claim, f"{len(sweep)} partial-transplant row(s), donor arm only",
                         "placebo not run (the transplant file predates the controls)",
                         "without a placebo, following the donor cannot be told apart from what any push of the "
                         "same size does"))
        else:
            tested = sum(n for said, n in read.items() if not said.startswith("no-op"))
            beyond = read.get("carries beyond its placebo", 0)
            noops = sum(n for said, n in read.items() if said.startswith("no-op"))
            rows.append((claim, f"{beyond} of {tested} row(s) (McNemar exact p < 0.05, unadjusted)",
                         f"each row's placebo (the difference shifted within its span), same items and layout; "
                         f"{0.05 * tested:.1f} row(s) expected by chance; {noops} no-op row(s) counted apart",
                         "which parts carry more than a push of their size; not that the others carry nothing "
                         "(few items give little power)"))
    minimal = numbers.get("minimal_transplant") or {}
    cells = [c for by_direction in (minimal.get("cells") or {}).values() for c in by_direction.values()]
    if cells and all(c.get("not_separable") is not None for c in cells):
        n = sum(c["n"] for c in cells)
        localised = sum(c["localised"]["k"] for c in cells)
        tied = sum(c["not_separable"]["k"] for c in cells)
        rows.append(("minimal sufficient transplant" + _at(revision, named),
                     f"localised beyond placebo: {localised} of {n} item-direction(s), pooled over precisions "
                     f"and directions; not separable from its placebo: {tied}",
                     "each box's placebo in the same wave and layout; a box counts only where the donor's bytes "
                     "carry and its placebo does not",
                     "a small part that suffices beyond a push of its size; not a global minimum, not necessity"))
    return rows


def identical_rows(revision: str, numbers: dict, data, named: bool) -> list[BeyondRow]:
    """Fixed-prefix constructions whose boundary caches are byte-identical on every compared item: one result."""
    rows = []
    for precision, cell in (numbers.get("fixed_prefix") or {}).items():
        for group in (cell.get("identical_caches") or []) if isinstance(cell, dict) else ():
            names = " = ".join(f"`{c}`" for c in group["constructions"])
            rows.append((f"{names}, {precision}" + _at(revision, named),
                         f"byte-identical boundary caches on all {group['n']} items",
                         "cache fingerprints (sha256 of the K/V bytes), replicas bit-exact",
                         "one result, not several: counted once; it says nothing of constructions at other "
                         "lengths or on other hardware"))
    return rows


BEYOND_ROWS = [engine_rows, fidelity_rows, localisation_rows, association_rows, identical_rows]
