"""Several finished runs side by side: what differs between them, each claim of the reference study per run, the
divergence rate per run and construction pair, and the fidelity tables where the runs have them.

Everything is read from the runs' results files: the claims are the report's own numbers, computed by the same
sections (:func:`stagereplay.analysis.report.revision_section`) and read by the same Findings rows
(:func:`stagereplay.analysis.findings.revision_rows`) with the run's recorded seed, so a run's column is its own
report's; what produced each run comes from the provenance its files record
(:func:`stagereplay.analysis.run_identity.identity`). No model is loaded and nothing is recomputed from a model.

This module does not check the runs: :mod:`stagereplay.stages.compare` refuses a run whose results check fails
before anything here reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from stagereplay.analysis import stats
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.findings import DEFAULT_EQUIVALENCE_MARGIN, revision_rows, verdict_word
from stagereplay.analysis.inputs import discover
from stagereplay.analysis.report import revision_section
from stagereplay.analysis.report_format import NOT_RECORDED, format_proportion, join_words, table_head, table_row
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.analysis.row_keys import check_unique
from stagereplay.analysis.run_identity import identity, show_values
from stagereplay.io.parquet import read_parquet, write_text_atomic

FIDELITY_COLUMNS = ("item_id", "precision", "reference", "construction", "step", "token_id", "kl_forward",
                    "kl_reverse", "kl_sym", "max_abs_logit_diff", "margin_reference", "margin_construction",
                    "argmax_differs", "logits_equal")
FIDELITY_KEY = ("item_id", "precision", "reference", "construction", "step")
FIGURES = {"divergence": "Divergence rate per run and construction pair",
           "fidelity": "Per-step symmetric KL per run, precision and construction pair"}


@dataclass
class RunResults:
    """One finished run's results folder, read on first use."""

    label: str  # the run as the comparison names it: a run name, or the path given for another results folder
    folder: Path
    revisions: list[RevisionData]
    seed: int  # the run's recorded seed: the bootstrap seed its own report used

    @property
    def selection(self) -> str:
        return str(self.folder / "selection" / "items.parquet")


def load_run(label: str, folder: str | Path) -> RunResults:
    """A run's revisions as its report reads them: every results file found under ``folder/<revision>/``, the
    revisions with a ledger first."""
    folder = Path(folder)
    found = discover(folder)
    names = sorted({r for paths in found.values() for r in paths},
                   key=lambda r: (r not in found.get("ledger", {}), r))
    seeds = set()
    revisions = []
    for name in names:
        data = RevisionData(name, {kind: paths.get(name) for kind, paths in found.items()})
        if data.has("ledger"):
            seed = (data.job_record("ledger").get("config") or {}).get("seed")
            if seed is not None:
                seeds.add(int(seed))
        revisions.append(data)
    if len(seeds) > 1:
        raise ValueError(f"run {label} ({folder}): its ledgers record several seeds {sorted(seeds)}; a run has one")
    seed = seeds.pop() if seeds else 0
    for data in revisions:
        data.seed = seed
    return RunResults(label, folder, revisions, seed)


# ---- What differs between the runs ----------------------------------------------------------------------------------

def constructions(run: RunResults) -> dict:
    """Per revision and experiment, the constructions its ledger holds rows of."""
    found = {}
    for data in run.revisions:
        if data.has("ledger"):
            ledger = data.ledger
            found[data.revision] = {str(e): sorted(map(str, g["construction"].unique()))
                                    for e, g in ledger.groupby("experiment", sort=True)}
    return found


def factor_values(run: RunResults) -> dict[str, object]:
    """What produced the run, one value per factor (as its files record it)."""
    _, record = identity(run.revisions, run.selection, run.label, run.seed)
    regime = record["regime"]
    revisions = {d.revision: {k: v for k, v in record[f"revision:{d.revision}"].items() if v}
                 for d in run.revisions}
    hardware = {k: v for k, v in record["hardware"].items() if k != "dtype"}  # dtype follows from the precisions
    return {
        "model": record["model"],
        "revision": revisions,
        "model type, layers": record["model_type"],
        "precisions": record["precisions"],
        "numerics": regime.get("numerics", []),
        "decode regime": {k: regime[k] for k in ("decode_regime", "decode_attention", "decode_prefill_group",
                                                 "decode_kernels") if k in regime},
        "batch size": {k: regime[k] for k in ("batch_size", "batch_seed") if k in regime},
        "constructions": constructions(run),
        "n_items": record["items"]["n_items"],
        "dataset": record["dataset"],
        "selected items (content sha256)": record["dataset_fingerprint"]["selection"],
        "max_new_tokens": record["budgets"]["max_new_tokens"],
        "max_stage_tokens": record["budgets"]["max_stage_tokens"],
        "boundary": record["boundary"],
        "seed": record["seed"]["recorded"],
        "device, attention, threads": hardware,
        "software": record["software"],
        "package": record["package"],
    }


def show_factor(value) -> str:
    """A factor's value in the table: recorded values as the report writes them, a mapping as ``key: value``."""
    if isinstance(value, dict):
        if not value:
            return NOT_RECORDED
        return "; ".join(f"{k}: {show_factor(v)}" for k, v in value.items())
    if isinstance(value, list):
        return show_values(value)
    return NOT_RECORDED if value is None else show_values([value])


def factor_section(runs: list[RunResults]) -> tuple[list[str], dict]:
    """The table of what produced each run, a column per run, the rows where the runs differ marked."""
    values = {run.label: factor_values(run) for run in runs}
    names = list(next(iter(values.values())))
    differ = [name for name in names
              if len({json.dumps(values[r.label][name], sort_keys=True, default=str) for r in runs}) > 1]
    lines = ["## What differs between the runs", ""]
    if differ:
        lines.append(f"The runs differ in: **{join_words(differ)}**. Every other factor below is recorded alike.")
    else:
        lines.append("The runs' files record the same value for every factor below.")
    lines += ["", "From the provenance each run's results files record (the report's \"What produced this run\"), "
              "and the constructions its ledger holds.", "",
              *table_head("factor", "differs", *(f"`{r.label}`" for r in runs))]
    for name in names:
        mark = "**differs**" if name in differ else ""
        lines.append(table_row(name, mark, *(show_factor(values[r.label][name]) for r in runs)))
    return lines + [""], {"differ": differ, "values": values}


# ---- The study's claims, a column per run ---------------------------------------------------------------------------

def equivalence_margin(run: RunResults) -> float:
    """The accuracy equivalence margin the run's own report used (its stats.json), else the default."""
    path = run.folder / "report" / "stats.json"
    recorded = json.loads(path.read_text()).get("accuracy_equivalence_margin") if path.is_file() else None
    return float(recorded) if recorded else DEFAULT_EQUIVALENCE_MARGIN


def run_numbers(run: RunResults) -> dict[str, dict]:
    """Per revision, the numbers the run's own report writes to ``stats.json`` (``revisions.<revision>``)."""
    return {data.revision: revision_section(data)[1] for data in run.revisions}


def run_findings(run: RunResults, numbers: dict[str, dict]) -> dict[tuple[str, str], dict]:
    """(revision, claim) -> the Findings row of the run's report: the study's figure, this run's and the verdict."""
    rows, margin = {}, equivalence_margin(run)
    for revision, by_section in numbers.items():
        for claim, reference, figure, holds in revision_rows(revision, by_section, named=False, margin=margin):
            rows[(revision, claim)] = {"reference_study": reference, "this_run": figure, "holds": verdict_word(holds),
                                       "holds_text": holds}
    return rows


def claims_section(runs: list[RunResults], findings: dict[str, dict]) -> tuple[list[str], list[dict]]:
    """One table per claim of the study (its Findings row), a column per run."""
    keys = list(dict.fromkeys(k for run in runs for k in findings[run.label]))
    claims = list(dict.fromkeys(claim for _, claim in keys))
    lines = ["## The study's claims, run by run", "",
             "Each claim of the reference study as each run's own report states it (its Findings table, from the same "
             "code and the run's recorded seed); intervals are 95%.", ""]
    record = []
    for claim in claims:
        revisions = [revision for revision, c in keys if c == claim]
        reference = next(findings[r.label][(rev, claim)]["reference_study"] for r in runs for rev in revisions
                         if (rev, claim) in findings[r.label])
        lines += [f"### Claim: {claim}", "", f"Reference study: {reference}.", "",
                  *table_head("revision", "", *(f"`{r.label}`" for r in runs))]
        for revision in revisions:
            cells = [findings[r.label].get((revision, claim)) for r in runs]
            figures = [c["this_run"] if c else "—" for c in cells]
            verdicts = [c["holds_text"] if c else "no such row in its report" for c in cells]
            lines.append(table_row(f"`{revision}`", "this run", *figures))
            lines.append(table_row(f"`{revision}`", "holds here", *verdicts))
            record.append({"claim": claim, "revision": revision, "reference_study": reference,
                           "runs": {r.label: ({"this_run": c["this_run"], "holds": c["holds"]} if c else None)
                                    for r, c in zip(runs, cells)}})
        lines.append("")
    if not claims:
        lines += ["_No run holds a ledger: no claim to compare._", ""]
    return lines, record


# ---- Divergence rates -----------------------------------------------------------------------------------------------

DIVERGENCE_COLUMNS = ["run", "revision", "experiment", "precision", "construction_a", "construction_b", "n", "k",
                      "rate", "wilson_low", "wilson_high", "label_flips"]


def divergence_cells(runs: list[RunResults]) -> pd.DataFrame:
    """Per run, revision, experiment, precision and construction pair: items whose suffixes differ (k of n) with the
    Wilson 95% interval, counted as the run's report counts them (the matched pair, and in the fixed-prefix
    experiment each construction against the reference)."""
    frames = []
    for run in runs:
        for data in run.revisions:
            if not data.has("ledger"):
                continue
            pairs = data.pairs
            matched = analysis.disagreement_cells(pairs[pairs["experiment"] == "matched"])
            fixed = analysis.replay_cells(data.ledger).assign(experiment="fixed_prefix")
            for cells in (matched, fixed):
                if len(cells):
                    frames.append(cells.assign(run=run.label))
    if not frames:
        return pd.DataFrame(columns=DIVERGENCE_COLUMNS)
    return pd.concat(frames, ignore_index=True)[DIVERGENCE_COLUMNS]


def divergence_section(cells: pd.DataFrame, runs: list[RunResults]) -> tuple[list[str], list[dict]]:
    lines = ["## Divergence rate per run and construction pair", "",
             "Items whose suffix token ids differ between the two constructions (replica 1 of each, status ok on "
             "both), with the Wilson 95% interval; figure `divergence`.", ""]
    if cells.empty:
        return lines + ["_No run holds compared items._", ""], []
    lines += table_head("revision", "experiment", "precision", "constructions", *(f"`{r.label}`" for r in runs))
    keys = ["revision", "experiment", "precision", "construction_a", "construction_b"]
    for key, group in cells.groupby(keys, sort=False):
        by_run = {r.run: r for r in group.itertuples(index=False)}
        revision, experiment, precision, a, b = key
        cells_text = [format_proportion(stats.proportion(int(by_run[r.label].k), int(by_run[r.label].n)))
                      if r.label in by_run else "—" for r in runs]
        lines.append(table_row(f"`{revision}`", experiment, precision, f"{a} vs {b}", *cells_text))
    record = [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
              for row in cells.to_dict("records")]
    return lines + [""], record


# ---- Fidelity -------------------------------------------------------------------------------------------------------

def read_fidelity(path: str | Path) -> pd.DataFrame:
    """A fidelity table, refused (naming the file) without the columns of its contract or with a key twice."""
    frame = read_parquet(path)
    missing = [c for c in FIDELITY_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: a fidelity table without the column(s) {', '.join(missing)} (docs/OUTPUTS.md "
                         "lists its columns); rebuild it with the pipeline's fidelity stage")
    check_unique(frame, "fidelity", FIDELITY_KEY)
    return frame


def fidelity_tables(runs: list[RunResults]) -> dict[tuple[str, str], pd.DataFrame]:
    """(run, revision) -> fidelity table, for every revision that has one."""
    found = {}
    for run in runs:
        for data in run.revisions:
            path = data.paths.get("fidelity")
            if path and Path(path).is_file():
                found[(run.label, data.revision)] = read_fidelity(path)
    return found


def fidelity_summary(tables: dict[tuple[str, str], pd.DataFrame]) -> pd.DataFrame:
    """Per run, revision, precision and pair: items, steps, steps with bit-identical logits, steps with a KL of
    exactly 0, and the median and max per-step symmetric KL (over every step of every item: descriptive, the steps of
    an item are not independent)."""
    rows = []
    for (run, revision), frame in tables.items():
        for (precision, reference, construction), g in frame.groupby(["precision", "reference", "construction"],
                                                                     sort=False):
            kl = g["kl_sym"].astype(float)
            finite = kl[np.isfinite(kl)]
            rows.append({"run": run, "revision": revision, "precision": precision, "reference": reference,
                         "construction": construction, "items": int(g["item_id"].nunique()), "steps": len(g),
                         "logits_equal": int(g["logits_equal"].fillna(False).astype(bool).sum()),
                         "kl_sym_zero": int((kl == 0).sum()), "kl_sym_not_finite": int(len(kl) - len(finite)),
                         "kl_sym_median": float(finite.median()) if len(finite) else None,
                         "kl_sym_max": float(finite.max()) if len(finite) else None})
    columns = ["run", "revision", "precision", "reference", "construction", "items", "steps", "logits_equal",
               "kl_sym_zero", "kl_sym_not_finite", "kl_sym_median", "kl_sym_max"]
    return pd.DataFrame(rows, columns=columns)


def fidelity_section(runs: list[RunResults], tables: dict, summary: pd.DataFrame) -> tuple[list[str], dict]:
    lines = ["## Fidelity along the suffix", ""]
    with_table = [r.label for r in runs if any(run == r.label for run, _ in tables)]
    without = [r.label for r in runs if r.label not in with_table]
    if not tables:
        return lines + ["The runs have no fidelity table (`<revision>/fidelity.parquet`): nothing to compare here.",
                        ""], {"runs_without_table": without}
    if without:
        lines += [f"Run(s) {join_words([f'`{r}`' for r in without])} have no fidelity table: only "
                  f"{join_words([f'`{r}`' for r in with_table])} are shown.", ""]
    lines += ["Per step of the reference construction's suffix teacher-forced through both boundary caches: the "
              "symmetric KL of the next-token distributions (`kl_sym`), over every step of every item "
              "(descriptive: the steps of one item are not independent). \"Bit-identical\" counts the steps whose "
              "logits are equal as bytes (`logits_equal`); a KL of exactly 0 is counted apart. Figure `fidelity`.",
              "",
              *table_head("run", "revision", "precision", "pair", "items", "steps", "steps with bit-identical logits",
                          "KL exactly 0", "median KL", "max KL")]
    for r in summary.itertuples(index=False):
        share = f"{r.logits_equal} ({100 * r.logits_equal / r.steps:.1f}%)" if r.steps else "0"
        lines.append(table_row(f"`{r.run}`", f"`{r.revision}`", r.precision, f"{r.reference} vs {r.construction}",
                               r.items, r.steps, share, r.kl_sym_zero, format_kl(r.kl_sym_median),
                               format_kl(r.kl_sym_max)))
    odd = summary[summary["kl_sym_not_finite"] > 0]
    if len(odd):
        lines += ["", "Steps with a non-finite KL, left out of the median, the max and the figure: " + "; ".join(
            f"`{r.run}` {r.precision} {r.reference} vs {r.construction}: {r.kl_sym_not_finite}"
            for r in odd.itertuples(index=False)) + "."]
    record = {"runs_without_table": without,
              "cells": [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
                        for row in summary.to_dict("records")]}
    return lines + [""], record


def format_kl(value: float | None) -> str:
    if value is None or pd.isna(value):
        return "—"
    return "0 (exactly)" if value == 0 else f"{value:.3g}"


# ---- The page -------------------------------------------------------------------------------------------------------

def stale_reports(runs: list[RunResults], findings: dict[str, dict]) -> list[str]:
    """The runs whose own report/stats.json holds other Findings than their tables give now (a report built before
    the tables last changed): the comparison shows the tables' numbers."""
    stale = []
    for run in runs:
        path = run.folder / "report" / "stats.json"
        if not path.is_file():
            continue
        own = json.loads(path.read_text()).get("findings") or []
        now = [{"claim": claim, "this_run": row["this_run"], "holds": row["holds"]}
               for (_, claim), row in findings[run.label].items()]
        if [{k: r.get(k) for k in ("claim", "this_run", "holds")} for r in own] != now:
            stale.append(run.label)
    return stale


def figure_lines(figures: dict[str, str] | None, out_md: str) -> list[str]:
    if not figures:
        return []
    lines = ["## Figures", ""]
    base = Path(out_md).resolve().parent
    for name, path in figures.items():
        try:
            rel = Path(path).resolve().relative_to(base).as_posix()
        except ValueError:
            rel = Path(path).resolve().as_posix()
        lines += [f"![{name}]({rel})", "", f"**{name}.** {FIGURES.get(name, '')}.", ""]
    return lines


def comparison(name: str, runs: list[RunResults]) -> tuple[list[str], dict, pd.DataFrame, dict, pd.DataFrame]:
    """The report's lines and stats, and the tables its figures draw (divergence cells, fidelity tables and their
    summary)."""
    tables = fidelity_tables(runs)  # first: a fidelity table without its contract's columns is refused by name
    numbers = {run.label: run_numbers(run) for run in runs}
    findings = {run.label: run_findings(run, numbers[run.label]) for run in runs}
    lines = [f"# stagereplay comparison `{name}`", "",
             "Runs: " + join_words([f"`{r.label}` ({r.folder})" for r in runs]) + ". Built from their results files "
             "alone, after each passed the results check (every file's recorded sha256) and the audit check (every "
             "ledger row recomputed and reproduced).", ""]
    stale = stale_reports(runs, findings)
    if stale:
        lines += [f"The own report of run(s) {join_words([f'`{r}`' for r in stale])} holds other findings than its "
                  "tables give now (it was built before they last changed): rebuild it; this page shows the "
                  "tables' numbers.", ""]
    factor_lines, factors = factor_section(runs)
    claim_lines, claims = claims_section(runs, findings)
    cells = divergence_cells(runs)
    divergence_lines, divergence = divergence_section(cells, runs)
    summary = fidelity_summary(tables)
    fidelity_lines, fidelity = fidelity_section(runs, tables, summary)
    lines += factor_lines + claim_lines + divergence_lines + fidelity_lines
    record = {"name": name, "runs": {r.label: {"folder": str(r.folder), "seed": r.seed,
                                               "revisions": [d.revision for d in r.revisions]} for r in runs},
              "stale_reports": stale, "factors": factors, "claims": claims, "divergence": divergence,
              "fidelity": fidelity, "numbers": numbers}
    return lines, record, cells, tables, summary


def build_comparison(name: str, runs: dict[str, str | Path], out_md: str, out_json: str,
                     figures: dict[str, dict[str, str]]) -> dict:
    """Write the comparison of ``runs`` (label -> results folder, already checked) to ``out_md`` and ``out_json``,
    and its figures to ``figures`` (name of :data:`FIGURES` -> {format: path})."""
    from stagereplay.analysis.compare_figures import plot_divergence, plot_fidelity

    loaded = [load_run(label, folder) for label, folder in runs.items()]
    lines, record, cells, tables, _ = comparison(name, loaded)
    labels = [r.label for r in loaded]
    plot_divergence(cells, labels, figures["divergence"])
    plot_fidelity(tables, labels, figures["fidelity"])
    lines += figure_lines({n: paths["png"] for n, paths in figures.items() if "png" in paths}, out_md)
    write_text_atomic(out_md, "\n".join(lines) + "\n")
    write_text_atomic(out_json, json.dumps(record, indent=2, sort_keys=True, allow_nan=False) + "\n")
    return record
