"""Atomic Parquet files with provenance and a content hash: how every stage writes and reads its tables.

Every Parquet file the pipeline writes carries a provenance record in its key-value metadata (key
``stagereplay``) and a content fingerprint, and is written atomically (temp file, fsync, rename), so a crash never
leaves a half-written file that a rerun would trust, and a damaged file is refused when read.

Every file written through :func:`atomic_path` (Parquet, text, figures, cache dumps) also gets the sha256 of its
bytes recorded beside it, in ``.<name>.sha256`` (the ``sha256sum`` format, so ``sha256sum -c`` checks it too; a
comment line adds the size and inode it was written with, another the binding of the job that wrote it,
:mod:`stagereplay.io.bindings`):
:mod:`stagereplay.stages.integrity` compares a run's files with these records before Snakemake may delete anything.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

PROVENANCE_KEY = b"stagereplay"


CONTENT_KEY = b"stagereplay.content_sha256"
# The binding of the job writing in this process (stagereplay.io.bindings), recorded beside every file it writes.
BINDING_ENV = "STAGEREPLAY_JOB_BINDING"
BINDING_LINE = "# binding "


def atomic_path(path: str | Path, size_hint: int | None = None):
    """Context manager yielding a temp path beside ``path``; renamed onto it only if the block succeeds.

    A full disk raises :class:`NoSpaceError` naming the file, the disk's free space and what the file needed
    (``size_hint``: the bytes the writer expects to write, where it knows), also on the job's console: its log is
    usually on the same disk and may get nothing."""
    return _AtomicPath(Path(path), size_hint)


class NoSpaceError(OSError):
    """The disk filled while a results file was written; the file it would have replaced is as it was."""


def is_no_space(exc: BaseException | None) -> bool:
    return isinstance(exc, OSError) and (exc.errno == errno.ENOSPC or "No space left on device" in str(exc))


def size_text(n: int) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def no_space_message(path: Path, written: int, size_hint: int | None, replaced: bool = False) -> str:
    usage = shutil.disk_usage(path.parent)
    needed = (f"about {size_text(size_hint)} (its table before compression)" if size_hint
              else f"more than the {size_text(written)} written")
    return (f"no space left on device writing {path}: the disk holding {path.parent} has {size_text(usage.free)} "
            f"free of {size_text(usage.total)}; the file needed {needed}, and {size_text(written)} of it were written "
            "before the disk filled. Free space there (or point the run at a disk with room) and rerun: "
            + (f"{path.name} was written, but not the record of its sha256 (the results check opens it instead)"
               if replaced else f"{path.name} was not replaced, the results already there are as they were"))


def _tell_console(message: str) -> None:
    """A job's stderr is its log, often on the full disk: the message goes to the job's own stderr too, which
    Snakemake shows on the console."""
    console = sys.__stderr__
    if console is not None and console is not sys.stderr:
        try:
            console.write(f"[stagereplay] {message}\n")
            console.flush()
        except OSError:
            pass


class _AtomicPath:
    def __init__(self, path: Path, size_hint: int | None = None):
        self.path, self.size_hint = path, size_hint

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Not mkstemp: its files are private (0600); the block creates this one, with the usual permissions.
        self.tmp = self.path.parent / f".{self.path.name}.{secrets.token_hex(8)}.tmp"
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                return self._commit()
            except OSError as error:
                exc = error
        replaced = not self.tmp.exists() and exc_type is None  # the rename was done: only the hash record failed
        written = self.path.stat().st_size if replaced else self.tmp.stat().st_size if self.tmp.exists() else 0
        self.tmp.unlink(missing_ok=True)
        if is_no_space(exc):
            message = no_space_message(self.path, written, self.size_hint, replaced)
            _tell_console(message)
            raise NoSpaceError(errno.ENOSPC, message) from exc
        if exc_type is None:
            raise exc
        return False

    def _commit(self) -> bool:
        with open(self.tmp, "rb") as f:
            os.fsync(f.fileno())
        digest = sha256_of_file(self.tmp)
        # The old record goes first: a kill before the new one is written leaves a file without a record (not
        # checked), never a good file beside a stale record (which would be reported as damaged).
        record = hash_record_path(self.path)
        record.unlink(missing_ok=True)
        os.replace(self.tmp, self.path)
        _fsync_folder(self.path.parent)
        write_hash_record(self.path, digest, job_binding())
        return False


def _fsync_folder(folder: Path) -> None:
    """A rename reaches the disk only with its folder."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def job_binding() -> dict | None:
    """The binding of the job writing in this process (:mod:`stagereplay.io.bindings`), None outside a job."""
    binding = os.environ.get(BINDING_ENV)
    return json.loads(binding) if binding else None


def record_link(source: str | Path, target: str | Path) -> None:
    """Record ``target``, a hard link to ``source`` (the same bytes, the same inode), with the sha256 recorded for
    ``source`` and this job's binding; a copy is hashed. Nothing where ``source`` has no record."""
    recorded = read_hash_record(source)
    if recorded is None:
        return
    same = os.stat(source).st_ino == os.stat(target).st_ino
    write_hash_record(target, recorded.sha256 if same else sha256_of_file(target), job_binding())


def hash_record_path(path: str | Path) -> Path:
    """Where the sha256 of ``path``'s bytes is recorded: ``.<name>.sha256`` beside it."""
    path = Path(path)
    return path.parent / f".{path.name}.sha256"


def write_hash_record(path: str | Path, digest: str, binding: dict | None = None) -> None:
    """Record ``digest`` as the sha256 of ``path``, with the size and inode the file has now (atomically), and the
    ``binding`` of the job that wrote it where there is one (:mod:`stagereplay.io.bindings`)."""
    path = Path(path)
    stat = path.stat()
    record = hash_record_path(path)
    tmp = record.parent / f"{record.name}.{secrets.token_hex(8)}.tmp"
    bound = f"{BINDING_LINE}{json.dumps(binding, sort_keys=True)}\n" if binding else ""
    with open(tmp, "w") as f:
        f.write(f"{digest}  {path.name}\n# size={stat.st_size} inode={stat.st_ino}\n{bound}")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, record)
    _fsync_folder(record.parent)


@dataclass(frozen=True)
class HashRecord:
    sha256: str
    size: int | None  # None: a record without the comment line (written by hand, sha256sum)
    inode: int | None
    binding: dict | None = None  # the job that wrote the file (stagereplay.io.bindings); None: not written by a job


def read_hash_record(path: str | Path) -> HashRecord | None:
    """What was recorded for ``path``, or None when there is no (readable) record."""
    try:
        lines = hash_record_path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    digest = lines[0].split(" ", 1)[0] if lines else ""
    if len(digest) != 64:
        return None
    key = dict(part.split("=", 1) for line in lines[1:] if line.startswith("# ") and not line.startswith(BINDING_LINE)
               for part in line[2:].split() if "=" in part)
    bindings = [line[len(BINDING_LINE):] for line in lines[1:] if line.startswith(BINDING_LINE)]
    try:
        binding = json.loads(bindings[0]) if bindings else None
    except ValueError:
        binding = {"unreadable": bindings[0][:80]}  # never matches a job's: the file is refused, not trusted
    try:
        return HashRecord(digest, int(key["size"]), int(key["inode"]), binding)
    except (KeyError, ValueError):
        return HashRecord(digest, None, None, binding)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_parquet(df: pd.DataFrame, path: str | Path, provenance: dict, schema: pa.Schema | None = None) -> None:
    """Write ``df`` atomically with ``provenance`` (JSON) in the file's key-value metadata.

    No timestamps go into the file: two runs of the same code and inputs give byte-identical files.
    """
    table = pa.Table.from_pandas(df, schema=schema, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta.pop(b"pandas", None)  # pandas' metadata records the pandas version, not ours to carry
    meta[PROVENANCE_KEY] = json.dumps(provenance, sort_keys=True, default=str).encode()
    meta[CONTENT_KEY] = content_sha256(table, meta[PROVENANCE_KEY]).encode()
    table = table.replace_schema_metadata(meta)
    with atomic_path(path, size_hint=table.nbytes) as tmp:
        pq.write_table(table, tmp, compression="zstd", write_page_checksum=True)


def content_sha256(table: pa.Table, provenance: bytes) -> str:
    """sha256 over a table's values, column by column, and its provenance record.

    Taken over decoded values rather than file bytes so that it can live inside the file it checks: a flipped
    bit anywhere that changes what a reader would get (a value, a column name, the provenance) changes it.
    """
    h = hashlib.sha256(provenance)
    for name, column in zip(table.column_names, table.columns):
        h.update(json.dumps([name, column.to_pylist()], default=str).encode())
    return h.hexdigest()


class CorruptFileError(ValueError):
    """A results file that cannot be trusted (unreadable, truncated, or fingerprints that do not match)."""


def read_parquet(path: str | Path) -> pd.DataFrame:
    """Read a Parquet file, refusing it (:class:`CorruptFileError`, naming the file) unless its pages' checksums
    and the content fingerprint :func:`write_parquet` recorded still match. Files without a recorded
    fingerprint (not written by this package) are read as they are."""
    try:
        table = pq.read_table(path, page_checksum_verification=True)
        meta = table.schema.metadata or {}
        recorded = meta.get(CONTENT_KEY)
        if recorded is not None and content_sha256(table, meta.get(PROVENANCE_KEY, b"")) != recorded.decode():
            raise CorruptFileError(
                f"{path}: its content does not match the fingerprint recorded when it was written (a flipped bit "
                "or an edit); delete it and rerun the rule that makes it"
            )
        return table.to_pandas()
    except (OSError, pa.ArrowException, UnicodeDecodeError) as exc:
        raise CorruptFileError(
            f"{path} is not a readable Parquet file ({exc}); delete it and rerun the rule that makes it"
        ) from exc


def read_provenance(path: str | Path) -> dict:
    try:
        meta = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException) as exc:
        raise CorruptFileError(f"{path} is not a readable Parquet file ({exc})") from exc
    return json.loads(meta.get(PROVENANCE_KEY, b"{}"))
