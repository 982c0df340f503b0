"""Stage ``select_items``: the seeded, deterministic selection of N items from the dataset source."""

from __future__ import annotations

import pandas as pd

from stagereplay.data import datasets
from stagereplay.io.parquet import write_parquet
from stagereplay.io.provenance import software_versions
from stagereplay.stages.input_fingerprints import rows_fingerprint


def select_items(dataset: dict, n_items: int, seed: int, out_path: str, base_dir: str = ".",
                 answer_format: str = "last_number", offline: bool = True,
                 dataset_file: dict | None = None) -> pd.DataFrame:
    """Select and write the items. ``dataset_file`` is the dataset file's fingerprint as the workflow took it when
    it planned the run (:func:`stagereplay.stages.input_fingerprints.dataset_file_fingerprint`); the provenance
    records it beside the fingerprint of the rows as read (``dataset_fingerprint``)."""
    rows = datasets.load_source(dataset, base_dir, numeric=answer_format != "boxed", offline=offline)
    selected = datasets.choose_items(rows, n_items, seed)
    file_record = {"dataset_sha256": dataset_file["sha256"]} if dataset_file else {}
    write_parquet(selected, out_path, {**software_versions(), "stage": "select_items", "seed": seed,
                                       "config": {"dataset": dataset, "n_items": n_items},
                                       "dataset_fingerprint": rows_fingerprint(rows), "dataset_rows": len(rows),
                                       **file_record})
    return selected
