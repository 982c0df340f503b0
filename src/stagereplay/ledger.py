"""Fingerprints, provenance and atomic Parquet files: the ground floor every stage writes through.

A fingerprint is a sha256 over exact bytes: token ids as little-endian int32, cache tensors as their raw
storage bytes; a whole cache's fingerprint is a sha256 over its tensors' digests (:func:`fingerprint_layers`,
scheme :data:`CACHE_FINGERPRINT_SCHEME`, recorded in every file's provenance). Nothing here compares with a
tolerance. Every Parquet file the pipeline writes carries a provenance record in its key-value metadata (key
``stagereplay``) and is written atomically (temp file, fsync, rename), so a crash never leaves a half-written file
that a rerun would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

PROVENANCE_KEY = b"stagereplay"
CONTENT_KEY = b"stagereplay.content_sha256"


def ids_bytes(ids) -> bytes:
    return np.asarray(list(ids), dtype="<i4").tobytes()


def fingerprint_ids(ids) -> str:
    return hashlib.sha256(ids_bytes(ids)).hexdigest()


def _byte_view(t) -> memoryview:
    """The raw bytes of a tensor without a copy (one device-to-host copy for a GPU tensor)."""
    import torch

    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def host_copies(tensors: list) -> list:
    """The tensors on the host, contiguous, in order. GPU tensors go through one page-locked buffer with one
    asynchronous copy each and a single wait: a pageable copy per tensor runs several times slower and made the
    device-to-host copy, not the hashing or the disk, the bottleneck of fingerprinting and dumping a GPU cache."""
    import torch

    tensors = [t.detach() for t in tensors]
    on_gpu = [t.is_cuda for t in tensors]
    if not any(on_gpu):
        return [t.contiguous() for t in tensors]
    sizes = [t.numel() * t.element_size() if cuda else 0 for t, cuda in zip(tensors, on_gpu)]
    slots = [-(-size // 64) * 64 for size in sizes]  # each tensor's bytes start 64-byte aligned
    buffer = torch.empty(sum(slots), dtype=torch.uint8, pin_memory=True)
    out, offset = [], 0
    for t, cuda, size, slot in zip(tensors, on_gpu, sizes, slots):
        if not cuda:
            out.append(t.contiguous())
            continue
        host = buffer[offset:offset + size].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        out.append(host)
        offset += slot
    for device in {t.device for t, cuda in zip(tensors, on_gpu) if cuda}:
        torch.cuda.synchronize(device)
    return out


def tensor_bytes(t) -> bytes:
    """Raw bytes of a tensor in its own dtype (bf16 included), row-major."""
    return _byte_view(t).tobytes()


def fingerprint_tensor(t) -> str:
    return hashlib.sha256(_byte_view(t)).hexdigest()


PARALLEL_HASH_BYTES = 4 << 20  # from this size on, the per-tensor hashes of a cache run in threads

# The whole-cache fingerprint's definition, recorded in every file's provenance (software_versions) and in every
# cache dump, so that fingerprints made by another definition are refused rather than compared
# (check_fingerprint_scheme). "sha256-list-v2": see fingerprint_layers. Before it, with no name recorded, the
# whole-cache fingerprint was one sequential sha256 over every layer's K bytes then V bytes.
CACHE_FINGERPRINT_SCHEME = "sha256-list-v2"
SCHEME_KEY = "cache_fingerprint_scheme"  # its key in a provenance record
_CACHE_FINGERPRINT_TAG = b"stagereplay-cache-v2\0"


def _digests(views: list[memoryview]) -> list[bytes]:
    """The sha256 digest of each buffer, in order; in a thread pool when they are large (hashlib releases the
    GIL), one buffer per task. pool.map keeps the input order whatever the threads' schedule."""
    def one(b) -> bytes:
        return hashlib.sha256(b).digest()

    if len(views) < 2 or sum(b.nbytes for b in views) < PARALLEL_HASH_BYTES:
        return [one(b) for b in views]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(views), max(2, min(8, os.cpu_count() or 2)))) as pool:
        return list(pool.map(one, views))


def combine_digests(digests: list[bytes]) -> str:
    """The whole-cache fingerprint of tensors with these sha256 digests (in order layer 0 K, layer 0 V, layer 1 K,
    ...): sha256 over ``b"stagereplay-cache-v2\\0"``, the number of digests as a little-endian uint64, then the
    32-byte digests themselves."""
    whole = hashlib.sha256(_CACHE_FINGERPRINT_TAG + struct.pack("<Q", len(digests)))
    for d in digests:
        whole.update(d)
    return whole.hexdigest()


def fingerprint_layers(layers) -> tuple[str, list[str], list[str]]:
    """(whole-cache fingerprint, per-layer K fingerprints, per-layer V fingerprints).

    Each per-layer fingerprint is the plain sha256 of that tensor's raw bytes (as :func:`fingerprint_tensor`).
    The whole-cache fingerprint (scheme :data:`CACHE_FINGERPRINT_SCHEME`, ``sha256-list-v2``) is a hash list over
    them: sha256 of ``b"stagereplay-cache-v2\\0"`` + the number of tensors (2 x layers) as a little-endian uint64
    + the raw 32-byte digests in the order layer 0 K, layer 0 V, layer 1 K, layer 1 V, ... (:func:`combine_digests`).
    The tag keeps it apart from any plain sha256 of bytes; an empty cache gives the hash of the tag and a zero
    count. It still changes with any byte of any tensor, and with the tensors' order and number.

    Every byte is hashed exactly once, in place (no copy); a large cache's per-tensor hashes run in threads
    (hashlib releases the GIL), so on several cores the fingerprints cost a fraction of one sha256 pass.
    """
    flat = [_byte_view(t) for t in host_copies([t for pair in layers for t in pair])]
    digests = _digests(flat)
    hexes = [d.hex() for d in digests]
    return combine_digests(digests), hexes[0::2], hexes[1::2]


class FingerprintSchemeError(ValueError):
    """A file whose cache fingerprints were made by another definition than this code's: not comparable."""


def _leaf_records(record: dict) -> list[dict]:
    """A provenance record's own records: a gathered file's parts (recursively), else the record itself."""
    if record.get("parts"):
        return [leaf for part in record["parts"] for leaf in _leaf_records(part)]
    return [record]


def holds_cache_fingerprints(path: str | Path) -> bool:
    """Whether a Parquet file has a cache-fingerprint column (``cache_fingerprint``, ``live_cache_fingerprint``,
    ...)."""
    try:
        names = pq.read_schema(path).names
    except (OSError, pa.ArrowException) as exc:
        raise CorruptFileError(f"{path} is not a readable Parquet file ({exc})") from exc
    return any("cache_fingerprint" in name for name in names)


def check_fingerprint_scheme(path: str | Path, provenance: dict | None = None, rerun: str | None = None) -> None:
    """Refuse (:class:`FingerprintSchemeError`, naming ``path`` and the fix) a file whose cache fingerprints were
    not made by this code's :data:`CACHE_FINGERPRINT_SCHEME`: recorded fingerprints are compared with recomputed
    ones only when both follow one definition.

    ``provenance`` is the record to check (a Parquet file's provenance, or ``{SCHEME_KEY: ...}`` from a cache
    dump's metadata); without it, the Parquet file's own provenance is read, and a file without a cache-fingerprint
    column passes (token-id fingerprints did not change). Every part of a gathered file must name the scheme.
    ``rerun`` names the rule(s) to rerun in the message; by default the stages that the refused records name.
    """
    if provenance is None:
        if not holds_cache_fingerprints(path):
            return
        provenance = read_provenance(path)
    stale = [r for r in _leaf_records(provenance) if r.get(SCHEME_KEY) != CACHE_FINGERPRINT_SCHEME]
    if not stale:
        return
    missing = any(r.get(SCHEME_KEY) is None for r in stale)
    others = sorted({str(r[SCHEME_KEY]) for r in stale if r.get(SCHEME_KEY) is not None})
    if rerun is None:
        stages = sorted({str(r["stage"]) for r in stale if r.get("stage")})
        rerun = " ".join(stages) if stages else "<the rule that makes it>"
    older = ("an older scheme (none recorded: the single sequential sha256 over all the cache's bytes, used before "
             "the scheme was named)")
    found = older if not others else (f"another scheme ({', '.join(others)})"
                                      + (f" and, in some parts, by {older}" if missing else ""))
    raise FingerprintSchemeError(
        f"{path}: its cache fingerprints were made by {found}, not this code's {CACHE_FINGERPRINT_SCHEME!r}, so "
        "they cannot be compared with the fingerprints it recomputes. Rerun the stages that wrote it: delete "
        f"results/<run> and run snakemake again, or rerun with `snakemake --forcerun {rerun}`"
    )


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


def software_versions() -> dict:
    import torch
    import transformers

    from . import __version__

    return {
        "stagereplay": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": git_commit(),
        SCHEME_KEY: CACHE_FINGERPRINT_SCHEME,
    }


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
