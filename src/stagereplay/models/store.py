"""The model store: prepared snapshots of model sources, shared by every run that uses the same source.

A snapshot (:mod:`stagereplay.models.snapshot`) is what loading a source at a precision gives, written once as
safetensors. The store keeps each one in a folder named by its **key**: the sha256 of the source's files (their
content, not their path: the same file through a symlink or copied elsewhere has the same key), the precision, and
the versions of the packages that convert it (a new transformers may convert a GGUF differently). Nothing else is in
the key: not the run's name, the path, the thread count or this package's version, so a second run on the same
source prepares nothing.

The store is a folder outside any run's results: ``model_store`` in the config, else ``$STAGEREPLAY_MODEL_STORE``,
else ``$XDG_CACHE_HOME/stagereplay/models`` (``~/.cache/stagereplay/models``). Several runs may prepare and read
it at once: an entry is prepared under a lock of its key, written into a hidden folder and renamed into place, and a
valid entry is never replaced. Each entry records the size, modification time and sha256 of its files when it was
written (``.hashes.json``): checking an entry costs a ``stat`` per file; one whose files changed, went missing or
were added is not valid (:meth:`ModelStore.problems`), and preparing moves it aside and writes it again.

``stagereplay-store list`` shows the entries with size, source and last use; ``stagereplay-store remove KEY...``
(or ``--unused-days N``) removes them. Knows nothing of Snakemake or stages; imports no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import sys
import time
from pathlib import Path

from stagereplay.io.file_hashes import HashCache, files_fingerprint, folder_files, size_of
from stagereplay.models.sources import ModelLoadError

STORE_ENV = "STAGEREPLAY_MODEL_STORE"
# What a snapshot holds for the same source and versions: a change of it (another file layout, another converter)
# gives every entry a new key.
KEY_FORMAT = 2
MANIFEST = "stagereplay_snapshot.json"
HASHES = ".hashes.json"
LAST_USED = ".last_used"
# Packages whose code turns a source into a snapshot's bytes, by source kind: only those a source's conversion
# runs (an optional package that takes no part, such as gguf for a safetensors model, is not among them).
CONVERTERS = {
    "gguf": ("torch", "transformers", "safetensors", "tokenizers", "gguf", "numpy"),
    "local": ("torch", "transformers", "safetensors", "tokenizers"),
    "hub": ("torch", "transformers", "safetensors", "tokenizers"),
}


class StoreError(ModelLoadError):
    """A store entry that is missing, damaged, or not the one a run was planned with."""


def default_root() -> Path:
    if os.environ.get(STORE_ENV):
        return Path(os.environ[STORE_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(cache) / "stagereplay" / "models"


def resolve_root(configured: str | None = None) -> Path:
    """The store's folder: the config's ``model_store`` where given, else the default (:func:`default_root`)."""
    return Path(configured).expanduser() if configured else default_root()


def installed_versions(names) -> dict:
    """{name: its installed version, or None}, read from the packages' metadata (the workflow takes them when it
    plans, without importing them)."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in names:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def converter_versions(source_kind: str) -> dict:
    """The installed versions of the packages that convert a source of ``source_kind``."""
    return installed_versions(CONVERTERS[source_kind])


def entry_key(source_sha256: str, source_kind: str, precision: str) -> str:
    """The key of a source's snapshot at ``precision``: readable precision, then 24 hex digits of the sha256 of
    the source's content digest, the precision and the converters' versions."""
    ident = {"format": KEY_FORMAT, "source_sha256": source_sha256, "precision": precision,
             "software": converter_versions(source_kind)}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    return f"{precision}-{digest[:24]}"


def planned_keys(fingerprint: dict | None, source_kind: str | None, precisions) -> dict[str, str | None]:
    """{precision: key} for a source fingerprinted when the workflow planned (None where it could not be, as a
    hub model not yet in the local cache: its job takes the fingerprint after downloading)."""
    sha = (fingerprint or {}).get("sha256")
    return {p: entry_key(sha, source_kind, p) if sha and source_kind else None for p in precisions}


class ModelStore:
    def __init__(self, root: str | Path | None = None):
        self.root = resolve_root(str(root) if root else None)

    def path(self, key: str) -> Path:
        return self.root / key

    # ---- Locks and atomic writes ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self, keys):
        """Exclusive locks of ``keys`` (taken in sorted order, so two preparers never wait on each other)."""
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            for key in sorted(set(keys)):
                handle = stack.enter_context(open(locks / f"{key}.lock", "w"))
                fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def new_folder(self, key: str) -> Path:
        """A hidden folder to write ``key``'s entry into, on the store's file system (so that it renames)."""
        tmp = self.root / ".incoming" / f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, key: str, folder: Path, digests: dict[str, str] | None = None) -> Path:
        """Rename a written ``folder`` into place as ``key``'s entry and record its files' stat and sha256
        (``digests`` where the writer took them while writing, else read now). Call under :meth:`locked`."""
        final = self.path(key)
        if final.exists():
            raise StoreError(f"store entry {final} exists; a valid entry is never replaced")
        os.rename(folder, final)
        cache = HashCache(final / HASHES)
        files = folder_files(final)
        for name, path in files.items():
            if digests and name in digests:
                cache.remember(path, digests[name])
            else:
                cache.sha256(path)
        cache.changed = True
        cache.save()
        return final

    def discard(self, key: str) -> None:
        """Move an entry aside and delete it (a reader that has it open keeps what it opened)."""
        path = self.path(key)
        if not path.exists():
            return
        trash = self.root / ".trash" / f"{key}.{secrets.token_hex(4)}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    # ---- Reading ----------------------------------------------------------------------------------------------------
    def manifest(self, key: str) -> dict | None:
        try:
            return json.loads((self.path(key) / MANIFEST).read_text())
        except (OSError, ValueError):
            return None

    def problems(self, key: str, source_sha256: str | None = None) -> list[str]:
        """Why ``key``'s entry cannot be used (empty: it is whole and made from ``source_sha256``'s files): a
        ``stat`` per file where its record holds them, a read where a file changed size or modification time."""
        path = self.path(key)
        if not path.is_dir():
            return [f"{path} does not exist"]
        manifest = self.manifest(key)
        if manifest is None:
            return [f"{path} has no readable {MANIFEST}"]
        made_from = (manifest.get("source_fingerprint") or {}).get("sha256")
        if source_sha256 and made_from != source_sha256:
            return [f"{path} was prepared from files with sha256 {str(made_from)[:16]}, not {source_sha256[:16]}"]
        expected = manifest["snapshot"]["files"]
        try:
            present = folder_files(path)
        except OSError as exc:
            return [f"{path} cannot be listed ({exc})"]
        present.pop(MANIFEST, None)
        broken = sorted(name for name, p in present.items() if not p.exists())
        missing = sorted(set(expected) - set(present))
        added = sorted(set(present) - set(expected))
        problems = [f"{path}: {', '.join(names)} {what}" for names, what in
                    ((missing, "missing"), (added, "not among the files it was prepared with"), (broken, "a broken link"))
                    if names]
        if problems:
            return problems
        now = files_fingerprint(present, HashCache(path / HASHES))["files"]
        changed = sorted(name for name in expected if now.get(name) != expected[name])
        return [f"{path}: {', '.join(changed)} changed since it was prepared"] if changed else []

    def touch(self, key: str) -> None:
        """Record a use of ``key`` (for ``stagereplay-store list``); a read-only store only loses the date."""
        with contextlib.suppress(OSError):
            (self.path(key) / LAST_USED).write_text(datetime.datetime.now().isoformat(timespec="seconds") + "\n")

    def entries(self) -> list[dict]:
        """Every entry: key, precision, source, source sha256, mode, size in bytes, when prepared and last used."""
        if not self.root.is_dir():
            return []
        rows = []
        for path in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            manifest = self.manifest(path.name) or {}
            files = folder_files(path)
            linked = manifest.get("mode") == "linked"
            used = path / LAST_USED
            rows.append({
                "key": path.name,
                "precision": manifest.get("precision"),
                "source": manifest.get("source"),
                "source_sha256": (manifest.get("source_fingerprint") or {}).get("sha256"),
                "mode": manifest.get("mode"),
                # linked files are the source's own: they take no room in the store
                "bytes": sum(os.lstat(p).st_size for p in files.values()) if linked else size_of(files),
                "prepared": datetime.datetime.fromtimestamp((path / MANIFEST).stat().st_mtime).isoformat(
                    timespec="seconds") if (path / MANIFEST).exists() else None,
                "last_used": used.read_text().strip() if used.exists() else None,
            })
        return rows


# ---- The run's record of the entries it uses -------------------------------------------------------------------------
def read_record(path: str | Path) -> dict:
    """A run's record of the store entries it uses (``results/<run>/models/<revision>.json``, written by the
    prepare_model stage): the store's folder, the source's sha256, and per precision the entry's key and the
    sha256 of its snapshot."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path} is not a readable record of prepared models ({exc}); delete it and rerun the "
                         "workflow (rule prepare_model writes it)") from exc


# ---- Preparing: what the prepare_model stage does before any job loads a model ---------------------------------------
def ensure(store: ModelStore, keys: dict[str, str], source_sha256: str | None, prepare) -> dict[str, dict]:
    """Make sure ``store`` holds a valid entry for every ``{precision: key}``, preparing the missing ones with
    one call ``prepare({precision: folder}) -> {precision: digests or None}`` (every precision the run needs from
    one read of the source); returns each entry's manifest and path. Entries that are damaged are moved aside and
    prepared again. Locks the keys while it checks and prepares, so concurrent runs prepare a key once."""
    if not any(store.problems(key, source_sha256) for key in keys.values()):
        return _entries(store, keys, {})  # all whole: read only, so that a read-only store serves its entries
    with store.locked(keys.values()):
        missing = {}
        for precision, key in keys.items():
            problems = store.problems(key, source_sha256)
            if problems and store.path(key).exists():
                store.discard(key)  # damaged or made from other files: never loaded, prepared again
            if problems:
                missing[precision] = key
        if missing:
            folders = {precision: store.new_folder(key) for precision, key in missing.items()}
            try:
                digests = prepare(folders) or {}
                for precision, key in missing.items():
                    store.commit(key, folders[precision], digests.get(precision))
            finally:
                for folder in folders.values():
                    shutil.rmtree(folder, ignore_errors=True)
        return _entries(store, keys, missing)


def _entries(store: ModelStore, keys: dict[str, str], prepared_now) -> dict[str, dict]:
    out = {}
    for precision, key in keys.items():
        store.touch(key)
        out[precision] = {"key": key, "path": str(store.path(key)), "manifest": store.manifest(key),
                          "prepared_now": precision in prepared_now}
    return out


# ---- The command line ------------------------------------------------------------------------------------------------
def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stagereplay-store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", help=f"the store's folder (default: ${STORE_ENV}, else ~/.cache/stagereplay/"
                                        "models; a run's config names its own with model_store)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every entry with its size, source and last use")
    check = commands.add_parser("check", help="check every entry's files against its record (or the keys given)")
    check.add_argument("keys", nargs="*")
    remove = commands.add_parser("remove", help="remove the entries given (a run that needs one prepares it again)")
    remove.add_argument("keys", nargs="*")
    remove.add_argument("--unused-days", type=float, help="remove every entry not used for this many days")
    remove.add_argument("--all", action="store_true", help="remove every entry")
    args = parser.parse_args(argv)
    store = ModelStore(args.store)
    rows = store.entries()
    if args.command == "list":
        print(f"{store.root}: {len(rows)} entries, {_size(sum(r['bytes'] for r in rows))}")
        for r in rows:
            print(f"{r['key']}  {_size(r['bytes']):>9}  {r['mode'] or '?':9}  last used {r['last_used'] or 'never'}  "
                  f"{r['source']} (sha256 {str(r['source_sha256'])[:12]})")
        return 0
    known = {r["key"] for r in rows}
    if args.command == "check":
        bad = 0
        for key in args.keys or sorted(known):
            problems = store.problems(key)
            bad += bool(problems)
            print(f"{key}: {'; '.join(problems) if problems else 'ok'}")
        return 1 if bad else 0
    if args.all:
        chosen = sorted(known)
    elif args.unused_days is not None:
        cutoff = time.time() - args.unused_days * 86400
        chosen = [r["key"] for r in rows if _last_use(store, r["key"]) < cutoff]
    else:
        chosen = args.keys
    unknown = sorted(set(chosen) - known)
    if unknown:
        print(f"not in {store.root}: {', '.join(unknown)} (stagereplay-store list shows the keys)", file=sys.stderr)
        return 2
    if not chosen:
        print("nothing to remove: name keys, --unused-days N or --all", file=sys.stderr)
        return 2
    with store.locked(chosen):
        for key in chosen:
            store.discard(key)
            print(f"removed {key}")
    return 0


def _last_use(store: ModelStore, key: str) -> float:
    for name in (LAST_USED, MANIFEST):
        with contextlib.suppress(OSError):
            return (store.path(key) / name).stat().st_mtime
    return 0.0


if __name__ == "__main__":
    sys.exit(main())
