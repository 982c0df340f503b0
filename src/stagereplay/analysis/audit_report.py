"""The saved-ledger audit in the report: the verdict on each revision's ledger (:func:`audit_verdict`, from
audit.parquet, audit_check.json and the ledger), the banner that opens the report with it (:func:`audit_banner`),
and the audit's section (claim 6, :func:`audit_section`)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from stagereplay.analysis import stats, study
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.report_format import count_true, format_ids, table_head, table_row
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.analysis.row_keys import check_unique
from stagereplay.io.keys import LEDGER_KEY, within_revision


AUDIT_KEY = within_revision(LEDGER_KEY)  # an audit row's key in its revision's file


def audit_verdict(data: RevisionData) -> dict:
    """The audit's verdict on one revision's ledger, from audit.parquet, audit_check.json and the ledger.

    ``state``: ``passed`` (every ledger row audited and reproduced, no audit row without a ledger row, and an
    audit_check.json that agrees), ``failed`` (anything else the files show), ``not_run`` (no audit.parquet),
    ``unchecked`` (audit.parquet reproduces everything but audit_check.json, written by rule check_audit only when
    it passes, is absent). ``why`` says it in words.
    """
    if not data.has("ledger"):
        return {"state": "no_ledger", "why": "no ledger"}
    ledger = data.ledger
    if not data.has("audit"):
        return {"state": "not_run", "ledger_rows": len(ledger),
                "why": f"no audit.parquet: none of its {len(ledger)} ledger rows has been recomputed"}
    audit = data.frame("audit")
    check_unique(audit, "audit", ["revision", *AUDIT_KEY])
    key = [k for k in AUDIT_KEY if k in audit.columns and k in ledger.columns]
    ledger_keys = set(map(tuple, ledger[key].astype(str).values.tolist()))
    audit_keys = set(map(tuple, audit[key].astype(str).values.tolist()))
    reproduced = audit["reproduced"].fillna(False).astype(bool)
    not_reproduced = audit[~reproduced]
    not_audited = len(ledger_keys - audit_keys)
    without_ledger_row = audit[[tuple(map(str, k)) not in ledger_keys
                                for k in audit[key].itertuples(index=False, name=None)]]
    invented = int(without_ledger_row["reproduced"].fillna(False).astype(bool).sum())
    rows_ok = int(sum(1 for k, ok in zip(audit[key].astype(str).itertuples(index=False, name=None), reproduced)
                      if ok and tuple(k) in ledger_keys))
    result = {"ledger_rows": len(ledger), "audit_rows": len(audit), "reproduced_rows": rows_ok,
              "not_reproduced_rows": int(len(not_reproduced)), "not_audited_rows": not_audited,
              "audit_rows_without_ledger_row": int(len(without_ledger_row)), "reproduced_without_ledger_row": invented}
    problems = []
    if len(not_reproduced):
        problems.append(f"{len(not_reproduced)} audit row(s) did not reproduce")
    if not_audited:
        problems.append(f"{not_audited} ledger row(s) have no audit record")
    if invented:
        problems.append(f"{invented} audit row(s) marked reproduced have no ledger row")
    check_path = data.paths.get("audit_check")
    check = json.loads(Path(check_path).read_text()) if check_path and Path(check_path).is_file() else None
    result["audit_check"] = check
    if check is not None and (check.get("reproduced") != int(reproduced.sum())
                              or check.get("ledger_rows", len(ledger)) != len(ledger)):
        problems.append(f"audit_check.json records {check.get('reproduced')} reproduced of "
                        f"{check.get('ledger_rows')} ledger rows, but the files on disk hold {int(reproduced.sum())} "
                        f"reproduced audit rows and {len(ledger)} ledger rows (a stale check)")
    if problems:
        return {**result, "state": "failed",
                "why": f"{rows_ok} of {len(ledger)} ledger rows reproduced; " + "; ".join(problems)}
    if check is None:
        return {**result, "state": "unchecked",
                "why": f"audit.parquet reproduces all {len(ledger)} ledger rows, but audit_check.json (rule "
                       "check_audit) is absent: the check has not confirmed it"}
    return {**result, "state": "passed", "why": f"all {len(ledger)} ledger rows recomputed and reproduced"}


def _trajectory_counts(ledger: pd.DataFrame, audit: pd.DataFrame) -> dict:
    """Per precision: retained trajectories (matched ``live`` replica-1 rows, one per item) reproduced; and items
    all of whose ledger rows reproduced."""
    key = [k for k in AUDIT_KEY if k in audit.columns]
    ok = {tuple(map(str, k)) for k, r in zip(audit[key].itertuples(index=False, name=None),
                                            audit["reproduced"].fillna(False).astype(bool)) if r}
    audited = ledger.assign(_ok=[tuple(map(str, k)) in ok for k in ledger[key].itertuples(index=False, name=None)])
    out = {}
    live = audited[(audited["experiment"] == "matched") & (audited["construction"] == "live")
                   & (audited["replica"] == 1)]
    for precision in analysis.sort_precisions(live["precision"]):
        g = live[live["precision"] == precision]
        out[precision] = {"k": int(g["_ok"].sum()), "n": len(g)}
    by_item = audited.groupby("item_index")["_ok"].all()
    return {"trajectories": out, "items": {"k": int(by_item.sum()), "n": int(len(by_item))},
            "rows": {"k": int(audited["_ok"].sum()), "n": len(audited)}}


def audit_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claim 6: the saved-ledger audit, in the study's unit (trajectories) and the ledger's (rows)."""
    audit = data.frame("audit")
    check_unique(audit, "audit", ["revision", *AUDIT_KEY])
    ok = count_true(audit, "reproduced")
    stat = stats.proportion(ok, len(audit))
    lines = ["#### Claim: saved-ledger audit", "",
             "The reference study counts retained trajectories (one per item); the ledger holds one row per item, "
             "experiment, precision, construction and replica. Both are given.", "",
             *table_head("unit", "reference study", "this run")]
    out: dict = {"reproduced": stat}
    ledger = data.ledger if data.has("ledger") else None
    if ledger is not None:
        counts = _trajectory_counts(ledger, audit)
        for precision, c in counts["trajectories"].items():
            ref = str(study.AUDIT_TRAJECTORIES) if precision == "bf16" else "—"
            lines.append(table_row(f"retained trajectories reproduced ({precision}: matched `live`, replica 1)", ref,
                                   f"{c['k']} / {c['n']}"))
        lines.append(table_row("items all of whose ledger rows reproduced", "—",
                               f"{counts['items']['k']} / {counts['items']['n']}"))
        out.update(trajectories={p: stats.proportion(c["k"], c["n"])
                                 for p, c in counts["trajectories"].items()},
                   items=stats.proportion(counts["items"]["k"], counts["items"]["n"]))
    lines.append(table_row("ledger rows reproduced (trajectories and fingerprints)", "— (not counted in rows)",
                           f"{ok} / {len(audit)}"))
    if data.has("ledger"):
        verdict = audit_verdict(data)
        out["verdict"] = {k: v for k, v in verdict.items() if k != "audit_check"}
        extra = []
        if verdict.get("not_audited_rows"):
            extra.append(f"{verdict['not_audited_rows']} ledger row(s) have no audit record")
        if verdict.get("reproduced_without_ledger_row"):
            extra.append(f"{verdict['reproduced_without_ledger_row']} audit row(s) marked reproduced have no "
                         "ledger row")
        if extra:
            lines += ["", "Also: " + "; ".join(extra) + "."]
        check = verdict.get("audit_check")
        lines += ["", "audit_check.json (rule check_audit, written only when every row reproduced): "
                  + (f"present, {check.get('reproduced')} reproduced of {check.get('ledger_rows')} ledger rows."
                     if check else "absent.")]
    bad = audit[~audit["reproduced"].fillna(False).astype(bool)]
    if len(bad):
        keys = [c for c in ("item_id", "experiment", "precision", "construction", "replica") if c in bad.columns]
        lines += ["", "Rows not reproduced: " + format_ids(
            " ".join(str(v) for v in row) for row in bad[keys].itertuples(index=False, name=None))]
    return lines + [""], out


def audit_banner(verdicts: dict[str, dict]) -> list[str]:
    """The report's first lines: the audit's verdict on every revision that has a ledger."""
    failed = {r: v for r, v in verdicts.items() if v["state"] == "failed"}
    unchecked = {r: v for r, v in verdicts.items() if v["state"] in ("not_run", "unchecked")}
    lines = []
    if failed:
        lines += ["> **AUDIT FAILED.** " + " ".join(f"Revision `{r}`: {v['why']}." for r, v in failed.items())
                  + " The ledger could not be recomputed from the model, the items and its own ids: the numbers "
                  "below are not results. Fix the audit's findings (audit.parquet) before citing anything here.", ""]
    if unchecked:
        lines += ["> **Audit not confirmed.** " + " ".join(f"Revision `{r}`: {v['why']}." for r, v in
                                                          unchecked.items())
                  + " Nothing below from those revisions has been checked against a recomputation.", ""]
    passed = [r for r, v in verdicts.items() if v["state"] == "passed"]
    if passed:
        lines += ["Audit: " + " ".join(f"revision `{r}`: {verdicts[r]['why']} (audit_check.json)." for r in passed),
                  ""]
    return lines


def verdicts_json(verdicts: dict[str, dict]) -> dict:
    return {r: {k: v for k, v in verdict.items() if k != "audit_check"} for r, verdict in verdicts.items()}
