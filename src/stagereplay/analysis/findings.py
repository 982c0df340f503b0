"""The report's opening summary: each claim of the reference study, this run's figure with its interval, and whether
the study's conclusion holds here, built from the numbers the report writes to ``stats.json`` (nothing recomputed).

"Holds" is the study's qualitative conclusion, never a match of counts: the study measured one 48-layer model on its
GPU, a run measures its own model on its own hardware, so how many items split is the run's own figure (the CPU's
kernels alone change it, docs/NUMERICS.md). Each row says which conclusion it checks. This module knows nothing of
the results files: it reads the dict :func:`stagereplay.analysis.report.build_report` assembles.
"""

from __future__ import annotations

from stagereplay.analysis import study
from stagereplay.analysis.report_format import format_percent, table_head, table_row
from stagereplay.analysis.truncation import budget_stop_caveat

HOLDS, DOES_NOT_HOLD, NOT_MEASURED = "yes", "**no**", "not measured"


def _count(stat: dict | None) -> str:
    """k / n (rate, Wilson 95% interval) of a proportion from stats.json."""
    if not stat or not stat.get("n"):
        return "no item compared"
    return (f"{stat['k']} / {stat['n']} ({format_percent(stat['rate'])}%, Wilson 95% "
            f"[{format_percent(stat['wilson_low'])}, {format_percent(stat['wilson_high'])}]%)")


def _points(value: float) -> str:
    return f"{value * 100:+.1f}"


def _replicas(numbers: dict) -> tuple[int, int]:
    """Replica pairs bit-identical, of all compared, over every experiment, precision and construction."""
    same = total = 0
    for experiment in ("matched", "fixed_prefix"):
        for cell in (numbers.get(experiment) or {}).values():
            for pair in (cell.get("replicas") or {}).values() if isinstance(cell, dict) else ():
                same, total = same + pair["identical"], total + pair["n"]
    return same, total


def revision_rows(revision: str, numbers: dict, named: bool) -> list[tuple[str, str, str, str]]:
    """(claim, reference study, this run, holds) for one revision's numbers; ``named``: the claim names it."""
    rows = []
    where = f" (`{revision}`)" if named else ""
    matched = numbers.get("matched") or {}
    same, total = _replicas(numbers)
    if total:
        rows.append(("replicas on both sides bit-exact" + where, "yes", f"{same} / {total} replica pairs",
                     HOLDS if same == total else DOES_NOT_HOLD))
    cell = matched.get("bf16") if isinstance(matched.get("bf16"), dict) else None
    if cell:
        ref = study.MATCHED_DISAGREEMENTS["bf16"]
        dis = cell["suffix_disagreements"]
        rows.append(("bf16 live vs prefill of identical tokens: suffixes differ" + where, str(ref), _count(dis),
                     (HOLDS if dis["k"] else DOES_NOT_HOLD) + " (the study: the split occurs; how often depends on "
                     "model and CPU)"))
        flips = cell["label_flips"]
        rows.append(("bf16: correctness labels that differ" + where, str(study.MATCHED_LABEL_FLIPS["bf16"]),
                     _count(flips), (HOLDS if flips["k"] else DOES_NOT_HOLD) + " (the study: some labels differ)"))
        acc = cell.get("accuracy_difference")
        if acc:
            includes_zero = acc["bootstrap_low"] <= 0 <= acc["bootstrap_high"]
            rows.append(("bf16: accuracy difference live − prefill, points" + where, study.accuracy_text("bf16"),
                         f"{_points(acc['difference'])}, paired bootstrap 95% CI [{_points(acc['bootstrap_low'])}, "
                         f"{_points(acc['bootstrap_high'])}] (n {acc['n']})"
                         + budget_stop_caveat(cell.get("suffixes_at_max_new_tokens")),
                         HOLDS + " (the interval includes 0: no accuracy difference shown)" if includes_zero
                         else DOES_NOT_HOLD + " (the interval excludes 0)"))
    fixed = numbers.get("fixed_prefix") or {}
    for precision, expect_split in (("bf16", True), ("fp32", False)):
        cell = fixed.get(precision)
        if not isinstance(cell, dict) or "suffix_disagreements" not in cell:
            continue
        dis = cell["suffix_disagreements"]
        a, b = cell.get("constructions", ["incremental", "prefill"])
        holds = bool(dis["k"]) == expect_split
        why = "disagreements recur" if expect_split else "no suffix differs"
        rows.append((f"fixed-prefix {precision}, {a} vs {b}: suffixes differ" + where,
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
    follow = [rate for by_direction in (transplant.get("all_layers") or {}).values()
              for rate in by_direction.values()]
    if follow:
        n = sum(rate["n"] for rate in follow)
        donor = sum(rate["donor"] for rate in follow)
        rows.append(("all-layer transplant: divergent continuations follow their cache donor" + where,
                     study.transplant_text(), f"{donor} / {n} (both directions)" if n else "no divergent item",
                     (HOLDS if donor == n else DOES_NOT_HOLD) if n else NOT_MEASURED))
    return rows


def findings_section(revisions: dict[str, dict]) -> tuple[list[str], list[dict]]:
    """The "Findings" table from the per-revision numbers of stats.json (``stats["revisions"]``), and its record."""
    named = len(revisions) > 1
    rows = [row for revision, numbers in revisions.items() for row in revision_rows(revision, numbers, named)]
    if not rows:
        return [], []
    lines = ["## Findings", "",
             "Each claim of the reference study, this run's figure and whether the study's conclusion holds here (the "
             "sections below give every number; intervals are 95%). Counts are compared in kind, not in size: the "
             "study measured another model on other hardware.", "",
             *table_head("claim", "reference study", "this run", "holds here")]
    lines += [table_row(*row) for row in rows]
    verdict = {HOLDS: "yes", DOES_NOT_HOLD: "no", NOT_MEASURED: "not measured"}
    record = [{"claim": claim, "reference_study": reference, "this_run": figure,
               "holds": next(v for k, v in verdict.items() if holds.startswith(k))}
              for claim, reference, figure, holds in rows]
    return lines + [""], record
