"""The Markdown report and stats.json, built from the results files alone (no model is loaded).

Every sentence of the report is built from the run's own files: the audit's verdict first (a failed audit is the
first thing the report says), then what produced the run (model, dataset, budgets, boundary, seed, regimes, code
and software, from the provenance the files record; "not recorded" where they record nothing), then per revision
one table per claim of the reference study with the study's figure beside this run's, then what the study did not
measure (margins at the divergence, per-layer cache differences, the transplant localisation, batch invariance),
the items excluded and why, and the figures with their captions. The reference study's numbers come from
:mod:`stagereplay.analysis.study` alone and are labelled as the study's wherever they appear. Every number of the
run is in ``stats.json`` with its n, method and seed.

Sections are functions of :class:`RevisionData` listed in :data:`SECTIONS` with the inputs they need. A section
whose input is declared for a revision but not on disk yet is skipped with a note; one whose input can never exist
at that revision (a revision with transplant results only has no ledger) is left out. To add a section, write
``def my_section(data: RevisionData) -> tuple[list[str], dict]`` and append it to :data:`SECTIONS`.

This module imports no engine code: it reads Parquet and JSON files through :mod:`stagereplay.io` only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from stagereplay.analysis import captions, study
from stagereplay.analysis import stats
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.inputs import merge_inputs
from stagereplay.io.parquet import CONTENT_KEY, read_parquet, read_provenance, write_text_atomic
from stagereplay.io.provenance import git_commit, recorded_batch_plan

# Where each kind of input comes from, for the note of a section whose input is not there yet.
PRODUCERS = {
    "ledger": "ledger.parquet (rule gather_ledger)",
    "bridge": "bridge.parquet (the bridge rule)",
    "audit": "audit.parquet (rule audit_ledger)",
    "transplant": "transplant.parquet (the transplant stage)",
    "cache_differences": "cache_differences.parquet (rule measure_cache_differences)",
    "batch_invariance": "batch_invariance.parquet (rule check_batch_invariance)",
}
NOT_RECORDED = "not recorded"


def compare_constructions(ledger: pd.DataFrame, experiment: str, a: str, b: str) -> pd.DataFrame:
    """One row per (item, precision): replica 1 of construction ``a`` against replica 1 of ``b``; the columns of
    :func:`tables.pair_table` with the margins and labels named after the constructions (``margin_live``...)."""
    pairs = analysis.pair_table(ledger, experiment, a, b)
    return pairs.rename(columns={"margin_a": f"margin_{a}", "margin_b": f"margin_{b}",
                                 "correct_a": f"correct_{a}", "correct_b": f"correct_{b}"})


def _fmt_prop(p: dict) -> str:
    if p["n"] == 0:
        return "0 / 0"
    return (f"{p['k']} / {p['n']} ({100 * p['rate']:.1f}%, Wilson 95% "
            f"[{100 * p['wilson_low']:.1f}, {100 * p['wilson_high']:.1f}])")


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def _fmt_acc(acc: dict) -> str:
    return (f"{_pct(acc['accuracy_a'])}% / {_pct(acc['accuracy_b'])}%, {_pct(acc['difference'], True)} points, "
            f"paired bootstrap 95% CI [{_pct(acc['bootstrap_low'], True)}, {_pct(acc['bootstrap_high'], True)}], "
            f"exact McNemar p = {acc['mcnemar_p']:.3g} ({acc['discordant_a_only']} vs {acc['discordant_b_only']} "
            "discordant)")


def _int(value) -> str:
    """An integer column value that pandas may have read as a float (nullable ints), or a dash."""
    return "—" if value is None or pd.isna(value) else str(int(value))


def _ids(values, limit: int = 30) -> str:
    values = [f"`{v}`" for v in values]
    return ", ".join(values[:limit]) + (f" ... ({len(values)} in all)" if len(values) > limit else "")


def _count(frame: pd.DataFrame, column: str) -> int:
    """True values of a boolean column that may hold nulls (a null is not True)."""
    return int(frame[column].fillna(False).astype(bool).sum()) if len(frame) else 0


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


@dataclass
class RevisionData:
    """One revision's results files, read on first use; a kind whose file is absent reads as None."""

    revision: str
    paths: dict[str, str]
    seed: int = 0
    _frames: dict = field(default_factory=dict, repr=False)

    def has(self, kind: str) -> bool:
        if self._frames.get(kind) is not None:
            return True
        path = self.paths.get(kind)
        return bool(path) and Path(path).is_file()

    def declared(self, kind: str) -> bool:
        """Whether this revision is meant to have ``kind`` (its path was declared or its file found)."""
        return self.paths.get(kind) is not None or self._frames.get(kind) is not None

    def frame(self, kind: str) -> pd.DataFrame | None:
        if kind not in self._frames:
            self._frames[kind] = read_parquet(self.paths[kind]) if self.has(kind) else None
        return self._frames[kind]

    def provenance(self, kind: str) -> dict:
        path = self.paths.get(kind)
        return read_provenance(path) if path and Path(path).is_file() else {}

    @property
    def ledger(self) -> pd.DataFrame:
        return self.frame("ledger")

    @property
    def pairs(self) -> pd.DataFrame:
        if "pairs" not in self._frames:
            self._frames["pairs"] = analysis.all_pairs(self.ledger)
        return self._frames["pairs"]

    @property
    def coinciding(self) -> dict:
        """(revision, precision) cells where the fixed-prefix rows repeat the matched rows (shown once)."""
        if "coinciding" not in self._frames:
            self._frames["coinciding"] = analysis.coinciding_comparisons(self.ledger)
        return self._frames["coinciding"]


def _seeded(stat: dict, seed: int) -> dict:
    """A statistic as stats.json holds it: n and method from :mod:`stats`, and the run's seed where none applies."""
    return {**stat, "seed": stat.get("seed", seed)}


def _pair_statistics(cmp: pd.DataFrame, seed: int) -> tuple[dict, dict, dict | None]:
    """Suffix disagreements, label flips and the paired accuracy difference of one comparison table."""
    n = len(cmp)
    dis = _seeded(stats.proportion(int(cmp["disagree"].sum()), n), seed)
    flips = _seeded(stats.proportion(int(cmp["label_differs"].sum()), n), seed)
    acc = (stats.paired_accuracy_difference(cmp["correct_a"].tolist(), cmp["correct_b"].tolist(), seed=seed)
           if n else None)
    return dis, flips, acc


def _replica_rows(data: RevisionData, experiment: str) -> tuple[list[str], dict]:
    rep = analysis.replica_agreement(data.ledger)
    rep = rep[rep["experiment"] == experiment]
    lines, out = [], {}
    for r in rep.itertuples(index=False):
        out.setdefault(r.precision, {})[r.construction] = {
            "n": int(r.n), "identical": int(r.identical), "seed": data.seed,
            "method": "replica pairs compared on stage ids, cache fingerprint and suffix fingerprint (sha256 bytes)"}
        ref = ("all exact" if study.REPLICAS_EXACT.get(r.precision) else "—") if experiment == "matched" else "—"
        lines.append(f"| {r.precision} | {r.construction} | {ref} | {r.identical} / {r.n} bit-identical |")
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
              "| precision | construction | reference study | this run: replica pairs |", "| --- | --- | --- | --- |",
              *rep_lines, ""]
    claim2 = ["#### Claim: live cache vs one-shot prefill of identical tokens, suffixes that differ", "",
              "| precision | reference study | this run |", "| --- | --- | --- |"]
    claim3 = ["#### Claim: correctness labels that differ, and the accuracy difference (live − prefill)", "",
              "| precision | | reference study | this run |", "| --- | --- | --- | --- |"]
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
                          "first_divergence": _seeded(stats.first_divergence_summary(
                              cmp.loc[cmp["disagree"], "first_divergence"].tolist()), seed)}
        ref_dis = study.MATCHED_DISAGREEMENTS.get(precision)
        ref_flips = study.MATCHED_LABEL_FLIPS.get(precision)
        claim2.append(f"| {precision} | {ref_dis if ref_dis else '—'} | {_fmt_prop(dis)} |")
        claim3.append(f"| {precision} | labels that differ | {ref_flips if ref_flips else '—'} | "
                      f"{_fmt_prop(flips)} |")
        claim3.append(f"| {precision} | accuracy live / prefill, difference | "
                      f"{study.accuracy_text(precision) if precision in study.MATCHED_ACCURACY else '—'} | "
                      f"{_fmt_acc(acc) if acc else 'no compared items'} |")
    counts = "; ".join(f"{p}: {v['n_items']} items, {v['n_compared']} compared" for p, v in out.items())
    lines = [f"Items per precision: {counts} (exclusions listed below).", "", *claim1, *claim2, "", *claim3, ""]
    return lines, out


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
    out: dict = {}
    lines = header + [
        "| precision | reference study: suffixes that differ | this run: incremental vs prefill, suffixes that "
        "differ | Wilson 95% upper bound | labels that differ | accuracy incremental / prefill, difference "
        "(incremental − prefill) | first divergence (median [IQR]) |",
        "| --- | --- | --- | --- | --- | --- | --- |"]
    for precision in analysis.sort_precisions(fixed["precision"]):
        cmp = pairs[pairs["precision"] == precision]
        n = len(cmp)
        dis, flips, acc = _pair_statistics(cmp, seed)
        fd = _seeded(stats.first_divergence_summary(cmp.loc[cmp["disagree"], "first_divergence"].tolist()), seed)
        nonfinite = fixed[(fixed["precision"] == precision) & (fixed["status"] == "nonfinite")]
        same = data.coinciding.get((data.revision, precision))
        out[precision] = {"n_compared": n, "suffix_disagreements": dis, "label_flips": flips,
                          "accuracy_difference": acc, "first_divergence": fd, "replicas": rep.get(precision, {}),
                          "nonfinite_rows": int(len(nonfinite)),
                          "nonfinite_items": int(nonfinite["item_index"].nunique()),
                          "same_rows_as_matched": bool(same)}
        fd_text = f"{fd['median']:g} [{fd['q1']:g}, {fd['q3']:g}] (n={fd['n']})" if fd["n"] else "—"
        mark = " (= matched)" if same else ""
        lines.append(f"| {precision}{mark} | {study.fixed_prefix_text(precision)} | {_fmt_prop(dis)} | "
                     f"{_pct(dis['wilson_high'])}% | {_fmt_prop(flips)} | "
                     f"{_fmt_acc(acc) if acc else 'no compared items'} | {fd_text} |")
    shared = [p for p in out if out[p]["same_rows_as_matched"]]
    if shared:
        lines += ["", f"(= matched): at {_join(shared)}, the fixed-prefix rows repeat the matched experiment's rows "
                  "item for item (the same cache and suffix fingerprints on both sides, the same margins): that cell "
                  "is the matched comparison again, not a second measurement, and the margin test and figures 2 and "
                  "3 count it once, as matched."]
    overflowed = {p: v["nonfinite_rows"] for p, v in out.items() if v["nonfinite_rows"]}
    if overflowed:
        lines += ["", "Rows with non-finite logits (marked `nonfinite`, never compared): " + ", ".join(
            f"{p}: {k} rows of {out[p]['nonfinite_items']} items" for p, k in overflowed.items()) + "."]
    lines += ["", "Replicas of each cell:", "", "| precision | construction | reference study | this run: replica pairs |",
              "| --- | --- | --- | --- |", *rep_lines, ""]
    return lines, out


def _bridge_reading(groups: list[tuple[str, pd.DataFrame]]) -> list[str]:
    """What this run's bridge rows show, in sentences built from their counts."""
    if not groups or all(len(g) == 0 for _, g in groups):
        return ["No bridge row reached the boundary: there is no cache to compare."]
    inc = [(p, _count(g, "bit_exact"), len(g)) for p, g in groups]
    words = _join([f"{k} / {n} rows in {p}" for p, k, n in inc])
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
        pre = [(p, _count(g, "prefill_bit_exact"), len(g)) for p, g in groups]
        same = [p for p, k, n in pre if n and k == n]
        differ = [p for p, k, n in pre if n and k == 0]
        some = [(p, k, n) for p, k, n in pre if n and 0 < k < n]
        parts = []
        if same:
            parts.append(f"equals the live cache on every row in {_join(same)}: in this run's regime the one-shot "
                         "construction does not change the cache there")
        if differ:
            parts.append(f"differs from the live cache on every row in {_join(differ)}")
        if some:
            parts.append("equals it on " + _join([f"{k} / {n} rows in {p}" for p, k, n in some]))
        lines.append("The contrast, a one-shot `prefill` of the same ids (one forward pass, other matrix shapes), "
                     + "; ".join(parts) + ".")
    return [" ".join(lines)]


def bridge_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claim 5: the bridge, token-by-token incremental cache against the retained live cache."""
    bridge = data.frame("bridge")
    analysis.check_unique(bridge, "bridge")
    no_boundary = 0
    if "status" in bridge.columns:  # rows whose item never reached the boundary have no cache to compare
        no_boundary = int((bridge["status"] != "ok").sum())
        bridge = bridge[bridge["status"] == "ok"]
    exact = _count(bridge, "bit_exact")
    stat = _seeded(stats.proportion(exact, len(bridge)), data.seed)
    # one column per precision: the bridge is a claim about each precision's caches, not about their sum
    groups = ([(str(p), g) for p, g in bridge.groupby("precision", sort=True)]
              if "precision" in bridge.columns and len(bridge) else [("this run", bridge)])
    by_precision = {name: _seeded(stats.proportion(_count(g, "bit_exact"), len(g)), data.seed)
                    for name, g in groups if name != "this run"}

    def row(label: str, reference: str, column: str) -> str:
        counts = " | ".join(f"{_count(g, column)} / {len(g)}" for _, g in groups)
        return f"| {label} | {reference} | {counts} |"

    lines = ["#### Claim: bridge, token-by-token incremental cache vs retained live cache", "",
             "| | reference study | " + " | ".join(name for name, _ in groups) + " |",
             "| --- | --- | " + " | ".join("---" for _ in groups) + " |",
             row("rows bit-exact (every layer's K and V bytes)", str(study.BRIDGE_BIT_EXACT), "bit_exact")]
    if "suffix_equal" in bridge.columns:
        lines.append(row("continuations identical", "—", "suffix_equal"))
    if "prefill_bit_exact" in bridge.columns:
        lines.append(row("contrast: one-shot prefill bit-exact with live", "—", "prefill_bit_exact"))
    bad = bridge[~bridge["bit_exact"].fillna(False).astype(bool)]
    if len(bad):
        lines += ["", "Rows that are not bit-exact:", "", "| item | precision | first layer | component | first position |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| `{r.item_id}` | {r.precision} | {_int(r.first_layer_differs)} | {r.component_differs} | "
                  f"{_int(r.first_position_differs)} |" for r in bad.itertuples(index=False)]
    if no_boundary:
        lines += ["", f"{no_boundary} bridge row(s) drawn for items that never reached the boundary are not counted."]
    lines += [""] + _bridge_reading([g for g in groups])
    plan = recorded_batch_plan(data.paths["bridge"]) if data.paths.get("bridge") and data.has("bridge") else None
    if plan is not None:
        lines += ["", f"Batched run (batch size {plan['batch_size']}, plan seed {plan['seed']}): each live row is "
                  "compared with the incremental rebuild in its own recorded batch (stage ids teacher-forced in the "
                  "live run's lockstep schedule, rows without a boundary fed padding); the prefill contrast is the "
                  "row's batched one-shot prefill."]
    return lines + [""], {"bit_exact": stat, "bit_exact_by_precision": by_precision,
                          "not_bit_exact_items": [str(i) for i in bad["item_id"]],
                          "prefill_bit_exact_by_precision": {
                              name: _seeded(stats.proportion(_count(g, "prefill_bit_exact"), len(g)), data.seed)
                              for name, g in groups if name != "this run" and "prefill_bit_exact" in g.columns},
                          "batch_plan": None if plan is None else {k: plan[k] for k in ("seed", "batch_size")}}


# ---------------------------------------------------------------------------------------------------------- audit

AUDIT_KEY = ["item_index", "experiment", "precision", "construction", "replica"]


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
    analysis.check_unique(audit, "audit", ["revision", *AUDIT_KEY])
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
    analysis.check_unique(audit, "audit", ["revision", *AUDIT_KEY])
    ok = _count(audit, "reproduced")
    stat = _seeded(stats.proportion(ok, len(audit)), data.seed)
    lines = ["#### Claim: saved-ledger audit", "",
             "The reference study counts retained trajectories (one per item); the ledger holds one row per item, "
             "experiment, precision, construction and replica. Both are given.", "",
             "| unit | reference study | this run |", "| --- | --- | --- |"]
    out: dict = {"reproduced": stat}
    ledger = data.ledger if data.has("ledger") else None
    if ledger is not None:
        counts = _trajectory_counts(ledger, audit)
        for precision, c in counts["trajectories"].items():
            ref = str(study.AUDIT_TRAJECTORIES) if precision == "bf16" else "—"
            lines.append(f"| retained trajectories reproduced ({precision}: matched `live`, replica 1) | {ref} | "
                         f"{c['k']} / {c['n']} |")
        lines.append(f"| items all of whose ledger rows reproduced | — | {counts['items']['k']} / "
                     f"{counts['items']['n']} |")
        out.update(trajectories={p: _seeded(stats.proportion(c["k"], c["n"]), data.seed)
                                 for p, c in counts["trajectories"].items()},
                   items=_seeded(stats.proportion(counts["items"]["k"], counts["items"]["n"]), data.seed))
    lines.append(f"| ledger rows reproduced (trajectories and fingerprints) | — (not counted in rows) | "
                 f"{ok} / {len(audit)} |")
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
        lines += ["", f"audit_check.json (rule check_audit, written only when every row reproduced): "
                  + (f"present, {check.get('reproduced')} reproduced of {check.get('ledger_rows')} ledger rows."
                     if check else "absent.")]
    bad = audit[~audit["reproduced"].fillna(False).astype(bool)]
    if len(bad):
        keys = [c for c in ("item_id", "experiment", "precision", "construction", "replica") if c in bad.columns]
        lines += ["", "Rows not reproduced: " + _ids(
            " ".join(str(v) for v in row) for row in bad[keys].itertuples(index=False, name=None))]
    return lines + [""], out


# ----------------------------------------------------------------------------------------------------- transplant

def _all_layer_rows(transplant: pd.DataFrame) -> pd.DataFrame:
    sel = transplant[(transplant["layer_set"] == "all") & (transplant["component"] == "kv")]
    if "positions" in sel.columns:
        sel = sel[sel["positions"] == "all"]
    return sel


def _divergent(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["divergent"].fillna(False).astype(bool)] if "divergent" in frame.columns else frame


def transplant_section(data: RevisionData) -> tuple[list[str], dict]:
    """Claim 7 and the localisation sweep beyond the study.

    Handing the recipient the donor's whole boundary state makes it the donor's state, so the all-layer transplant
    is a check of the construction (and of the two caches' layout parity), not a discovery: the report says so and
    puts the localisation (layer bands, K or V alone, position ranges) first, as the informative part. Rates count
    divergent items only (the two constructions' own continuations differ): a non-divergent item has no donor to
    tell apart from its recipient."""
    transplant = data.frame("transplant")
    analysis.check_unique(transplant, "transplant")
    matrix = analysis.transplant_matrix(transplant)
    if matrix.empty:
        n_items = int(transplant["item_index"].nunique()) if len(transplant) else 0
        return ["#### Transplants", "",
                f"_No divergent item to transplant: {n_items} item(s) were transplanted and on none do the two "
                "constructions' own continuations differ, so following the donor cannot be told apart from "
                "following the recipient._", "",
                f"Reference study (all {study.LAYERS} K/V layers): {study.transplant_text()}.", ""], {
            "n_items": n_items, "n_divergent": 0}
    full = matrix[(matrix["layer_set"] == "all") & (matrix["component"] == "kv") & (matrix["positions"] == "all")]
    rest = matrix.drop(full.index)
    out: dict = {"all_layers": {}, "sweep": []}
    lines: list[str] = []
    n_div = int(_divergent(transplant)["item_index"].nunique())
    constructions = sorted(set(transplant["donor"]) | set(transplant["recipient"])) if "donor" in transplant else []
    lines += [f"{n_div} divergent item(s) of {transplant['item_index'].nunique()} transplanted"
              + (f", between `{constructions[0]}` and `{constructions[1]}`" if len(constructions) == 2 else "")
              + ", each in both directions.", ""]
    if len(rest):
        lines += ["#### Localisation: which part of the cache carries the divergence (beyond the study)", "",
                  "Share of divergent continuations that follow the donor when only part of its boundary cache is "
                  "handed over.", "",
                  "| precision | layers · component · positions | direction | follows donor | recipient | neither | "
                  "Wilson 95% |", "| --- | --- | --- | --- | --- | --- | --- |"]
        ordered = sorted(rest.itertuples(index=False), key=lambda r: (r.precision, analysis.transplant_row_key(r),
                                                                      r.direction))
        for r in ordered:
            lines.append(f"| {r.precision} | {r.label} | {r.direction} | {r.donor} / {r.n} | {r.recipient} | "
                         f"{r.neither} | [{_pct(r.wilson_low)}, {_pct(r.wilson_high)}]% |")
            out["sweep"].append({"precision": r.precision, "layer_set": r.layer_set, "component": r.component,
                                 "positions": r.positions, "direction": r.direction, "n": int(r.n),
                                 "donor": int(r.donor), "recipient": int(r.recipient), "neither": int(r.neither),
                                 "seed": data.seed, "method": "outcome counts; wilson interval on the donor share",
                                 "follows_donor": stats.proportion(int(r.donor), int(r.n))})
        by_label = rest.groupby("label", sort=False).agg(donor=("donor", "sum"), n=("n", "sum"))
        carries = [label for label, r in by_label.iterrows() if r["n"] and r["donor"] == r["n"]]
        never = [label for label, r in by_label.iterrows() if r["n"] and r["donor"] == 0]
        partial = [label for label in by_label.index if label not in carries and label not in never]
        reading = []
        if carries:
            reading.append(f"Partial transplants carrying the donor's continuation on every divergent row, both "
                           f"directions: {_join(carries)}.")
        else:
            reading.append("No partial transplant carries the donor's continuation on every divergent row.")
        if never:
            reading.append(f"Carrying it on no row: {_join(never)}.")
        if partial:
            reading.append(f"Carrying it on some rows only: {_join(partial)}.")
        lines += ["", " ".join(reading), ""]
    lines += ["#### Claim: bidirectional transplant of all K/V layers (a consistency check)", "",
              "The boundary state is the whole decoder state (docs/STUDY.md), so handing the recipient the donor's K "
              "and V at every layer and position makes its cache the donor's cache: following the donor is what the "
              "construction guarantees. The all-layer transplant checks the construction and that the two caches "
              "are laid out alike; it is not a finding about the model.", "",
              f"Reference study (all {study.LAYERS} K/V layers): {study.transplant_text()}.", "",
              "| precision | direction | this run: follows donor | recipient | neither | transplanted cache = donor's "
              "cache (fingerprint) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in full.itertuples(index=False):
        sel = _divergent(_all_layer_rows(transplant[(transplant["precision"] == r.precision)
                                                    & (transplant["direction"] == r.direction)]))
        out["all_layers"].setdefault(r.precision, {})[r.direction] = _seeded(
            stats.follow_rate(sel["outcome"].tolist()), data.seed)
        parity = "—"
        if {"cache_fingerprint", "donor_cache_fingerprint"} <= set(sel.columns):
            both = sel[sel["cache_fingerprint"].notna() & sel["donor_cache_fingerprint"].notna()]
            equal = int((both["cache_fingerprint"] == both["donor_cache_fingerprint"]).sum())
            parity = f"{equal} / {len(both)}"
            out["all_layers"][r.precision][r.direction]["cache_equals_donor"] = {"k": equal, "n": len(both)}
        lines.append(f"| {r.precision} | {r.direction} | {r.donor} / {r.n} | {r.recipient} | {r.neither} | {parity} |")
    if full.empty:
        lines.append("| — | — | no all-layer K/V transplant over all positions in this file | | | |")
    whole = _divergent(_all_layer_rows(transplant))
    whole = whole[whole["outcome"] != "donor"]
    out["all_layer_misses"] = [f"{r.item_id} {r.direction} ({r.outcome})" for r in whole.itertuples(index=False)]
    if len(whole):
        lines += ["", "**Finding:** all-layer transplants that did not follow their donor, although the transplanted "
                  "cache should be the donor's whole state (a fault of the construction or of the layout): "
                  + ", ".join(f"`{m}`" for m in out["all_layer_misses"])]
    if "live_fingerprint_match" in transplant.columns:
        match = transplant.drop_duplicates("item_index")["live_fingerprint_match"]
        known = match.dropna()
        if len(known):  # null where the baseline has no live row (a revision without a ledger of its own)
            lines += ["", f"The rebuilt `incremental` cache equals the ledger's live cache fingerprint for "
                      f"{int(known.astype(bool).sum())} / {len(known)} items (those are labelled `live`)."]
            out["live_fingerprint_match"] = {"k": int(known.astype(bool).sum()), "n": int(len(known))}
    return lines + [""], out


def margins_section(data: RevisionData) -> tuple[list[str], dict]:
    """Beyond the study: are first divergences near-ties? One paired value per item, tested across items."""
    skip = {(revision, "fixed_prefix", precision) for revision, precision in data.coinciding}
    margins = analysis.margin_pairs(data.ledger, data.pairs, skip=skip)
    if margins.empty:
        return ["_No disagreeing suffixes: no margin at a first divergence to report._", ""], {}
    lines = ["Per disagreeing item, the reference construction's (live or incremental) top-2 logit margin at the "
             "first divergence against the median of its margins at the other decode steps of the same suffix (the "
             "divergence step left out). Items are the unit: one paired value each, tested across items with an "
             "exact one-sided sign test (figure 3).", "",
             "| experiment | precision | items | median margin at divergence | median of the items' other-step "
             "medians | items below their own median | median within-item percentile | sign test p (divergence "
             "< item median) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    out: dict = {}
    for (experiment, precision), g in margins.groupby(["experiment", "precision"], sort=True):
        test = _seeded(stats.divergence_margin_test(
            list(zip(g["margin_divergence"], g["other_margins"]))), data.seed)
        out.setdefault(experiment, {})[precision] = test
        if not test["n"]:
            continue
        p = "—" if test["sign_test_p_less"] is None else f"{test['sign_test_p_less']:.3g}"
        lines.append(f"| {experiment} | {precision} | {test['n']} | {test['median_divergence']:.3g} | "
                     f"{test['median_of_item_medians']:.3g} | {test['below_item_median']} / {test['n']} "
                     f"({test['n_ties']} ties) | {_pct(test['median_within_item_percentile'])}% | {p} |")
    dropped = sorted({p for _, p in data.coinciding})
    if dropped:
        lines += ["", f"Fixed-prefix {_join(dropped)} is not tested again: its rows are the matched rows "
                  "(see the fixed-prefix 2x2)."]
    return lines + [""], out


def cache_differences_section(data: RevisionData) -> tuple[list[str], dict]:
    """Beyond the study: where in the cache the constructions differ (figure 4)."""
    profile = analysis.cache_difference_profile(data.frame("cache_differences"))
    if profile.empty:
        return ["_cache_differences.parquet holds no rows._", ""], {}
    lines = ["Incremental vs prefill boundary caches rebuilt from identical prefix ids for a seeded sample of "
             "items (figure 4).", "",
             "| precision | component | items | layers bit-identical in every item | first layer that differs | "
             "items whose last layer differs | largest max-abs difference | median RMS at the last layer, items that "
             "differ |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    out: dict = {}
    for (precision, component), g in profile.groupby(["precision", "component"], sort=True):
        g = g.sort_values("layer")
        same = g[g["n_differ"] == 0]["layer"].tolist()
        differs = g[g["n_differ"] > 0]["layer"].tolist()
        last = g.iloc[-1]
        out.setdefault(precision, {})[component] = {
            "n": int(g["n"].max()), "layers_bit_identical": [int(x) for x in same],
            "first_layer_differs": int(differs[0]) if differs else None, "max_abs": float(g["max_abs_max"].max()),
            "items_differing_per_layer": [int(x) for x in g["n_differ"]],
            "rms_median_of_differing_per_layer": [None if pd.isna(x) else float(x) for x in g["rms_median"]],
            "seed": data.seed,
            "method": "per-layer byte comparison, max-abs and RMS of the difference (fp64) over a seeded item sample"}
        rms = "—" if pd.isna(last["rms_median"]) else f"{last['rms_median']:.3g}"
        lines.append(f"| {precision} | {component.upper()} | {int(g['n'].max())} | {len(same)} / {len(g)} | "
                     f"{differs[0] if differs else '—'} | {int(last['n_differ'])} / {int(last['n'])} | "
                     f"{g['max_abs_max'].max():.3g} | {rms} |")
    return lines + [""], out


def _filled(frame: pd.DataFrame, column: str) -> pd.Series:
    if column not in frame.columns:
        return pd.Series(False, index=frame.index)
    return frame[column].notna() & (frame[column].astype(str) != "")


def batch_invariance_section(data: RevisionData) -> tuple[list[str], dict]:
    """Batching as a construction factor (beyond the study): sampled items rerun alone against their batched rows.

    Only rows with something to compare are counted: cache comparisons need a boundary-cache fingerprint on both
    sides, suffix and label comparisons status ``ok`` on both; the rows that had not are counted apart."""
    table = data.frame("batch_invariance")
    analysis.check_unique(table, "batch_invariance")
    prov = data.provenance("batch_invariance")
    control = prov.get("batch_invariance") or {}
    if control.get("status") == "not_applicable" or table.empty:
        reason = control.get("reason", "the control compared no rows")
        return [f"_Nothing to compare: {reason}._", ""], {"status": control.get("status", "empty"), "reason": reason}
    plan = prov.get("batch_plan") or {}
    lines = [f"A seeded sample of {table['item_index'].nunique()} items, each rerun alone (batch 1, the same decode "
             f"regime and precision) against its row in the recorded batch plan (batch size "
             f"{plan.get('batch_size', NOT_RECORDED)}, plan seed {plan.get('seed', NOT_RECORDED)}). Batch "
             "composition is a construction factor: a difference is a finding, not an error. Only rows with "
             "something to compare are counted: boundary caches where both sides have one, ids and labels where "
             "both sides have status ok.", "",
             "| precision | construction | rows | boundary caches identical | rows with no cache on a side | stage + "
             "suffix ids identical | labels identical | rows not ok on a side | first divergence (median [IQR]) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    out: dict = {"status": "compared", "batch_size": plan.get("batch_size"), "plan_seed": plan.get("seed")}
    for precision in analysis.sort_precisions(table["precision"]):
        for construction in sorted(table.loc[table["precision"] == precision, "construction"].unique()):
            g = table[(table["precision"] == precision) & (table["construction"] == construction)]
            with_cache = g[_filled(g, "cache_fingerprint_batched") & _filled(g, "cache_fingerprint_alone")]
            if {"status_batched", "status_alone"} <= set(g.columns):
                both_ok = g[(g["status_batched"] == "ok") & (g["status_alone"] == "ok")]
            else:
                both_ok = g
            counts = {"cache_equal": _seeded(stats.proportion(_count(with_cache, "cache_equal"), len(with_cache)),
                                             data.seed),
                      "suffix_equal": _seeded(stats.proportion(_count(both_ok, "suffix_equal"), len(both_ok)),
                                              data.seed),
                      "label_equal": _seeded(stats.proportion(_count(both_ok, "label_equal"), len(both_ok)),
                                             data.seed)}
            fd = stats.first_divergence_summary([int(x) for x in both_ok["first_divergence"].dropna()])
            out.setdefault(precision, {})[construction] = {
                **counts, "first_divergence": fd, "n": len(g), "n_without_cache": len(g) - len(with_cache),
                "n_not_ok": len(g) - len(both_ok)}
            fd_text = f"{fd['median']:g} [{fd['q1']:g}, {fd['q3']:g}] (n={fd['n']})" if fd["n"] else "—"
            lines.append(f"| {precision} | {construction} | {len(g)} | {_fmt_prop(counts['cache_equal'])} | "
                         f"{len(g) - len(with_cache)} | {_fmt_prop(counts['suffix_equal'])} | "
                         f"{_fmt_prop(counts['label_equal'])} | {len(g) - len(both_ok)} | {fd_text} |")
    return lines + [""], out


def exclusions_section(data: RevisionData) -> tuple[list[str], dict]:
    """Items left out of the comparisons, and why."""
    excluded = analysis.exclusions(data.ledger)
    if excluded.empty:
        return ["No item was excluded: every item has status ok on both constructions of every comparison.", ""], {
            "n": 0, "items": []}
    lines = ["| item | experiment | precision | reason |", "| --- | --- | --- | --- |"]
    lines += [f"| `{r.item_id}` | {r.experiment} | {r.precision} | {r.reason} |"
              for r in excluded.itertuples(index=False)]
    items = [{"item_id": str(r.item_id), "experiment": r.experiment, "precision": r.precision, "reason": r.reason}
             for r in excluded.itertuples(index=False)]
    return lines + [""], {"n": len(items), "items": items}


@dataclass
class Section:
    key: str  # key in stats.json
    title: str | None  # a heading of its own, or None when the section brings its claim headings
    needs: tuple[str, ...]  # kinds of input files it reads
    build: Callable[[RevisionData], tuple[list[str], dict]]


SECTIONS: list[Section] = [
    Section("matched", "### Matched experiment (live vs prefill)", ("ledger",), matched_section),
    Section("fixed_prefix", "### Fixed-prefix 2x2", ("ledger",), fixed_prefix_section),
    Section("bridge", "### Bridge", ("bridge",), bridge_section),
    Section("audit", "### Saved-ledger audit", ("audit",), audit_section),
    Section("transplant", "### Transplants", ("transplant",), transplant_section),
    Section("margins", "### Margins at the first divergence (beyond the study)", ("ledger",), margins_section),
    Section("cache_differences", "### Per-layer cache differences (beyond the study)", ("cache_differences",),
            cache_differences_section),
    Section("batch_invariance", "### Batch invariance (beyond the study)", ("batch_invariance",),
            batch_invariance_section),
    Section("excluded", "### Items excluded and why", ("ledger",), exclusions_section),
]


# ------------------------------------------------------------------------------------------------------- identity

def _records(provenance: dict) -> list[dict]:
    """A file's provenance records: its own and, for a gathered file, each part's."""
    if not provenance:
        return []
    return [provenance, *provenance.get("parts", [])]


def _values(records: list[dict], *path: str) -> list:
    """Distinct values at ``path`` (keys into nested dicts) over ``records``, in first-seen order. A key recorded
    with the value null counts (as None); a key no record holds gives nothing."""
    found = []
    for record in records:
        node, present = record, True
        for key in path:
            if not isinstance(node, dict) or key not in node:
                present = False
                break
            node = node[key]
        if present and node not in found:
            found.append(node)
    return found


def _show(values: list, empty: str = NOT_RECORDED) -> str:
    if not values:
        return empty

    def one(v):
        if v is None:
            return "none"
        if isinstance(v, dict):  # what a thing is (its source, path, name) before its settings
            keys = sorted((k for k in v if v[k] is not None),  # an unset option says nothing
                          key=lambda k: (k not in ("source", "path", "name", "marker"), list(v).index(k)))
            return ", ".join(f"{k} {one(v[k])}" for k in keys) or "none set"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(map(one, v)) + "]"
        return f"`{v}`" if isinstance(v, str) else str(v)

    return "; ".join(one(v) for v in values)


def identity(revision_data: list[RevisionData], selection: str | None, run: str, seed: int) -> tuple[list[str], dict]:
    """What produced the run, from the provenance its files record: a Markdown table and its dict."""
    per_revision = {}
    everything: list[dict] = []
    for data in revision_data:
        records = []
        for kind in ("ledger", "transplant", "bridge", "audit", "cache_differences", "batch_invariance"):
            records += _records(data.provenance(kind))
        per_revision[data.revision] = records
        everything += records
    sel_prov = read_provenance(selection) if selection and Path(selection).is_file() else {}
    rows: list[tuple[str, str]] = []
    record: dict = {}

    def add(label: str, key: str, text: str, value) -> None:
        rows.append((label, text))
        record[key] = value

    add("run", "run", f"`{run}`", run)
    model = _values(everything, "config", "model") or _values(everything, "model_source")
    add("model", "model", _show(model), model)
    for data in revision_data:
        records = per_revision[data.revision]
        requested = _values(records, "config", "revision")
        source = _values(records, "model_source")
        commit = _values(records, "model_commit")
        sha = _values(records, "model_sha256") or _values(records, "weights_sha256")
        resolved = (f"hub commit {_show(commit)}" if commit else f"file sha256 {_show(sha)}" if sha
                    else f"{NOT_RECORDED} (no hub commit or file sha256 in the provenance)")
        text = (f"requested {_show(requested)}; source {_show(source)}; resolved: {resolved}"
                if records else f"{NOT_RECORDED} (no provenance)")
        add(f"revision `{data.revision}`", f"revision:{data.revision}", text,
            {"requested": requested, "source": source, "model_commit": commit, "sha256": sha})
    add("model type, layers", "model_type", f"{_show(_values(everything, 'model_type'))}, "
        f"{_show(_values(everything, 'num_layers'))} layers",
        {"model_type": _values(everything, "model_type"), "num_layers": _values(everything, "num_layers")})
    dataset = _values([sel_prov], "config", "dataset") if sel_prov else []
    add("dataset", "dataset", _show(dataset, f"{NOT_RECORDED} (no selection/items.parquet)"), dataset)
    fingerprint = (_values([sel_prov], "dataset_fingerprint") or _values([sel_prov], "dataset_sha256")
                   or _values([sel_prov], "source_sha256"))
    content = None
    if selection and Path(selection).is_file():
        import pyarrow.parquet as pq

        raw = (pq.read_schema(selection).metadata or {}).get(CONTENT_KEY)
        content = raw.decode() if raw else None
    add("dataset content fingerprint", "dataset_fingerprint",
        f"source: {_show(fingerprint)}; selected items (items.parquet content sha256): "
        f"{'`' + content + '`' if content else NOT_RECORDED}", {"source": fingerprint, "selection": content})
    n_items = _values([sel_prov], "config", "n_items") if sel_prov else []
    in_ledgers = sorted({int(i) for d in revision_data if d.has("ledger") for i in d.ledger["item_index"].unique()})
    add("items", "items", f"{_show(n_items)} selected (config n_items); {len(in_ledgers)} in the ledger(s)",
        {"n_items": n_items, "in_ledgers": len(in_ledgers)})
    add("token budgets", "budgets", f"max_stage_tokens {_show(_values(everything, 'config', 'max_stage_tokens'))}; "
        f"max_new_tokens {_show(_values(everything, 'config', 'max_new_tokens'))}",
        {"max_stage_tokens": _values(everything, "config", "max_stage_tokens"),
         "max_new_tokens": _values(everything, "config", "max_new_tokens")})
    add("boundary", "boundary", _show(_values(everything, "config", "boundary")),
        _values(everything, "config", "boundary"))
    seeds = _values(everything, "config", "seed") + [s for s in _values([sel_prov], "seed")
                                                     if s not in _values(everything, "config", "seed")]
    add("seed", "seed", f"{_show(seeds)} (recorded); report's bootstrap seed {seed}",
        {"recorded": seeds, "report": seed})
    precisions = _values(everything, "config", "precision")
    add("precisions", "precisions", _show(precisions), precisions)
    regime = {name: _values(everything, *path) for name, path in (
        ("numerics", ("config", "numerics")), ("numerics_regime", ("numerics_regime",)),
        ("decode_regime", ("config", "decode_regime")), ("decode_attention", ("config", "decode_attention")),
        ("decode_prefill_group", ("config", "decode_prefill_group")), ("batch_size", ("config", "batch_size")),
        ("batch_seed", ("config", "batch_seed")))}
    add("numerics and decode regime", "regime", "; ".join(f"{k} {_show(v)}" for k, v in regime.items()), regime)
    flags = _values(everything, "numerics")
    add("determinism flags", "flags", _show(flags), flags)
    hardware = {name: _values(everything, *path) for name, path in (
        ("device", ("device",)), ("attn_implementation", ("attn_implementation",)), ("threads", ("config", "threads")),
        ("dtype", ("dtype",)))}
    add("device, attention, threads, dtype", "hardware", "; ".join(f"{k} {_show(v)}" for k, v in hardware.items()),
        hardware)
    add("answers, prompt", "answers", f"answer_format {_show(_values(everything, 'config', 'answer_format'))}; "
        f"prompt {_show(_values(everything, 'config', 'prompt'))}",
        {"answer_format": _values(everything, "config", "answer_format"),
         "prompt": _values(everything, "config", "prompt")})
    package = {"stagereplay": _values(everything, "stagereplay"), "git_commit": _values(everything, "git_commit")}
    add("package", "package", f"stagereplay {_show(package['stagereplay'])}, commit {_show(package['git_commit'])}",
        package)
    software = {name: _values(everything, name) for name in ("torch", "transformers", "cache_fingerprint_scheme")}
    add("software", "software", "; ".join(f"{k} {_show(v)}" for k, v in software.items()), software)
    lines = ["## What produced this run", "",
             "From the provenance the results files record (their own and their parts'); several values are listed "
             "where the files differ.", "", "| | recorded |", "| --- | --- |"]
    lines += [f"| {label} | {text} |" for label, text in rows]
    return lines + [""], record


# --------------------------------------------------------------------------------------------------- the report

def figures_section(figures: dict[str, str] | None, out_md: str, notes: dict[str, list[str]] | None = None
                    ) -> list[str]:
    """The figures (name -> PNG path, linked relative to the report), each with its caption below it."""
    if not figures:
        return []
    lines = ["## Figures", ""]
    base = Path(out_md).resolve().parent
    for position, (name, path) in enumerate(figures.items(), start=1):
        number = list(captions.CAPTIONS).index(name) + 1 if name in captions.CAPTIONS else position
        try:
            rel = Path(path).resolve().relative_to(base)
        except ValueError:
            rel = Path(path).resolve()
        title, caption = captions.CAPTIONS.get(name, (name, ""))
        lines += [f"![{name}]({rel.as_posix()})", "",
                  f"**Figure {number}. {title}** {caption}" + "".join(f" {n}" for n in (notes or {}).get(name, [])),
                  ""]
    return lines


def figure_notes(revision_data: list[RevisionData]) -> dict[str, list[str]]:
    """Run-specific notes for the captions (what the figures merged), built from the data."""
    notes: dict[str, list[str]] = {}
    for data in revision_data:
        if not data.has("ledger"):
            continue
        for (revision, precision) in data.coinciding:
            text = (f"Revision `{revision}`, {precision}: the fixed-prefix rows repeat the matched rows item for item, "
                    "so they are drawn once, as matched.")
            for name in ("fig2_first_divergence", "fig3_margins"):
                notes.setdefault(name, []).append(text)
    return notes


def regime_line(ledger: pd.DataFrame) -> tuple[str, dict]:
    """The numerical regime the ledger's rows were made in (a construction factor: compare only within one)."""
    regime = {column: sorted(map(str, ledger[column].dropna().unique()))
              for column in ("numerics", "decode_regime") if column in ledger and ledger[column].notna().any()}
    if not regime:
        return f"Numerical regime of the ledger's rows: {NOT_RECORDED} (no regime columns).", regime
    named = "; ".join(f"{column} `{', '.join(values)}`" for column, values in regime.items())
    return f"Numerical regime of the ledger's rows: {named}.", regime


def _audit_banner(verdicts: dict[str, dict]) -> list[str]:
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


def build_report(ledgers: dict[str, str], out_md: str, out_json: str, run: str, seed: int = 0,
                 inputs: dict[str, dict[str, str]] | None = None, figures: dict[str, str] | None = None,
                 results_dir: str | None = None, selection: str | None = None) -> dict:
    """``ledgers`` maps a revision slug to its ledger.parquet; ``inputs`` maps a kind of file (bridge, audit,
    audit_check, transplant, cache_differences, ...) to {revision: path}. A declared path that does not exist yet
    is fine: its sections are skipped with a note. With ``results_dir`` (``results/<run>``), every results file of
    the run found on disk is covered as well, so that no result that exists is left out. ``selection`` is
    selection/items.parquet (default: ``results_dir/selection/items.parquet``), for the dataset's identity.
    ``figures`` maps a figure's name to its PNG, shown in the report with its caption."""
    declared = {kind: dict(paths) for kind, paths in (inputs or {}).items()}
    declared["ledger"] = dict(ledgers)
    merged, only_on_disk = merge_inputs(declared, results_dir)
    if selection is None and results_dir is not None:
        selection = str(Path(results_dir) / "selection" / "items.parquet")
    # Revisions with a ledger first, in the given order; then those with other results only.
    order = list(ledgers) + [r for paths in declared.values() for r in paths]
    revisions = list(dict.fromkeys(order + sorted(merged.get("ledger", {})) + sorted(
        {r for paths in merged.values() for r in paths})))
    revision_data = [RevisionData(r, {kind: paths.get(r) for kind, paths in merged.items()}, seed)
                     for r in revisions]
    verdicts = {d.revision: audit_verdict(d) for d in revision_data if d.has("ledger")}
    identity_lines, identity_record = identity(revision_data, selection, run, seed)
    builder = {"stagereplay": _package_version(), "git_commit": git_commit()}
    lines = [f"# stagereplay report: run `{run}`", ""]
    lines += _audit_banner(verdicts)
    lines += identity_lines
    lines += ["Columns headed \"reference study\" hold the reference study's figures "
              f"({study.MODEL}, {study.LAYERS} layers, {study.N_ITEMS} items; docs/STUDY.md), not this run's. "
              "Intervals are 95%; every number of this run is in `stats.json` with its n, method and seed "
              f"(seed {seed}: bootstrap). Report built by stagereplay {builder['stagereplay']} at commit "
              f"`{builder['git_commit']}` from the results files alone.", ""]
    if only_on_disk:
        lines += [f"Found on disk, not among this invocation's declared inputs (made by an earlier invocation): "
                  f"revision(s) {_join([f'`{r}`' for r in only_on_disk])}; reported below.", ""]
    all_stats = {"run": run, "seed": seed, "report_builder": builder, "identity": identity_record,
                 "reference_study": study.summary(), "audit": verdicts_json(verdicts),
                 "revisions_found_on_disk_only": only_on_disk, "revisions": {}}
    for data in revision_data:
        lines += [f"## Revision `{data.revision}`", ""]
        numbers: dict = {}
        has_ledger = data.declared("ledger")
        if data.has("ledger"):
            line, numbers["regime"] = regime_line(data.ledger)
            lines += [line, ""]
        elif not has_ledger:
            present = [PRODUCERS[k].split(" ")[0] for k in PRODUCERS if data.has(k)]
            lines += [f"No ledger for this revision: its results on disk are {_join(present)}; only what they "
                      "hold is reported.", ""]
        not_here = []
        for section in SECTIONS:
            absent = [kind for kind in section.needs if not data.has(kind)]
            undeclared = [kind for kind in absent if not data.declared(kind)]
            if undeclared:  # this revision never gets that input: nothing to say here
                if has_ledger:
                    not_here.append(section.key)
                continue
            if section.title:
                lines += [section.title, ""]
            if absent:
                why = ", ".join(PRODUCERS.get(kind, f"{kind} input") for kind in absent)
                lines += [f"_Skipped: no {why} for revision `{data.revision}` yet._", ""]
                numbers[section.key] = {"skipped": f"absent input: {', '.join(absent)}"}
                continue
            section_lines, section_numbers = section.build(data)
            lines += section_lines
            numbers[section.key] = section_numbers
        if not_here:
            lines += [f"Not produced for this revision (no such results file declared or on disk): "
                      f"{', '.join(not_here)}.", ""]
            numbers["not_produced"] = not_here
        all_stats["revisions"][data.revision] = numbers
    lines += figures_section(figures, out_md, figure_notes(revision_data))
    write_text_atomic(out_md, "\n".join(lines) + "\n")
    write_text_atomic(out_json, json.dumps(all_stats, indent=2, sort_keys=True, allow_nan=False) + "\n")
    return all_stats


def verdicts_json(verdicts: dict[str, dict]) -> dict:
    return {r: {k: v for k, v in verdict.items() if k != "audit_check"} for r, verdict in verdicts.items()}


def _package_version() -> str:
    from stagereplay import __version__

    return __version__
