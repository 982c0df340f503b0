"""Checks that a run's results still hold the bytes they were written with, before Snakemake may delete any.

A damaged results file (truncated by a full disk or an interrupted copy, edited, bit-flipped) has a new
modification time, so Snakemake reruns every job downstream of it: it deletes those jobs' outputs as each starts,
and each then fails reading the damaged file, so good results are lost to a bad one. The workflow calls
:func:`verify_results` before the first job and before a dry run plans; a damaged file stops the run naming the
file and the fix, with nothing run and nothing deleted.

Every file written through :func:`stagereplay.io.parquet.atomic_path` has the sha256 of its bytes recorded beside
it, with the size and inode it was written with. A file is hashed again only when its size or inode differ from
those (truncated, replaced, copied elsewhere), so a start costs a ``stat`` per file, not a read of every cache dump.
The mtime cannot be the key: Snakemake touches every output after its job, after the record was written. Not seen
before a job: an edit in place that keeps the size; a stage reading the file still refuses it (the content
fingerprint of a Parquet file, the per-layer sha256 of a dump). Files without a record (written before records
existed, or a record lost to a kill between the file and its record) get a structural check only: a Parquet file
must open (its footer), a safetensors dump must have the size its header declares.

Whole is not enough: a file copied in from another run together with its record (``cp -a``, ``rsync`` of a results
folder) has the bytes its record names. Each record also holds the binding of the job that wrote it (its rule,
params and inputs' sha256: :mod:`stagereplay.io.bindings`); :func:`foreign_files` compares it with the binding of the
job that makes the file in this run, for every job Snakemake will not run (a job that reruns writes its own files),
and :func:`refuse_foreign` stops the run naming each foreign file, before any job and with nothing rewritten. A dry
run plans before the jobs can be seen: :func:`foreign_inputs` compares the recorded inputs alone. Knows nothing of
Snakemake: the workflow hands it the jobs (:class:`PlannedJob`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from safetensors import SafetensorError, safe_open

from stagereplay.io.bindings import in_run, job_binding, recorded_digest
from stagereplay.io.parquet import (
    CorruptFileError,
    hash_record_path,
    read_hash_record,
    sha256_of_file,
    write_hash_record,
)

FIX = "Nothing was run and nothing deleted."


class DamagedResultsError(CorruptFileError):
    """Results files whose bytes are not those they were written with, or that no longer open."""


@dataclass
class Checked:
    files: int = 0
    hashed: list[str] = field(default_factory=list)  # another size or inode than recorded: hashed, matched
    copies: dict = field(default_factory=dict)  # path -> (sha256, binding) of those, for refresh_records
    unrecorded: list[str] = field(default_factory=list)  # no record: structural check only
    damaged: list[str] = field(default_factory=list)  # one message per damaged file


def results_files(root: str | Path) -> list[Path]:
    """The files under ``root``, without hidden ones (hash records, temp files of a writer) or hidden folders."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(folder) / name for name in sorted(files) if not name.startswith(".")]
    return found


def check_file(path: Path, refresh: bool, checked: Checked) -> None:
    recorded = read_hash_record(path)
    if recorded is None:
        checked.unrecorded.append(str(path))
        problem = structural_problem(path)
        if problem:
            checked.damaged.append(f"{path} is damaged: {problem}; {fix(path)}")
        return
    stat = path.stat()
    if (stat.st_size, stat.st_ino) == (recorded.size, recorded.inode):
        return  # the file it was written as
    actual = sha256_of_file(path)
    if actual != recorded.sha256:
        checked.damaged.append(
            f"{path} is damaged: its sha256 is {actual[:16]}…, not the {recorded.sha256[:16]}… recorded when it "
            f"was written ({hash_record_path(path).name}); it was changed after it was written (truncated, edited "
            f"or overwritten); {fix(path)}")
        return
    checked.hashed.append(str(path))
    checked.copies[str(path)] = (actual, recorded.binding)
    if refresh:
        refresh_records(checked)


def refresh_records(checked: Checked) -> None:
    """Same bytes in another inode (a copy): the record takes the inode, so the next check is a stat again."""
    for path, (digest, binding) in checked.copies.items():
        write_hash_record(path, digest, binding)
    checked.copies.clear()


def fix(path: Path) -> str:
    """What to do about a damaged file: delete it, so that the next run recomputes it and what depends on it, or
    restore it. A cache dump is part of its folder's output: Snakemake sees a folder, so the folder goes."""
    if path.parent.name == "caches":
        return (f"delete the folder {path.parent} to recompute it (and what depends on it) with the next run, or "
                "restore the file from a copy")
    if path.parent.name == "models" and path.suffix == ".json":
        # the run's record of its model store entries: every model-loading job takes it as input
        return ("restore it from a copy (cp -p), or delete it: the next run writes it again from the model store "
                "(nothing is converted while the store's entries are whole) and reruns every job that loads the model "
                "(the snapshots themselves are in the model store, which stagereplay-store check verifies)")
    return "delete it to recompute it (and what depends on it) with the next run, or restore it from a copy"


def structural_problem(path: Path) -> str | None:
    """Why a file without a hash record cannot be what a stage wrote, as far as opening it tells; None if it opens."""
    try:
        if path.suffix == ".parquet":
            pq.read_metadata(path)
        elif path.suffix == ".safetensors":
            # numpy: opening reads the header alone, and "pt" would import torch into jobs that load no model
            with safe_open(str(path), framework="np") as f:
                f.metadata()
    except (OSError, pa.ArrowException, SafetensorError) as exc:
        return f"it has no recorded sha256 and does not open ({exc})"
    return None


def verify_results(root: str | Path, refresh: bool = True) -> Checked:
    """Check every file under ``root`` (a run's ``results/<run>``) against its recorded sha256; raise
    :class:`DamagedResultsError` naming every damaged file and the fix. ``refresh``: rewrite the record of a file
    with the same bytes in another inode (a copy), so the next check need not hash it; a dry run passes False and
    writes nothing, and a caller with more to check passes False and calls :func:`refresh_records` when all passed."""
    checked = Checked()
    if not Path(root).is_dir():
        return checked
    for path in results_files(root):
        checked.files += 1
        check_file(path, refresh, checked)
    if checked.damaged:
        raise DamagedResultsError("\n".join(checked.damaged) + f"\n{FIX}")
    return checked


class ForeignResultsError(CorruptFileError):
    """Results files that were not made by this run's jobs from this run's inputs (copied in from another run)."""


@dataclass
class PlannedJob:
    """What the check needs of a job whose outputs Snakemake will not make again: it sees them as this run's."""
    rule: str
    params: dict
    inputs: list[str]
    outputs: list[str]


def unit(path: Path) -> Path:
    """What a message names and a user moves: a cache dump's folder (``caches``, ``parts/caches_<shard>``:
    Snakemake's output is the folder), else the file."""
    return path.parent if path.parent.name.startswith("caches") else path


def binding_difference(recorded: dict, expected: dict, root: str) -> str | None:
    """How a file's recorded binding differs from the binding of the job that makes it in this run; None: alike."""
    recorded_inputs, expected_inputs = recorded.get("inputs") or {}, expected["inputs"]
    for name in sorted(set(recorded_inputs) & set(expected_inputs)):
        if recorded_inputs[name] != expected_inputs[name]:
            return (f"it was made from another {root}/{name} (sha256 {str(recorded_inputs[name])[:16]}…) than the "
                    f"one this run holds ({str(expected_inputs[name])[:16]}…)")
    if set(recorded_inputs) != set(expected_inputs):
        other = sorted(set(recorded_inputs) ^ set(expected_inputs))
        return (f"it was made from other input files than this run's {expected['rule']} reads (they differ in "
                f"{', '.join(other[:3])}{' …' if len(other) > 3 else ''})")
    if recorded.get("rule") != expected["rule"]:
        return f"it was written by rule {recorded.get('rule')}, but rule {expected['rule']} makes it in this run"
    if recorded.get("params") != expected["params"]:
        return (f"it was made with other settings than this run's {expected['rule']} has (its params: the config's "
                "values, the dataset's and model's fingerprints, the package version)")
    return None


def foreign_message(path: Path, problem: str, root: str) -> str:
    record = "the records .<name>.sha256 of its files" if path.is_dir() else f"its record {hash_record_path(path).name}"
    return (f"{path} is not this run's: {problem}. It was copied in from another run (cp -a, rsync) or left by a run "
            f"on other inputs; move it and {record} out of {root} to recompute it (and what depends on it) with the "
            "next run, or restore this run's own copy")


def foreign_files(jobs, root: str) -> list[str]:
    """One message per output under ``root`` (a folder once) holding a file written by a job whose binding is not that
    of the job that makes it in this run (``jobs``: :class:`PlannedJob` of the jobs Snakemake will not run, which
    would read the file as this run's). Files without a recorded binding (written before bindings were recorded)
    are not judged."""
    messages, digests = [], {}
    for job in jobs:
        expected = None
        for output in map(Path, job.outputs):
            if in_run(str(output), root) is None or not output.exists():
                continue
            for path in results_files(output) if output.is_dir() else [output]:
                record = read_hash_record(path)
                if record is None or record.binding is None:
                    continue
                expected = expected or job_binding(job.rule, job.params, job.inputs, root, digests)
                problem = binding_difference(record.binding, expected, root)
                if problem:
                    messages.append(foreign_message(output, problem, root))
                    break  # a folder output is named once
    return messages


def foreign_inputs(root: str) -> list[str]:
    """Without the jobs (a dry run, which plans before any hook could see them): the files under ``root`` whose
    recorded inputs in the run now hold other bytes, where Snakemake would not make the file again for it (no such
    input is newer than the file). Settings are not compared here: the run's check before its first job does."""
    messages, named = [], set()
    for path in results_files(root):
        record = read_hash_record(path)
        if record is None or not record.binding or unit(path) in named:
            continue
        recorded = record.binding.get("inputs") or {}
        inputs = {name: Path(root, name) for name in recorded}
        if not all(p.exists() for p in inputs.values()):
            continue  # Snakemake makes the missing input again, then this file
        if any(newest_mtime(p) > path.stat().st_mtime for p in inputs.values()):
            continue  # an input newer than the file: Snakemake makes the file again from it
        current = {name: recorded_digest(p) for name, p in inputs.items()}
        expected = {"rule": record.binding.get("rule"), "params": record.binding.get("params"), "inputs": current}
        problem = binding_difference(record.binding, expected, root)
        if problem:
            named.add(unit(path))
            messages.append(foreign_message(unit(path), problem, root))
    return messages


def newest_mtime(path: Path) -> float:
    if not path.is_dir():
        return path.stat().st_mtime
    return max([path.stat().st_mtime, *(p.stat().st_mtime for p in results_files(path))])


def refuse_foreign(messages: list[str]) -> None:
    if messages:
        raise ForeignResultsError("\n".join(messages) + f"\n{FIX}")


def store_entries(root: str | Path) -> list[str]:
    """One line per prepared snapshot the run's records (``results/<run>/models/<revision>.json``) name that is not
    whole in the model store: gone (removed to free disk) or damaged (a file changed, missing or added). Neither
    stops the run: the workflow prepares it again before its first job, and refuses the result unless it is the
    recorded snapshot byte for byte (:func:`stagereplay.stages.prepare.prepare_again`); a job never loads a damaged
    entry, nor prepares one."""
    from stagereplay.models.store import ModelStore, read_record

    lines = []
    for record_path in sorted(Path(root, "models").glob("*.json")):
        try:
            record = read_record(record_path)
            store, snapshots = ModelStore(record["store"]), record["snapshots"]
        except Exception as exc:  # a record that does not read is a damaged results file: named above
            lines.append(f"{record_path}: {exc}")
            continue
        for precision, snapshot in sorted(snapshots.items()):
            problems = store.problems(snapshot["key"], record.get("source_sha256"))
            if problems:
                state = "gone" if not store.path(snapshot["key"]).exists() else "damaged"
                lines.append(f"the {precision} snapshot of {record.get('source')} ({record_path.name}) is {state} "
                             f"in the model store ({'; '.join(problems)}): the run prepares it again before its first "
                             "job")
    return lines


def summary(root: str | Path, checked: Checked) -> str:
    line = f"Results checked: {checked.files} files under {root}"
    extra = []
    if checked.hashed:
        extra.append(f"{len(checked.hashed)} hashed again (copied since written, same bytes)")
    if checked.unrecorded:
        extra.append(f"{len(checked.unrecorded)} without a recorded sha256 (opened only)")
    return line + (f" ({'; '.join(extra)})" if extra else "")
