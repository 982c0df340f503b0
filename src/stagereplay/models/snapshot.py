"""A revision's model source prepared once: a local safetensors snapshot of it at one precision.

Every model-loading job used to load the run's model source again: a GGUF file is dequantised tensor by tensor
in numpy at every load, a checkpoint stored in another dtype is cast at every load. A prepared snapshot holds what
:func:`~stagereplay.models.loading.load_model` makes of the source at a precision, written once: the weights in
that dtype as safetensors (memory-mapped when loaded), the config, generation config and tokenizer files, and a
manifest (:data:`MANIFEST`) with the source's fingerprint, the snapshot's, and the sha256 of every tensor as
loaded.

Preparing proves the snapshot before it is kept: it is loaded back through ``load_model`` and every tensor and
buffer (bytes, dtype, shape), the weight tying, the model and generation configs and the tokenizer (its whole
pipeline, special tokens, chat template and probe encodings) must equal what loading the source gave, or the
preparation fails naming what differs (:func:`~stagereplay.models.signatures.compare_signatures`). A local or hub
safetensors checkpoint whose floating-point tensors are already in the precision's dtype is linked instead
(:func:`can_link`): loading the links reads the very bytes loading the source reads, so there is nothing to convert
or to prove.

Knows nothing of Snakemake, stages or the ledger.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
from pathlib import Path

import torch

from stagereplay.io.file_hashes import HashCache, files_fingerprint, folder_files
from stagereplay.io.fingerprints import weights_sha256
from stagereplay.models import compat
from stagereplay.models.loading import (
    PRECISIONS,
    LoadedModel,
    checked_config,
    checked_tokenizer,
    load_model,
)
from stagereplay.models.signatures import (
    compare_signatures,
    model_signature,
    software_versions,
    tensor_digests,
)
from stagereplay.models.sources import ModelLoadError, ModelSource, fetch_hub_snapshot
from stagereplay.models.store import HASHES

MANIFEST = "stagereplay_snapshot.json"
MANIFEST_FORMAT = 1
# Weight files of a source that a snapshot replaces with its own safetensors (and their shard indexes).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class SnapshotError(ModelLoadError):
    """A snapshot that does not reproduce its source, or is not the one a job was planned with."""


# ---- Preparing ---------------------------------------------------------------------------------------------------------
def local_folder(source: ModelSource, offline: bool, allow_pickle: bool) -> Path | None:
    """The folder a local or hub source loads from (a hub snapshot fetched into its cache); None for GGUF."""
    if source.kind == "gguf":
        return None
    if source.kind == "hub":
        source, _ = fetch_hub_snapshot(source, offline, allow_pickle)
    return Path(source.path)


def can_link(folder: Path | None, precision: str) -> bool:
    """Whether a folder's weights are all safetensors whose floating-point tensors are already in the precision's
    dtype (only their headers are read): then loading them casts nothing and a snapshot of links is exact."""
    from safetensors import safe_open

    if folder is None:
        return False
    files = [p for p in folder_files(folder).values() if p.suffix in WEIGHT_SUFFIXES]
    if not files or any(p.suffix != ".safetensors" for p in files):
        return False
    wanted = {"bf16": "BF16", "fp32": "F32", "fp16": "F16"}[precision]
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype.startswith(("F", "BF")) and dtype != wanted:
                    return False
    return True


def _plain_gguf_model(model: torch.nn.Module) -> None:
    """transformers dequantises every GGUF tensor of the supported architectures to the requested dtype at load,
    yet leaves a GGUF quantizer on the model (5.17 and 5.24), which makes ``save_pretrained`` refuse it; the
    tensors are plain, so the marker goes (the snapshot's verification proves the tensors are unchanged)."""
    quantized = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if quantized:
        raise SnapshotError(f"the GGUF model kept quantized tensors after loading ({quantized[:4]}); a snapshot "
                            "would not hold what the jobs compute with")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


def _write_converted(loaded: LoadedModel, source: ModelSource, folder: Path | None, out: Path) -> None:
    """Weights from the loaded model; config, generation config and tokenizer files copied from a folder source as
    they are, or written from a GGUF source's (the tokenizer as its pipeline, verbatim)."""
    weights = out / ".weights"
    if source.kind == "gguf":
        _plain_gguf_model(loaded.model)
    loaded.model.save_pretrained(weights)
    umask = os.umask(0)
    os.umask(umask)
    for path in weights.iterdir():
        if path.suffix == ".safetensors" or path.name in WEIGHT_INDEXES:
            path.chmod(0o666 & ~umask)  # save_pretrained writes them private (0600); a shared run reads them too
            path.rename(out / path.name)
    if folder is not None:
        for name, path in folder_files(folder).items():
            if path.suffix not in WEIGHT_SUFFIXES and name not in WEIGHT_INDEXES and name != MANIFEST:
                shutil.copyfile(path, out / name)
    else:
        for name in ("config.json", "generation_config.json"):
            if (weights / name).exists():
                (weights / name).rename(out / name)
        loaded.tokenizer.save_pretrained(out)
    shutil.rmtree(weights)


def verbatim_tokenizer(class_name: str):
    """A loader of a snapshot's tokenizer as class ``class_name`` around the pipeline in its tokenizer.json.

    The tokenizer a GGUF file gives is its converter's pipeline inside a model's tokenizer class (Qwen2Tokenizer);
    that class, loading files, builds its own pipeline from the vocabulary instead (an NFC normaliser the GGUF
    lacks, in 5.24), and AutoTokenizer picks the class from the config's model type whatever tokenizer_config.json
    names. Passing the saved pipeline as ``tokenizer_object`` is what the GGUF loader itself does.

    ``from_pretrained`` would also read tokenizer.json twice more in Python (for its added tokens, and to build the
    class's own pipeline that ``tokenizer_object`` replaces), half the load at a 151,643-merge vocabulary (2.4 s
    against 1.2 s on the GPU host's CPU); :func:`~stagereplay.models.compat.tokenizer_object_keywords` says what
    skips both, for the same tokenizer."""

    def load(folder: str):
        import transformers
        from tokenizers import Tokenizer

        pipeline = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        return getattr(transformers, class_name).from_pretrained(
            folder, tokenizer_object=pipeline, **compat.tokenizer_object_keywords(folder, pipeline))

    return load


def _write_links(folder: Path, out: Path) -> None:
    for name, path in folder_files(folder).items():
        if name == MANIFEST or (path.suffix in WEIGHT_SUFFIXES and path.suffix != ".safetensors"):
            continue  # pickles and GGUF files next to the safetensors are never loaded
        os.symlink(path.resolve(), out / name)


def write_snapshots(source: ModelSource, folders: dict[str, Path], *, source_fingerprint: dict | None = None,
                    trust_remote_code: bool = False, allow_pickle: bool = False, offline: bool = True,
                    mode: str = "auto", cache: HashCache | None = None) -> dict[str, dict[str, str]]:
    """Write the snapshot of ``source`` at each precision into its (new, empty) folder of ``folders``, manifest
    last; return {precision: {file name: sha256}} of what was written. ``mode``: ``auto`` links a folder already in
    the precision's dtype and converts anything else; ``convert`` always writes and proves new weights."""
    unknown = sorted(set(folders) - set(PRECISIONS))
    if unknown:
        raise ModelLoadError(f"precisions {unknown} are not among {sorted(PRECISIONS)}")
    folder = local_folder(source, offline, allow_pickle)
    written = {}
    # A GGUF file is converted directly, every precision from one read of it (stagereplay.models.gguf_convert)
    started = time.perf_counter()
    streamed = _convert_gguf(source, folders, trust_remote_code) if source.kind == "gguf" else {}
    streamed_s = time.perf_counter() - started
    for precision, out in folders.items():
        started = time.perf_counter()
        out = Path(out)
        linked = mode == "auto" and can_link(folder, precision)
        record, known = {}, HashCache(None)
        if linked:
            _write_links(folder, out)
            if source.kind == "hub":
                record["model_commit"] = folder.name  # the hub snapshot folder is named by its commit
            known = cache or known  # the source's files, whose digests the cache holds from planning
        elif precision in streamed:
            record = streamed[precision]
            for name, digest in record.pop("files").items():  # taken while writing: not read again
                known.remember(out / name, digest)
        else:
            record = _convert(source, precision, folder, out, trust_remote_code, allow_pickle, offline)
        snapshot = files_fingerprint(folder_files(out), known)
        manifest = {
            "format": MANIFEST_FORMAT,
            "source": source.describe(),
            "source_kind": source.kind,
            "source_fingerprint": source_fingerprint,
            "precision": precision,
            "dtype": str(PRECISIONS[precision]).replace("torch.", ""),
            "mode": "linked" if linked else "converted",
            "snapshot": snapshot,
            **record,
            "software": software_versions(),
            "seconds": round(time.perf_counter() - started + streamed_s / max(len(streamed), 1) * (precision in streamed),
                             3),
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        written[precision] = dict(snapshot["files"])
    return written


def prepare_snapshot(source: ModelSource, precision: str, out_dir: str | Path, *,
                     source_fingerprint: dict | None = None, trust_remote_code: bool = False,
                     allow_pickle: bool = False, offline: bool = True, mode: str = "auto",
                     cache: HashCache | None = None) -> dict:
    """Write the snapshot of ``source`` at ``precision`` to ``out_dir`` (made whole or not at all) outside the
    model store (benchmarks, tests); return its manifest. Runs prepare theirs in the store
    (:func:`stagereplay.models.store.ensure` around :func:`write_snapshots`)."""
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_snapshots(source, {precision: tmp}, source_fingerprint=source_fingerprint,
                        trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, offline=offline, mode=mode,
                        cache=cache)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return read_manifest(out)


def _convert_gguf(source: ModelSource, folders: dict[str, Path], trust_remote_code: bool) -> dict[str, dict]:
    """Every precision of a GGUF source from one read of the file (:func:`stagereplay.models.gguf_convert.
    convert_gguf`), each loaded back through ``load_model`` and refused unless every tensor it loads is the one the
    converter wrote (bytes, dtype, shape) and the model is whole (the load refuses missing or left-over tensors).
    That the converter writes what loading the GGUF through transformers gives, byte for byte, is proven by
    tests/test_gguf_convert.py; loading the GGUF here again would cost most of the preparation."""
    from stagereplay.models.gguf_convert import convert_gguf

    converted = convert_gguf(Path(source.path) / source.gguf_file, folders)
    records = {}
    for precision, folder in folders.items():
        made = converted[precision]
        tokenizer = {"tokenizer_class": made["tokenizer_class"]}
        again = load_model(ModelSource("local", str(folder)), precision, "cpu", "eager", trust_remote_code, False,
                           True, load_tokenizer=_tokenizer_loader(tokenizer))
        digests = tensor_digests(again.model)
        differing = sorted(name for name, digest in made["tensors"].items() if digests.get(name) != digest)
        if differing:
            raise SnapshotError(f"the snapshot of {source.describe()} at {precision} does not load as it was "
                                f"written: {len(differing)} tensors differ ({differing[:6]})")
        records[precision] = {"weights_sha256": weights_sha256(digests), "tensors": len(digests), **tokenizer,
                              "converter": "gguf_convert", "files": made["files"]}
        del again
        gc.collect()
    return records


def _convert(source: ModelSource, precision: str, folder: Path | None, out: Path, trust_remote_code: bool,
             allow_pickle: bool, offline: bool) -> dict:
    """Load the source, write its snapshot, load that back and refuse it unless it gives the same model."""
    loaded = load_model(source, precision, "cpu", "eager", trust_remote_code, allow_pickle, offline)
    expected = model_signature(loaded)
    commit = loaded.info.get("model_commit")
    tokenizer = {"tokenizer_class": type(loaded.tokenizer).__name__} if folder is None else {}
    _write_converted(loaded, source, folder, out)
    del loaded
    gc.collect()
    again = load_model(ModelSource("local", str(out)), precision, "cpu", "eager", trust_remote_code, False, True,
                       load_tokenizer=_tokenizer_loader(tokenizer))
    problems = compare_signatures(expected, model_signature(again))
    if problems:
        raise SnapshotError(f"the snapshot of {source.describe()} at {precision} does not load as the source "
                            "does: " + "; ".join(problems))
    record = {"weights_sha256": weights_sha256(expected["tensors"]), "tensors": len(expected["tensors"])}
    return {**record, **tokenizer, **({"model_commit": commit} if commit else {})}


def _tokenizer_loader(manifest: dict):
    """How a snapshot's tokenizer loads: as its files say (AutoTokenizer), or verbatim (a GGUF source's)."""
    return verbatim_tokenizer(manifest["tokenizer_class"]) if manifest.get("tokenizer_class") else None


# ---- Loading ----------------------------------------------------------------------------------------------------------
def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{folder} is not a prepared model snapshot ({MANIFEST}: {exc}); rerun the workflow, "
                            "which prepares it (rule prepare_model)") from exc


def check_snapshot(folder: str | Path, manifest: dict, source: ModelSource, precision: str,
                   source_fingerprint: dict | None, cache: HashCache | None = None) -> None:
    """Refuse a snapshot made from other files (by content: the source's path may differ) or at another precision
    than the job's, or whose files are not the ones it was written with: a ``stat`` per file with the record a store
    entry keeps (:data:`stagereplay.models.store.HASHES`), else with ``cache``; a file whose size or modification
    time changed since is read and hashed again."""
    folder = Path(folder)
    if (folder / HASHES).is_file():  # a store entry's own record: a stat per file, not a read of its weights
        cache = HashCache(folder / HASHES)
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("precision") != precision:
        raise SnapshotError(f"{folder} holds a snapshot at {manifest.get('precision')!r} (format "
                            f"{manifest.get('format')}), not at {precision!r}; rerun the workflow")
    planned = (source_fingerprint or {}).get("sha256")
    made_from = (manifest.get("source_fingerprint") or {}).get("sha256")
    if planned and made_from != planned:
        raise SnapshotError(f"{folder} was prepared from {manifest.get('source')} (sha256 {str(made_from)[:16]}), "
                            f"not from {source.describe()} (sha256 {str(planned)[:16]}) as this job was planned; "
                            "rerun the workflow so that it prepares the model again")
    expected = manifest["snapshot"]["files"]
    present = folder_files(folder)
    present.pop(MANIFEST, None)
    now = files_fingerprint(present, cache)["files"] if set(present) == set(expected) else {}
    changed = sorted(name for name in set(present) | set(expected) if now.get(name) != expected.get(name))
    if changed:
        raise SnapshotError(f"{folder}: {', '.join(changed)} not the files it was prepared with (changed, missing or "
                            f"added); remove it (stagereplay-store remove {folder.name}) and rerun the workflow, which "
                            "prepares it again")


def checked_stand_in(folders, source: ModelSource, source_fingerprint: dict | None,
                     cache: HashCache | None = None):
    """(folder, model config, tokenizer) of a prepared snapshot of ``source`` among ``folders``, for the
    preflight to check instead of the source's; None where none is a current one (made from other files, in
    another format, changed since, or not there yet).

    A GGUF source's config and tokenizer are built from its metadata (for a Qwen2 vocabulary about 300,000
    strings read through gguf-py and transformers), which takes 6 to 11 s on the 2-core VM even read once
    (:func:`~stagereplay.models.gguf_files.gguf_read_once`); a snapshot made from the very same file holds them as the
    ordinary files loading it reads (preparing proved they equal the source's), and reading those takes 4 s. Only a
    snapshot whose manifest names this source and its current fingerprint stands in: any other is passed over, and
    the source is checked."""
    if not (source_fingerprint or {}).get("sha256"):
        return None
    for folder in map(Path, folders):
        try:
            manifest = read_manifest(folder)
            check_snapshot(folder, manifest, source, manifest.get("precision"), source_fingerprint, cache)
        except SnapshotError:
            continue
        local = ModelSource("local", str(folder))
        _, _, config, common = checked_config(local)
        tokenizer = checked_tokenizer(local, source, common, getattr(config, "vocab_size", None),
                                      load_tokenizer=_tokenizer_loader(manifest))
        return folder, config, tokenizer
    return None


def load_prepared(folder: str | Path, source: ModelSource, precision: str, device: str = "auto",
                  attn_implementation: str = "eager", numerics: str = "default",
                  source_fingerprint: dict | None = None, trust_remote_code: bool = False,
                  cache: HashCache | None = None) -> LoadedModel:
    """``load_model`` of the prepared snapshot in ``folder``, checked to be ``source``'s at ``precision``, outside
    the model store (benchmarks, tests); a job opens its store entry with
    :func:`stagereplay.models.opening.open_model`."""
    manifest = read_manifest(folder)
    check_snapshot(folder, manifest, source, precision, source_fingerprint, cache)
    return load_snapshot(folder, manifest, source, precision, device, attn_implementation, numerics,
                         trust_remote_code)


def load_snapshot(folder: str | Path, manifest: dict, source: ModelSource, precision: str, device: str = "auto",
                  attn_implementation: str = "eager", numerics: str = "default",
                  trust_remote_code: bool = False) -> LoadedModel:
    """``load_model`` of a snapshot already checked (its ``manifest`` read); the result names the source (as loading
    it directly would) and records the snapshot."""
    loaded = load_model(ModelSource("local", str(folder)), precision, device, attn_implementation,
                        trust_remote_code, allow_pickle=False, offline=True, numerics=numerics,
                        load_tokenizer=_tokenizer_loader(manifest))
    loaded.source = source
    loaded.info["model_source"] = source.describe()
    if manifest.get("model_commit"):
        loaded.info["model_commit"] = manifest["model_commit"]
    loaded.info["model_snapshot"] = {"path": str(folder), "sha256": manifest["snapshot"]["sha256"],
                                     "mode": manifest["mode"], "weights_sha256": manifest.get("weights_sha256")}
    return loaded
