"""Fingerprints: sha256 over exact bytes, the ground truth every comparison in the pipeline rests on.

Token ids are hashed as little-endian int32, cache tensors as their raw storage bytes; a whole cache's fingerprint
is a sha256 over its tensors' digests (:func:`fingerprint_layers`, scheme :data:`CACHE_FINGERPRINT_SCHEME`, recorded
in every file's provenance). Nothing here compares with a tolerance.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stagereplay.io.parquet import CorruptFileError, read_provenance

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
    out, done = _queue_host_copies(tensors)
    if done is not None:
        done.synchronize()
    return out


def _queue_host_copies(tensors: list) -> tuple[list, object]:
    """:func:`host_copies` without the wait: the copies queued on the current stream, and an event recorded after
    them (None where no tensor is on a GPU). The host tensors hold the bytes the device held when the copies were
    queued, whatever later work on that stream writes."""
    import torch

    tensors = [t.detach() for t in tensors]
    on_gpu = [t.is_cuda for t in tensors]
    if not any(on_gpu):
        return [t.contiguous() for t in tensors], None
    devices = {t.device for t, cuda in zip(tensors, on_gpu) if cuda}
    if len(devices) > 1:  # one event marks one device's stream
        for device in devices:
            torch.cuda.synchronize(device)
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
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(next(iter(devices))))
    return out, done


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
    return _fingerprints_of(host_copies([t for pair in layers for t in pair]))


class PendingFingerprints:
    """:func:`fingerprint_layers` of a cache as it is now, begun without waiting for the device.

    On a GPU the cache's bytes are copied to page-locked memory on the current stream (a snapshot: later steps may
    write the same tensors) and hashed in a worker thread once copied, so that a decode goes on while its boundary
    caches are fingerprinted; :meth:`result` waits for the hashes. On the host the fingerprints are taken at once.
    Either way :meth:`result` is what :func:`fingerprint_layers` gives for the cache at the time of the call
    (tests/test_ledger.py)."""

    def __init__(self, layers):
        flat, done = _queue_host_copies([t for pair in layers for t in pair])
        if done is None:
            self._value, self._future = _fingerprints_of(flat), None
            return
        self._value = None

        def later():
            done.synchronize()
            return _fingerprints_of(flat)

        self._future = _hash_worker().submit(later)

    def result(self) -> tuple[str, list[str], list[str]]:
        return self._value if self._future is None else self._future.result()


def _fingerprints_of(flat: list) -> tuple[str, list[str], list[str]]:
    """(whole, K, V) fingerprints of contiguous host tensors in the order layer 0 K, layer 0 V, ..."""
    digests = _digests([_byte_view(t) for t in flat])
    hexes = [d.hex() for d in digests]
    return combine_digests(digests), hexes[0::2], hexes[1::2]


_WORKER = []


def _hash_worker():
    """The one thread that hashes pending fingerprints (hashlib releases the GIL: it runs beside the decode)."""
    if not _WORKER:
        from concurrent.futures import ThreadPoolExecutor

        _WORKER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="fingerprints"))
    return _WORKER[0]


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



def tensor_digest(t) -> str:
    """sha256 over a tensor's dtype, shape and raw bytes: what a prepared snapshot's manifest records per tensor."""
    import torch

    t = t.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        digest.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def weights_sha256(digests: dict[str, str]) -> str:
    """One sha256 over a model's tensor digests (name: digest lines, sorted by name)."""
    return hashlib.sha256("".join(f"{n}:{d}\n" for n, d in sorted(digests.items())).encode()).hexdigest()
