"""Provenance: what every results file records about the code and software that made it, and readers for it."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from stagereplay.version import __version__
from stagereplay.io.fingerprints import CACHE_FINGERPRINT_SCHEME, SCHEME_KEY
from stagereplay.io.parquet import read_provenance

def git_commit(start: str | Path | None = None) -> str:
    """The commit of the code that ran (with ``-dirty`` when the tree had changes), or ``unknown``."""
    here = Path(start or Path(__file__).resolve().parent)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# Where a package assigns the ``__version__`` its module reports: its own file, relative to the package's folder.
VERSION_FILES = {"torch": "version.py", "transformers": "__init__.py"}
ASSIGNED_VERSION = re.compile(r"""^__version__\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", re.MULTILINE)


def module_version(name: str) -> str:
    """``<name>.__version__`` (``torch.__version__``: ``2.11.0+cu130``, not the distribution's ``2.11.0``), read from
    the file that assigns it when the package is not imported yet: a job that loads no model then records the same
    string without importing torch and transformers (seconds). Imports the package where the file says otherwise."""
    if name in sys.modules:
        return sys.modules[name].__version__
    spec = importlib.util.find_spec(name)  # a top-level name: found, not imported
    if spec is not None and spec.submodule_search_locations:
        try:
            text = (Path(next(iter(spec.submodule_search_locations))) / VERSION_FILES[name]).read_text()
            found = ASSIGNED_VERSION.findall(text)
            if len(found) == 1:
                return found[0]
        except OSError:
            pass
    return importlib.import_module(name).__version__


def software_versions() -> dict:
    return {
        "stagereplay": __version__,
        "torch": module_version("torch"),
        "transformers": module_version("transformers"),
        "git_commit": git_commit(),
        SCHEME_KEY: CACHE_FINGERPRINT_SCHEME,
    }


def recorded_batch_plan(path: str | Path) -> dict | None:
    """The batch plan (``{seed, batch_size, batches}``) in a results file's provenance, its parts' for a gathered
    file; None when its rows were decoded at batch 1. Parts that record different plans are an error: their rows
    were not decoded in one plan."""
    prov = read_provenance(path)
    plans = []
    for record in [prov, *prov.get("parts", [])]:
        plan = record.get("batch_plan")
        if plan and plan not in plans:
            plans.append(plan)
    if len(plans) > 1:
        raise ValueError(f"{path}: its parts record {len(plans)} different batch plans (seeds "
                         f"{[p['seed'] for p in plans]}, sizes {[p['batch_size'] for p in plans]}); rerun the "
                         "generation so that every part uses one plan")
    return plans[0] if plans else None


def recorded_stages(path: str | Path) -> list[str]:
    """The stages that computed a results file's rows: its own, or for a gathered file its parts' (in order)."""
    prov = read_provenance(path)
    stages = []
    for record in prov.get("parts") or [prov]:
        if record.get("stage") and record["stage"] not in stages:
            stages.append(record["stage"])
    return stages


REGIME_KEYS = ("decode_regime", "decode_max_len", "decode_max_rows", "decode_attention",
               "decode_prefill_group", "decode_kernels")


def recorded_regime(path) -> dict:
    """The decode regime recorded in a results file's provenance (a gathered file: its first part that has one)."""
    prov = read_provenance(path)
    for record in [prov, *prov.get("parts", [])]:
        if "decode_regime" in record:
            return {key: record.get(key) for key in REGIME_KEYS}
    raise ValueError(f"{path} records no decode regime: it was not written by this pipeline's generation; rerun "
                     "reconstruct_prefixes")


def recorded_numerics(path) -> str:
    """The numerics regime a results file was made in, from its provenance (a gathered file: its parts).

    Every stage after generation rebuilds its caches in the regime the ledger was made in."""
    prov = read_provenance(path)
    for record in [prov, *prov.get("parts", [])]:
        if "numerics_regime" in record:
            return record["numerics_regime"]["numerics"]
    raise ValueError(f"{path} records no numerics regime: it was not written by this pipeline's generation; rerun "
                     "reconstruct_prefixes")
