"""Where a revision's model comes from: a local folder, a Hugging Face hub snapshot or a GGUF file, and the checks
on its files that need no weights loaded (safetensors headers, pickles refused, shard indexes whole).

Imports no torch and no transformers: the workflow resolves sources and fingerprints them when it plans
(:func:`source_fingerprint`), and jobs that load no model read them too. A job goes from the config's ``model`` to
loaded weights through :func:`stagereplay.models.opening.open_model` alone.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from stagereplay.io.file_hashes import HashCache, files_fingerprint, folder_files

# Architectures whose every layer keeps a plain full-attention DynamicCache layer: the engine's cache code
# (fingerprints, dumps, transplants) is only correct for those.
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


class ModelLoadError(ValueError):
    """A model source that cannot be loaded, with what to do about it."""


class SourceChangedError(RuntimeError):
    """A model source whose files are not the ones the workflow planned the job with."""


# Files a hub snapshot needs: config, tokenizer, chat template, safetensors weights (pickles only when allowed).
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]
PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth"]


def revision_slug(name: str) -> str:
    """Filesystem-safe slug of a revision name (no path separators, no leading dots)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)).strip("-.")
    if not slug:
        raise ValueError(f"revision {name!r} has no filesystem-safe characters; give it a plain name")
    return slug



@dataclass
class ModelSource:
    """Where a revision's weights come from."""

    kind: str  # "local" | "gguf" | "hub"
    path: str  # folder, GGUF file, or hub id
    revision: str | None = None  # hub revision
    gguf_file: str | None = None

    def describe(self) -> str:
        if self.kind == "hub":
            return f"{self.path}@{self.revision}"
        if self.kind == "gguf":
            return str(Path(self.path) / self.gguf_file)
        return self.path


@dataclass(frozen=True)
class PlannedSource:
    """A revision's model source as the workflow planned a job with it: the config's ``model`` and revision, the
    fingerprint of its files taken when the workflow planned (None outside the workflow, or for a hub model not
    cached yet), and how its files may be read."""

    model: str
    revision: str | None
    base_dir: str = "."
    fingerprint: dict | None = None  # {"source", "sha256", "files"}
    trust_remote_code: bool = False
    allow_pickle: bool = False
    offline: bool = True

    def resolve(self) -> ModelSource:
        return resolve_source(self.model, self.revision, self.base_dir)


def resolve_source(model: str, revision: str | None, base_dir: str | Path = ".") -> ModelSource:
    """Turn the config's ``model`` and one of its ``revisions`` into a concrete source.

    - ``model`` a folder holding a subfolder named ``revision``: that subfolder (how the embedded toy keeps
      its primary and later revisions);
    - ``model`` a folder and ``revision`` a ``.gguf`` file in it, or ``model`` a ``.gguf`` file: GGUF;
    - ``model`` a folder with a ``config.json`` and ``revision`` empty or ``local``: the folder itself;
    - otherwise ``model`` is a hub id and ``revision`` a hub revision (branch, tag or commit).
    """
    base = Path(base_dir)
    candidate = Path(model) if Path(model).is_absolute() else base / model
    if str(model).endswith(".gguf"):
        if not candidate.is_file():
            raise ModelLoadError(f"model: GGUF file {model!r} does not exist; check the path in the config")
        return ModelSource("gguf", str(candidate.parent), gguf_file=candidate.name)
    if candidate.is_dir():
        if revision and str(revision).endswith(".gguf"):
            if not (candidate / revision).is_file():
                raise ModelLoadError(f"revisions: GGUF file {revision!r} not found in {candidate}")
            return ModelSource("gguf", str(candidate), gguf_file=str(revision))
        if revision and (candidate / revision).is_dir():
            return ModelSource("local", str(candidate / revision))
        if (candidate / "config.json").is_file() and revision in (None, "", "local"):
            return ModelSource("local", str(candidate))
        raise ModelLoadError(
            f"revisions: {revision!r} is neither a subfolder of the local model folder {candidate} "
            f"nor a GGUF file in it; name one of: "
            f"{sorted(p.name for p in candidate.iterdir() if p.is_dir() or p.suffix == '.gguf')}"
        )
    looks_like_path = str(model).startswith((".", "/", "~")) or os.sep in str(model).strip("/").replace("/", "", 1)
    if looks_like_path or str(model).count("/") != 1:
        raise ModelLoadError(
            f"model: {model!r} is not an existing folder or GGUF file, nor a hub id of the form 'org/name'; "
            "check the path"
        )
    return ModelSource("hub", str(model), revision=revision or "main")


def go_offline() -> None:
    """No network for the hub, in this process and its children.

    huggingface_hub reads ``HF_HUB_OFFLINE`` once, when it is imported (transformers imports it), so setting
    the variable afterwards alone would leave this process online: the flag it read is set too.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


def hub_cache_dir() -> str | None:
    """The Hugging Face hub cache, read from the environment at call time (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def fetch_hub_snapshot(source: ModelSource, offline: bool, allow_pickle: bool = False) -> tuple[ModelSource, str]:
    """A hub source as the local snapshot folder holding it, and the commit that revision resolved to.

    Offline, only the local Hugging Face cache is read; online, missing files are downloaded (and a hub that
    cannot be reached falls back to the cache). Only config, tokenizer and safetensors files are fetched.
    """
    from huggingface_hub import snapshot_download

    patterns = HUB_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])
    try:
        folder = snapshot_download(source.path, revision=source.revision, cache_dir=hub_cache_dir(),
                                   local_files_only=offline, allow_patterns=patterns)
    except Exception as exc:  # LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError, ...
        where = hub_cache_dir() or "the default Hugging Face cache (~/.cache/huggingface/hub)"
        if offline:
            raise ModelLoadError(
                f"model {source.describe()} is not in the local Hugging Face cache ({where}) and offline: true "
                f"forbids downloading it. Download it first on a machine with network access "
                f"(huggingface-cli download {source.path} --revision {source.revision}) into that cache, "
                f"or set offline: false ({type(exc).__name__}: {exc})"
            ) from exc
        raise ModelLoadError(f"cannot fetch {source.describe()} from the hub or find it in {where}: {exc}") from exc
    return ModelSource("local", folder), Path(folder).name


def check_weights_format(source: ModelSource, allow_pickle: bool) -> None:
    if source.kind != "local":
        return
    folder = Path(source.path)
    has_safetensors = any(folder.glob("*.safetensors"))
    has_pickle = any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth"))
    if not has_safetensors and has_pickle and not allow_pickle:
        raise ModelLoadError(
            f"{folder} holds only pickled weights (*.bin/*.pt), which can run code when loaded; convert them "
            "to safetensors, or set allow_pickle: true in the model config if you trust the file"
        )
    if not has_safetensors and not has_pickle:
        raise ModelLoadError(f"{folder} holds no weights (*.safetensors); is this the right folder?")
    for path in sorted(folder.glob("*.safetensors")):
        check_safetensors_file(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a readable safetensors index ({exc}); copy it again") from exc
        absent = sorted(s for s in shards if not (folder / s).is_file())
        if absent:
            raise ModelLoadError(f"{index} names weight files that are not in {folder}: {absent}; copy or "
                                 "download them (every shard the index lists)")


# A safetensors header is JSON of a few KB to a few MB; a larger length means the file is something else.
MAX_SAFETENSORS_HEADER = 100 * 2**20


def check_safetensors_file(path: str | Path) -> None:
    """Refuse a safetensors file that is cut short or is not one, reading its header only (never the weights).

    The file is an 8-byte little-endian header length, the JSON header, then the tensor data; every tensor's
    ``data_offsets`` index into that data, so the file's size must be exactly 8 + header + the largest end.
    A copy or download that stopped early is smaller.
    """
    path = Path(path)
    size = path.stat().st_size
    fix = "copy or download it again"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path} is not a safetensors file (only {size} bytes); {fix}")
        (n_header,) = struct.unpack("<Q", head)
        if n_header > min(MAX_SAFETENSORS_HEADER, size - 8):
            raise ModelLoadError(f"{path} is truncated or not a safetensors file: its header claims {n_header} "
                                 f"bytes of a {size}-byte file; {fix}")
        try:
            header = json.loads(f.read(n_header))
            ends = [int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ModelLoadError(f"{path} has an unreadable safetensors header ({exc}); {fix}") from exc
    expected = 8 + n_header + max(ends, default=0)
    if size != expected:
        raise ModelLoadError(
            f"{path} is {'truncated' if size < expected else 'longer than its header says'}: it has {size} bytes, "
            f"its header describes {expected} ({len(ends)} tensors); {fix}"
        )


# ---- The source's files by content -----------------------------------------------------------------------------------
def source_files(source: ModelSource) -> dict[str, Path] | None:
    """The files a model source is loaded from, by name; None for a hub model not in the local cache."""
    if source.kind == "gguf":
        return {source.gguf_file: Path(source.path) / source.gguf_file}
    if source.kind == "hub":
        try:
            source, _ = fetch_hub_snapshot(source, offline=True)
        except ModelLoadError:
            return None
    return folder_files(source.path)


def source_fingerprint(source: ModelSource, cache: HashCache | None = None) -> dict | None:
    """``{"source", "sha256", "files"}`` over the files of a source; None for a hub model not in the local cache."""
    files = source_files(source)
    if files is None:
        return None
    return {"source": source.describe(), **files_fingerprint(files, cache)}


def check_source_unchanged(source: ModelSource, recorded: dict | None, cache: HashCache | None = None) -> None:
    """Refuse a source whose files are no longer the ones ``recorded`` (:func:`source_fingerprint` when the
    workflow planned the job) describes; nothing to check where nothing was recorded."""
    if not recorded or not recorded.get("sha256"):
        return
    try:  # the digests alone: the recorded fingerprint names the source
        files = source_files(source)
        now = {} if files is None else files_fingerprint(files, cache)
    except OSError:
        now = {}
    if now.get("sha256") != recorded["sha256"]:
        changed = sorted(name for name in set(recorded["files"]) | set(now.get("files", {}))
                         if recorded["files"].get(name) != now.get("files", {}).get(name))
        raise SourceChangedError(
            f"the model files of {recorded['source']} changed after this run was planned ({', '.join(changed)}); "
            "rerun the workflow so that every result comes from one set of weights")
