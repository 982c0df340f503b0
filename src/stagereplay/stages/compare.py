"""Rule compare_runs: several finished runs side by side (:mod:`stagereplay.analysis.compare`), each run checked
first.

Before anything is read or written, every run must be one the comparison can trust: at least two runs, none listed
twice, each a results folder that exists, and each passing the checks its own pipeline runs: the results check
(:func:`stagereplay.stages.integrity.verify_results`: every file still has the sha256 recorded when it was written)
and, per revision with a ledger, the audit check (:func:`stagereplay.stages.gather.verify_audit`, rule
check_audit's code: every ledger row recomputed and reproduced). A refusal names the run and the check and writes
nothing. Loads no model and imports no torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from stagereplay.analysis.compare import FIGURES, build_comparison
from stagereplay.analysis.inputs import discover
from stagereplay.experiments.audit import AuditFailedError
from stagereplay.io.parquet import CorruptFileError, read_hash_record
from stagereplay.stages.gather import verify_audit
from stagereplay.stages.integrity import DamagedResultsError, verify_results

COMPARE_FOLDER = "compare"  # results/compare/<name>/: the comparisons' own folder, not a run
FORMATS = ("pdf", "png")


class CompareError(ValueError):
    """A run the comparison refuses, named with the check it failed and the fix."""


def run_folders(runs: list[str], results: str | Path = "results") -> dict[str, Path]:
    """label -> results folder of each run: a run name is ``results/<run>``, an entry with a ``/`` the path of
    another results folder. Refuses fewer than two runs, a run listed twice and a folder that does not exist."""
    runs = list(runs or [])
    if len(runs) < 2:
        raise CompareError(f"compare.runs lists {len(runs)} run(s) {runs}: a comparison needs at least two; name "
                           "two or more finished runs (their folders under results/)")
    folders: dict[str, Path] = {}
    for label in runs:
        label = str(label)
        if label == COMPARE_FOLDER:
            raise CompareError(f"compare.runs: `{label}` is the comparisons' own folder (results/{COMPARE_FOLDER}/), "
                               "not a run; name the runs to compare")
        folder = Path(label) if "/" in label else Path(results) / label
        if label in folders or folder.resolve() in {f.resolve() for f in folders.values()}:
            raise CompareError(f"compare.runs lists the run `{label}` ({folder}) twice; list each run once")
        if not folder.is_dir():
            raise CompareError(f"compare.runs: run `{label}` has no results folder {folder}; finish that run first "
                               "(snakemake --config run=" + (label if "/" not in label else "<run>") + "), or fix "
                               "the name")
        folders[label] = folder
    return folders


def files_read(folder: str | Path) -> list[str]:
    """The results files of a run that the comparison reads: its selection, every results file of a known kind of
    each revision, and its own report's stats.json where there is one."""
    folder = Path(folder)
    found = [str(path) for paths in discover(folder).values() for path in paths.values()]
    extra = [folder / "selection" / "items.parquet", folder / "report" / "stats.json"]
    return sorted(found + [str(path) for path in extra if path.is_file()])


def run_state(folder: str | Path) -> str:
    """A digest of the files of a run the comparison reads, from their recorded sha256 (their size and mtime where
    none is recorded): it changes when one of them does, without reading them. The workflow keeps it in the rule's
    params, so that a changed run is compared again while its files are never the rule's inputs (as inputs, a
    compared run whose name is the config's own run would be rebuilt with this config's settings)."""
    digest = hashlib.sha256()
    for path in files_read(folder):
        record = read_hash_record(path)
        stat = Path(path).stat()
        state = record.sha256 if record else f"{stat.st_size}:{stat.st_mtime_ns}"
        digest.update(f"{Path(path).relative_to(folder)}\0{state}\n".encode())
    return digest.hexdigest()


def check_run(label: str, folder: Path) -> None:
    """Refuse a run whose results check or audit check fails, naming the run and the check."""
    try:
        verify_results(folder, refresh=False)
    except DamagedResultsError as exc:
        raise CompareError(f"run `{label}` ({folder}) fails the results check: {exc}") from exc
    ledgers = sorted(folder.glob("*/ledger.parquet"))
    if not ledgers:
        raise CompareError(f"run `{label}` ({folder}) holds no ledger (<revision>/ledger.parquet): it is not a "
                           "finished run; finish it first")
    for ledger in ledgers:
        revision = ledger.parent.name
        audit = ledger.parent / "audit.parquet"
        if not audit.is_file():
            raise CompareError(f"run `{label}` ({folder}), revision `{revision}`: no audit.parquet, so the audit "
                               "check cannot pass (its ledger rows were never recomputed); finish the run (rule "
                               "check_audit) first")
        try:
            verify_audit(str(audit), str(ledger))
        except (AuditFailedError, CorruptFileError) as exc:
            raise CompareError(f"run `{label}` ({folder}), revision `{revision}`, fails the audit check (rule "
                               f"check_audit): {exc}") from exc


def figure_paths(folder: str | Path) -> dict[str, dict[str, str]]:
    """name -> {format: path} of the comparison's figures in ``folder``."""
    return {name: {fmt: str(Path(folder) / f"{name}.{fmt}") for fmt in FORMATS} for name in FIGURES}


def compare_runs(name: str, runs: list[str], out_md: str, out_json: str, figures_dir: str,
                 results: str | Path = "results") -> dict:
    """Check every run (:func:`run_folders`, :func:`check_run`), then write the comparison."""
    folders = run_folders(runs, results)
    for label, folder in folders.items():
        check_run(label, folder)
    return build_comparison(name, folders, out_md, out_json, figure_paths(figures_dir))
