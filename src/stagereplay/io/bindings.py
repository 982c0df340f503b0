"""What binds a results file to its run: the job that wrote it, by content.

A job's binding is its rule, a digest of its params (the config slice it ran with: settings, budgets, the input
files' and model's fingerprints) and the sha256 of each of its inputs in the run's results folder, as the hash
records beside them hold it. The job records it beside every file it writes (in the file's hash record,
:func:`stagereplay.io.parquet.write_hash_record`); before the first job, :mod:`stagereplay.stages.integrity`
computes the same for the job of each results file that Snakemake will not make again and compares. A file copied
in from another run with its record (``cp -a``, ``rsync``) carries the other run's binding: another selection,
other settings or other upstream files, so it is refused by name before any job reads it.

Paths count only below the run's folder (the dataset and model files are fingerprinted in the params), and with
that folder's name taken out: a run copied whole under another
name (``cp -a results/a results/b``, the same config) is bound to itself, while the content of every input and
setting counts. Knows nothing of Snakemake: callers pass the rule's name, params, inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from stagereplay.io.parquet import BINDING_ENV, read_hash_record

RUN_FOLDER = "<run>"
# Inputs that bind through the job's params instead: the run's records of its model store entries name the store's
# folder too, which is not what was computed, and the entries' keys (the content) are in the params of every job
# that loads them (snapshots); the record itself is bound as prepare_model's output.
BOUND_BY_PARAMS = ("models/",)


def results_root(run: str) -> str:
    """The run's results folder, as the workflow names it (``RESULTS`` in workflow/rules/common/config.smk)."""
    return f"results/{run}"


def in_run(path: str, root: str) -> str | None:
    """``path`` relative to the run's folder ``root``, or None where it lies outside (a dataset, a model)."""
    prefix = root.rstrip("/") + "/"
    return path[len(prefix):] if path.startswith(prefix) else None


def recorded_digest(path: str | Path) -> str | None:
    """The sha256 recorded for a file; for a folder (cache dumps), a digest over its files' recorded sha256."""
    path = Path(path)
    if not path.is_dir():
        record = read_hash_record(path)
        return record.sha256 if record else None
    lines = []
    for folder, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            file = Path(folder) / name
            record = read_hash_record(file)
            lines.append(f"{file.relative_to(path)}:{record.sha256 if record else None}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def params_digest(params: dict, root: str) -> str:
    """sha256 over the params' ``repr`` (Snakemake compares params by their repr too; the workflow keeps every
    mapping in sorted key order), the run's folder named ``<run>``."""
    text = json.dumps([[name, repr(value)] for name, value in sorted(params.items())])
    return hashlib.sha256(text.replace(root.rstrip("/") + "/", RUN_FOLDER + "/").encode()).hexdigest()


def job_binding(rule: str, params: dict, inputs: list[str], root: str, digests: dict | None = None) -> dict:
    """``{"rule", "params", "inputs": {path in the run: recorded sha256}}`` of a job. ``digests``: a cache of
    :func:`recorded_digest` by path, for a caller that computes many jobs' bindings."""
    digests = {} if digests is None else digests
    recorded = {}
    for path in map(str, inputs):
        name = in_run(path, root)
        if name is None or name.startswith(BOUND_BY_PARAMS):
            continue
        if path not in digests:
            digests[path] = recorded_digest(path)
        recorded[name] = digests[path]
    return {"rule": rule, "params": params_digest(params, root), "inputs": dict(sorted(recorded.items()))}


def bind_written_files(binding: dict | None) -> None:
    """Record ``binding`` beside every file this process writes from now on (None: no more)."""
    if binding is None:
        os.environ.pop(BINDING_ENV, None)
    else:
        os.environ[BINDING_ENV] = json.dumps(binding, sort_keys=True)
