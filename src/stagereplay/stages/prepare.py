"""The prepare_model stage: a revision's model source (GGUF file, hub snapshot, local folder) as a local safetensors
snapshot at one precision, made once per run and loaded by every later model-loading job
(:mod:`stagereplay.models.snapshot` says what it holds and how it is proven equal to the source)."""

from __future__ import annotations

import logging

from stagereplay.io.file_hashes import HashCache
from stagereplay.models.loading import set_determinism
from stagereplay.models.sources import resolve_source
from stagereplay.models.snapshot import prepare_snapshot
from stagereplay.stages.input_fingerprints import check_model_unchanged
from stagereplay.stages.settings import PrepareSettings

log = logging.getLogger(__name__)


def prepare_model(out_dir: str, s: PrepareSettings) -> dict:
    """Write ``out_dir``, the snapshot of the revision's model source at ``s.precision``; return its manifest."""
    hashes = HashCache()
    check_model_unchanged(s.model_fingerprint, s.model, s.revision, s.base_dir, hashes)
    set_determinism(s.threads)
    source = resolve_source(s.model, s.revision, s.base_dir)
    manifest = prepare_snapshot(source, s.precision, out_dir, source_fingerprint=s.model_fingerprint,
                                trust_remote_code=s.trust_remote_code, allow_pickle=s.allow_pickle,
                                offline=s.offline, cache=hashes)
    log.info("prepared %s at %s in %.1f s: %s, %d files, snapshot sha256 %s", source.describe(), s.precision,
             manifest["seconds"], manifest["mode"], len(manifest["snapshot"]["files"]),
             manifest["snapshot"]["sha256"][:16])
    return manifest
