"""Content fingerprints of a run's input files (the dataset file, a model's files), cheap to take again.

A file's sha256 is computed once and remembered in a small JSON cache together with the file's size and
modification time; while both are unchanged the remembered digest is used, so fingerprinting a 30 GB model
costs a ``stat`` per file after the first time. A file changed in place (new size or mtime) is hashed again:
a real change of content changes its fingerprint, a ``touch`` does not.

A set of files has one fingerprint: the sha256 over the sorted ``name:digest`` lines of its files
(:func:`files_fingerprint`), so it changes when any file is added, removed, renamed or edited.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from stagereplay.io.parquet import write_text_atomic

# Where the workflow keeps the cache, relative to its working directory (next to Snakemake's own metadata).
DEFAULT_CACHE = Path(".snakemake") / "stagereplay" / "file_hashes.json"
CHUNK = 1 << 22


def sha256_of_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


class HashCache:
    """Remembered digests, keyed by the file's resolved path and valid while its size and mtime stay the same."""

    def __init__(self, path: str | Path | None = DEFAULT_CACHE):
        self.path = None if path is None else Path(path)
        self.entries: dict[str, dict] = {}
        self.changed = False
        if self.path is not None and self.path.is_file():
            try:
                self.entries = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self.entries = {}  # a damaged cache only costs hashing again

    def sha256(self, path: str | Path) -> str:
        resolved = Path(path).resolve()
        stat = resolved.stat()
        key = str(resolved)
        entry = self.entries.get(key)
        if entry and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
            return entry["sha256"]
        digest = sha256_of_file(resolved)
        self.entries[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        self.changed = True
        return digest

    def remember(self, path: str | Path, digest: str) -> None:
        """Record ``digest`` for a file whose bytes the caller hashed as it wrote them (no second read)."""
        resolved = Path(path).resolve()
        stat = resolved.stat()
        self.entries[str(resolved)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        self.changed = True

    def save(self) -> None:
        """Write the cache if it gained entries (atomically: concurrent jobs lose at most an entry, never the file)."""
        if self.path is None or not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps(self.entries, indent=0, sort_keys=True))
            self.changed = False
        except OSError:
            pass  # a read-only working directory: the digests are recomputed next time


def files_fingerprint(files: dict[str, str | Path], cache: HashCache | None = None) -> dict:
    """``{"sha256": <over all files>, "files": {name: sha256}}`` for ``files`` (name -> path)."""
    cache = cache or HashCache(None)
    digests = {name: cache.sha256(path) for name, path in sorted(files.items())}
    combined = hashlib.sha256("".join(f"{name}:{d}\n" for name, d in digests.items()).encode()).hexdigest()
    return {"sha256": combined, "files": digests}


def folder_files(folder: str | Path) -> dict[str, Path]:
    """The regular files directly in ``folder`` (symbolic links followed, hidden names skipped), by name."""
    folder = Path(folder)
    return {p.name: p for p in sorted(folder.iterdir()) if not p.name.startswith(".") and p.is_file()}


def size_of(files: dict[str, str | Path]) -> int:
    return sum(os.stat(p).st_size for p in files.values())
