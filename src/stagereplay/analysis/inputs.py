"""Which results files a report covers: the declared ones, and every other one of the run found on disk.

A report must never lose a result that exists. Snakemake hands the report rule the files the current config
declares; a plain rerun after a run at more revisions (``transplant={revisions: [primary, later]}``) declares fewer,
yet ``results/<run>/later/transplant.parquet`` is still there. :func:`merge_inputs` adds every results file of a
known kind under ``results/<run>/<revision>/`` to the declared ones (a declared path wins), and says which
revisions were found only on disk, so the report can say so.
"""

from __future__ import annotations

from pathlib import Path

from stagereplay import catalogue

# kind -> file name in results/<run>/<revision>/ (the results contract)
FILES = {
    "ledger": "ledger.parquet",
    "bridge": "bridge.parquet",
    "audit": "audit.parquet",
    "audit_check": "audit_check.json",
    "batch_invariance": "batch_invariance.parquet",
    "transplant": "transplant.parquet",
    "cache_differences": "cache_differences.parquet",
    "minimal_transplant": "minimal_transplant.parquet",
    "divergence_onset": "divergence_onset.parquet",
    "fidelity": "fidelity.parquet",
    **{name: f"{name}.parquet" for engine in catalogue.ENGINES for name in engine.outputs},
}
# Folders of results/<run>/ that are not revisions.
NOT_REVISIONS = {"selection", "report"}


def revision_of(path: str | Path) -> str:
    """The revision slug of a results file: the name of the folder it lies in (results/<run>/<revision>/<file>)."""
    return Path(path).parent.name


def by_revision(paths) -> dict[str, str]:
    """{revision: path} of a list of one kind's results files, each revision read from its folder."""
    return {revision_of(p): str(p) for p in paths}


def discover(results_dir: str | Path) -> dict[str, dict[str, str]]:
    """kind -> {revision: path} of every results file of a known kind under ``results_dir/<revision>/``."""
    found: dict[str, dict[str, str]] = {}
    root = Path(results_dir)
    if not root.is_dir():
        return found
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in NOT_REVISIONS):
        for kind, name in FILES.items():
            if (folder / name).is_file():
                found.setdefault(kind, {})[folder.name] = str(folder / name)
    return found


def merge_inputs(declared: dict[str, dict[str, str]], results_dir: str | Path | None
                 ) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The declared inputs plus every file :func:`discover` finds; and the revisions found only on disk (none of
    whose files was declared), in name order."""
    merged = {kind: dict(paths) for kind, paths in declared.items()}
    if results_dir is None:
        return merged, []
    declared_revisions = {r for paths in declared.values() for r in paths}
    extra: set[str] = set()
    for kind, paths in discover(results_dir).items():
        for revision, path in paths.items():
            current = merged.setdefault(kind, {})
            if revision not in current or not Path(current[revision]).is_file():
                current[revision] = path
            if revision not in declared_revisions:
                extra.add(revision)
    return merged, sorted(extra)
