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
must open (its footer), a safetensors dump must have the size its header declares. Knows nothing of Snakemake.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from safetensors import SafetensorError, safe_open

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
    if refresh:  # same bytes in another inode (a copy): the next check is a stat again
        write_hash_record(path, actual)


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
    writes nothing."""
    checked = Checked()
    if not Path(root).is_dir():
        return checked
    for path in results_files(root):
        checked.files += 1
        check_file(path, refresh, checked)
    if checked.damaged:
        raise DamagedResultsError("\n".join(checked.damaged) + f"\n{FIX}")
    return checked


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
