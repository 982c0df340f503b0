"""Stage ``select_items``: the seeded, deterministic selection of N items from the dataset source."""

from __future__ import annotations

import pandas as pd

from stagereplay.data import datasets
from stagereplay.io.parquet import write_parquet
from stagereplay.io.provenance import software_versions


def select_items(dataset: dict, n_items: int, seed: int, out_path: str, base_dir: str = ".",
                 answer_format: str = "last_number", offline: bool = True) -> pd.DataFrame:
    rows = datasets.load_source(dataset, base_dir, numeric=answer_format != "boxed", offline=offline)
    selected = datasets.choose_items(rows, n_items, seed)
    write_parquet(selected, out_path, {**software_versions(), "stage": "select_items", "seed": seed,
                                       "config": {"dataset": dataset, "n_items": n_items}})
    return selected
