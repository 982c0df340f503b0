"""The Markdown report and stats.json, built from the results files alone (no model is loaded).

Every sentence of the report is built from the run's own files: the audit's verdict first (a failed audit is the
first thing the report says), then the findings (:mod:`~stagereplay.analysis.findings`: each claim of the study,
this run's figure and whether the study's conclusion holds, from the numbers of ``stats.json``), then what produced
the run (model, dataset, budgets, boundary, seed, regimes, code and software, from the provenance the files record;
"not recorded" where they record nothing), then per revision one table per claim of the reference study with the
study's figure beside this run's, then what the study did not
measure (margins at the divergence, per-layer cache differences, the transplant localisation, the minimal sufficient
transplants and the onset of the cache difference in divergent items, batch invariance, fidelity along the
suffix),
the items excluded and why, and the figures with their captions. The reference study's numbers come from
:mod:`stagereplay.analysis.study` alone and are labelled as the study's wherever they appear. Every number of the
run is in ``stats.json`` with its n, method and seed.

Sections are functions of :class:`RevisionData` listed in :data:`SECTIONS` with the inputs they need. A section
whose input is declared for a revision but not on disk yet is skipped with a note; one whose input can never exist
at that revision (a revision with transplant results only has no ledger) is left out. To add a section, write
``def my_section(data: RevisionData) -> tuple[list[str], dict]`` and append it to :data:`SECTIONS`.

The sections live in modules by what they report: :mod:`~stagereplay.analysis.claims` (matched, fixed-prefix 2x2,
bridge, exclusions), :mod:`~stagereplay.analysis.audit_report` (the audit's verdict, banner and section),
:mod:`~stagereplay.analysis.transplant_report`, :mod:`~stagereplay.analysis.divergence_location` (minimal
transplants, onset), :mod:`~stagereplay.analysis.beyond_study` (margins, cache differences, batch invariance),
:mod:`~stagereplay.analysis.fidelity` (fidelity along the suffix, what a split is associated with) and
:mod:`~stagereplay.analysis.run_identity` (what produced the run); the revision's files are read through
:class:`~stagereplay.analysis.revision_data.RevisionData` and numbers are
written by :mod:`~stagereplay.analysis.report_format`. This module assembles the page and ``stats.json``.

This module imports no engine code: it reads Parquet and JSON files through :mod:`stagereplay.io` only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pandas as pd

from stagereplay import catalogue
from stagereplay.version import __version__
from stagereplay.analysis import captions, study
from stagereplay.analysis.audit_report import audit_banner, audit_section, audit_verdict, verdicts_json
from stagereplay.analysis.beyond_study import batch_invariance_section, cache_differences_section, margins_section
from stagereplay.analysis.claims import bridge_section, exclusions_section, fixed_prefix_section, matched_section
from stagereplay.analysis.divergence_location import divergence_onset_section, minimal_transplant_section
from stagereplay.analysis.engine_report import engine_section
from stagereplay.analysis.fidelity import fidelity_section
from stagereplay.analysis.findings import DEFAULT_EQUIVALENCE_MARGIN, beyond_study_section, findings_section
from stagereplay.analysis.inputs import merge_inputs
from stagereplay.analysis.report_format import NOT_RECORDED, join_words
from stagereplay.analysis.report_html import render_report_html
from stagereplay.analysis.revision_data import PRODUCERS, RevisionData
from stagereplay.analysis.run_identity import identity
from stagereplay.analysis.tables import EXPERIMENTS, sort_precisions
from stagereplay.analysis.transplant_report import transplant_section
from stagereplay.analysis.truncation import budget_stop_lines, budget_stops
from stagereplay.io.parquet import write_text_atomic
from stagereplay.io.provenance import git_commit


@dataclass
class Section:
    key: str  # key in stats.json
    title: str | None  # a heading of its own, or None when the section brings its claim headings
    needs: tuple[str, ...]  # kinds of input files it reads
    build: Callable[[RevisionData], tuple[list[str], dict]]
    opt_in: bool = False  # a stage the config turns on: not listed as "not produced" where it is off


SECTIONS: list[Section] = [
    Section("matched", "### Matched experiment (live vs prefill)", ("ledger",), matched_section),
    Section("fixed_prefix", "### Fixed-prefix 2x2", ("ledger",), fixed_prefix_section),
    Section("bridge", "### Bridge", ("bridge",), bridge_section),
    Section("audit", "### Saved-ledger audit", ("audit",), audit_section),
    Section("transplant", "### Transplants", ("transplant",), transplant_section),
    Section("fidelity", "### Fidelity along the suffix (beyond the study)", ("fidelity",), fidelity_section),
    Section("minimal_transplant", "### Minimal sufficient transplants (beyond the study)", ("minimal_transplant",),
            minimal_transplant_section),
    Section("divergence_onset", "### Where the caches of divergent items first differ (beyond the study)",
            ("divergence_onset",), divergence_onset_section),
    Section("margins", "### Margins at the first divergence (beyond the study)", ("ledger",), margins_section),
    Section("cache_differences", "### Per-layer cache differences (beyond the study)", ("cache_differences",),
            cache_differences_section),
    Section("batch_invariance", "### Batch invariance (beyond the study)", ("batch_invariance",),
            batch_invariance_section),
    Section("excluded", "### Items excluded and why", ("ledger",), exclusions_section),
]


def sections() -> list[Section]:
    """:data:`SECTIONS` with, before the exclusions, one section per engine of the catalogue (opt-in: where the
    config names the engine), read when called so that an engine added to the catalogue has its section."""
    engines = [Section(f"engine_{e.name}", f"### {e.words} beside this pipeline's constructions (beyond the study)",
                       (f"engine_{e.name}",), partial(engine_section, entry=e), opt_in=True)
               for e in catalogue.ENGINES]
    at = [s.key for s in SECTIONS].index("excluded")
    return SECTIONS[:at] + engines + SECTIONS[at:]


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


def item_browser_line(page: str | None, out_md: str) -> list[str]:
    """The link to the item browser (:mod:`stagereplay.analysis.browser_page`), relative to the report."""
    if not page:
        return []
    target = Path(page).resolve()
    try:
        rel = target.relative_to(Path(out_md).resolve().parent).as_posix()
    except ValueError:
        rel = target.as_posix()
    return [f"Item browser: [{Path(page).name}]({rel}), one row per item with its labels (filterable to the "
            "divergent items); for an item, the two constructions' suffixes side by side with the first divergent "
            "token marked, the top-2 margin along each suffix, and its transplant outcomes.", ""]


def figure_notes(revision_data: list[RevisionData]) -> dict[str, list[str]]:
    """Run-specific notes for the captions, built from the data: what the figures merged, and beside the accuracies
    how many suffixes stopped at max_new_tokens."""
    notes: dict[str, list[str]] = {}
    for data in revision_data:
        if not data.has("ledger"):
            continue
        for (revision, precision) in data.coinciding:
            text = (f"Revision `{revision}`, {precision}: the fixed-prefix rows repeat the matched rows item for item, "
                    "so they are drawn once, as matched.")
            for name in ("fig2_first_divergence", "fig3_margins"):
                notes.setdefault(name, []).append(text)
    stops = accuracy_budget_note(revision_data)
    if stops:
        notes["fig6_accuracy"] = stops
    return notes


def accuracy_budget_note(revision_data: list[RevisionData]) -> list[str]:
    """Figure 6's note: per cell it draws (revision, experiment, precision), the suffixes that stopped at
    max_new_tokens, and the warning where they are many."""
    cells, budgets = {}, set()
    for data in revision_data:
        if not data.has("ledger"):
            continue
        pairs = data.pairs
        for experiment in EXPERIMENTS:
            for precision in sort_precisions(pairs["precision"]):
                cell = pairs[(pairs["experiment"] == experiment) & (pairs["precision"] == precision)]
                cells[f"`{data.revision}` {experiment.replace('_', '-')} {precision}"] = budget_stops(cell)
        budgets.add(data.max_new_tokens)
    return budget_stop_lines(cells, budgets.pop() if len(budgets) == 1 else None)


def regime_line(ledger: pd.DataFrame) -> tuple[str, dict]:
    """The numerical regime the ledger's rows were made in (a construction factor: compare only within one)."""
    regime = {column: sorted(map(str, ledger[column].dropna().unique()))
              for column in ("numerics", "decode_regime") if column in ledger and ledger[column].notna().any()}
    if not regime:
        return f"Numerical regime of the ledger's rows: {NOT_RECORDED} (no regime columns).", regime
    named = "; ".join(f"{column} `{', '.join(values)}`" for column, values in regime.items())
    return f"Numerical regime of the ledger's rows: {named}.", regime


def no_boundary_line(ledger: pd.DataFrame) -> str | None:
    """The one line that says no item reached the stage boundary, where none did (else None): then there are no
    prefixes, and the stages after generation had nothing to compare, dump or transplant."""
    if ledger.empty or (ledger["status"] == "ok").any():
        return None
    statuses = ledger.drop_duplicates("item_index")["status"].value_counts().sort_index()
    counted = join_words([f"{n} {status}" for status, n in statuses.items()])
    return (f"**No item reached the stage boundary at this revision** ({counted}): there are no prefixes, so no "
            "construction was compared and the fixed-prefix, bridge, transplant and divergence stages had nothing to "
            "do. Check `boundary` and `max_stage_tokens` above: the marker must be text the model writes within "
            "the stage budget. Each item is listed under \"Items excluded and why\".")


def revision_section(data: RevisionData, not_run: dict[str, str] | None = None) -> tuple[list[str], dict]:
    """One revision's part of the report (its regime, then each section of :func:`sections` that applies) and its
    numbers, ``stats.json``'s ``revisions.<revision>``. ``not_run`` maps a section whose stage the workflow did not
    schedule (it had nothing to compare) to the reason, said in its place."""
    lines = [f"## Revision `{data.revision}`", ""]
    numbers: dict = {}
    has_ledger = data.declared("ledger")
    if data.has("ledger"):
        line, numbers["regime"] = regime_line(data.ledger)
        lines += [line, ""]
        reached = no_boundary_line(data.ledger)
        if reached:
            lines += [reached, ""]
            numbers["no_item_reached_boundary"] = True
    elif not has_ledger:
        present = [PRODUCERS[k].split(" ")[0] for k in PRODUCERS if data.has(k)]
        lines += [f"No ledger for this revision: its results on disk are {join_words(present)}; only what they "
                  "hold is reported.", ""]
    not_here = []
    for section in sections():
        absent = [kind for kind in section.needs if not data.has(kind)]
        undeclared = [kind for kind in absent if not data.declared(kind)]
        if undeclared and has_ledger and section.key in (not_run or {}):
            lines += [section.title or section.key, "", f"_Not run: {not_run[section.key]}._", ""]
            numbers[section.key] = {"status": "not_run", "reason": not_run[section.key]}
            continue
        if undeclared:  # this revision never gets that input: nothing to say here
            if has_ledger and not section.opt_in:
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
    return lines, numbers


def build_report(ledgers: dict[str, str], out_md: str, out_json: str, run: str, seed: int = 0,
                 inputs: dict[str, dict[str, str]] | None = None, figures: dict[str, str] | None = None,
                 results_dir: str | None = None, selection: str | None = None,
                 item_browser: str | None = None, out_html: str | None = None,
                 not_run: dict[str, str] | None = None,
                 equivalence_margin: float = DEFAULT_EQUIVALENCE_MARGIN) -> dict:
    """``ledgers`` maps a revision slug to its ledger.parquet; ``inputs`` maps a kind of file (bridge, audit,
    audit_check, transplant, cache_differences, ...) to {revision: path}. A declared path that does not exist yet
    is fine: its sections are skipped with a note. With ``results_dir`` (``results/<run>``), every results file of
    the run found on disk is covered as well, so that no result that exists is left out. ``selection`` is
    selection/items.parquet (default: ``results_dir/selection/items.parquet``), for the dataset's identity.
    ``figures`` maps a figure's name to its PNG, shown in the report with its caption; ``item_browser`` is the
    run's item browser page (items.html), linked near the top; ``out_html``, where given, gets the report as one
    HTML page too (:mod:`~stagereplay.analysis.report_html`); ``not_run`` maps a section whose stage was not
    scheduled (a control with nothing to compare) to the reason, said in its place where no file of it exists.
    ``equivalence_margin`` (the config's ``accuracy_equivalence_margin``) is the margin of the Findings' accuracy
    equivalence test."""
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
    builder = {"stagereplay": __version__, "git_commit": git_commit()}
    lines = [f"# stagereplay report: run `{run}`", ""]
    lines += audit_banner(verdicts)
    findings_at = len(lines)  # the findings summarise the sections below: written once they are built
    lines += identity_lines
    lines += ["Columns headed \"reference study\" hold the reference study's figures "
              f"({study.MODEL}, {study.LAYERS} layers, {study.N_ITEMS} items; docs/STUDY.md), not this run's. "
              "Intervals are 95%; every number of this run is in `stats.json` with its n and method, and the "
              f"bootstrap results with their seed ({seed}). Report built by stagereplay {builder['stagereplay']} at "
              f"commit `{builder['git_commit']}` from the results files alone.", ""]
    lines += item_browser_line(item_browser, out_md)
    if only_on_disk:
        lines += [f"Found on disk, not among this invocation's declared inputs (made by an earlier invocation): "
                  f"revision(s) {join_words([f'`{r}`' for r in only_on_disk])}; reported below.", ""]
    all_stats = {"run": run, "seed": seed, "report_builder": builder, "identity": identity_record,
                 "reference_study": study.summary(), "audit": verdicts_json(verdicts),
                 "revisions_found_on_disk_only": only_on_disk, "revisions": {}}
    for data in revision_data:
        revision_lines, all_stats["revisions"][data.revision] = revision_section(data, not_run)
        lines += revision_lines
    findings_lines, all_stats["findings"] = findings_section(all_stats["revisions"], equivalence_margin)
    beyond_lines, all_stats["beyond_the_study"] = beyond_study_section(
        all_stats["revisions"], {d.revision: d for d in revision_data})
    all_stats["accuracy_equivalence_margin"] = equivalence_margin
    lines[findings_at:findings_at] = findings_lines + beyond_lines
    lines += figures_section(figures, out_md, figure_notes(revision_data))
    markdown = "\n".join(lines) + "\n"
    # rendered first: a figure it cannot embed fails the report before any of its files is written
    page = render_report_html(markdown, f"stagereplay report: run {run}", Path(out_md).parent) if out_html else None
    write_text_atomic(out_md, markdown)
    if page is not None:
        write_text_atomic(out_html, page)
    write_text_atomic(out_json, json.dumps(all_stats, indent=2, sort_keys=True, allow_nan=False) + "\n")
    return all_stats
