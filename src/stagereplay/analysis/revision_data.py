"""One revision's results files as the report reads them (:class:`RevisionData`), and where each kind of file
comes from (:data:`PRODUCERS`), for the note of a section whose input is not there yet."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from stagereplay import catalogue
from stagereplay.analysis import tables as analysis
from stagereplay.io.parquet import read_parquet, read_provenance


# Where each kind of input comes from, for the note of a section whose input is not there yet.
PRODUCERS = {
    "ledger": "ledger.parquet (rule gather_ledger)",
    "bridge": "bridge.parquet (the bridge rule)",
    "audit": "audit.parquet (rule audit_ledger)",
    "transplant": "transplant.parquet (the transplant stage)",
    "cache_differences": "cache_differences.parquet (rule measure_cache_differences)",
    "batch_invariance": "batch_invariance.parquet (rule check_batch_invariance)",
    "minimal_transplant": "minimal_transplant.parquet (rule find_minimal_transplants)",
    "divergence_onset": "divergence_onset.parquet (rule measure_divergence_onset)",
    "fidelity": "fidelity.parquet (rule measure_fidelity)",
    **{output: f"{output}.parquet (rule {'audit_engine' if output.endswith('_audit') else 'replay_on_engine'}, "
                f"engine {engine.name})" for engine in catalogue.ENGINES for output in engine.outputs},
}


@dataclass
class RevisionData:
    """One revision's results files, read on first use; a kind whose file is absent reads as None."""

    revision: str
    paths: dict[str, str]
    seed: int = 0
    _frames: dict = field(default_factory=dict, repr=False)

    def has(self, kind: str) -> bool:
        if self._frames.get(kind) is not None:
            return True
        path = self.paths.get(kind)
        return bool(path) and Path(path).is_file()

    def declared(self, kind: str) -> bool:
        """Whether this revision is meant to have ``kind`` (its path was declared or its file found)."""
        return self.paths.get(kind) is not None or self._frames.get(kind) is not None

    def frame(self, kind: str) -> pd.DataFrame | None:
        if kind not in self._frames:
            self._frames[kind] = read_parquet(self.paths[kind]) if self.has(kind) else None
        return self._frames[kind]

    def provenance(self, kind: str) -> dict:
        path = self.paths.get(kind)
        return read_provenance(path) if path and Path(path).is_file() else {}

    def job_record(self, kind: str) -> dict:
        """The provenance of the job that computed ``kind``: the file's own, or a gathered file's first part's (its
        parts record the same settings but for their shard)."""
        prov = self.provenance(kind)
        return (prov.get("parts") or [prov])[0]

    @property
    def max_new_tokens(self) -> int | None:
        """The suffix budget the ledger's generation jobs record (None where they record none)."""
        return (self.job_record("ledger").get("config") or {}).get("max_new_tokens")

    @property
    def ledger(self) -> pd.DataFrame:
        return self.frame("ledger")

    @property
    def pairs(self) -> pd.DataFrame:
        if "pairs" not in self._frames:
            self._frames["pairs"] = analysis.all_pairs(self.ledger)
        return self._frames["pairs"]

    @property
    def coinciding(self) -> dict:
        """(revision, precision) cells where the fixed-prefix rows repeat the matched rows (shown once)."""
        if "coinciding" not in self._frames:
            self._frames["coinciding"] = analysis.coinciding_comparisons(self.ledger)
        return self._frames["coinciding"]
