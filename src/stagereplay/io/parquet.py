"""Atomic Parquet files with provenance and a content hash: how every stage writes and reads its tables.

Every Parquet file the pipeline writes carries a provenance record in its key-value metadata (key
``stagereplay``) and a content fingerprint, and is written atomically (temp file, fsync, rename), so a crash never
leaves a half-written file that a rerun would trust, and a damaged file is refused when read.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

PROVENANCE_KEY = b"stagereplay"


CONTENT_KEY = b"stagereplay.content_sha256"


def atomic_path(path: str | Path):
    """Context manager yielding a temp path beside ``path``; renamed onto it only if the block succeeds."""
    return _AtomicPath(Path(path))


class _AtomicPath:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Not mkstemp: its files are private (0600); the block creates this one, with the usual permissions.
        self.tmp = self.path.parent / f".{self.path.name}.{secrets.token_hex(8)}.tmp"
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            return False
        with open(self.tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)
        # The rename itself reaches the disk only with its folder.
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return False


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
    with atomic_path(path) as tmp:
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
