"""The key columns of the pipeline's Parquet tables: their names, their Arrow types and their order, declared once.

Every table names an item's rows by ``item_index`` (with the item's ``item_id`` beside it), the model ``revision``
and the ``precision``; a ledger row (and its audit record) also by ``experiment``, ``construction`` and
``replica``. The schemas start with these fields, and the sorts, joins and uniqueness checks of the rows use the keys
below. A results file holds one revision (results/<run>/<revision>/...): within it a row's key is the key less
``revision`` (:func:`within_revision`). Imports pyarrow only.
"""

from __future__ import annotations

import pyarrow as pa

# Every key column, in the order the tables hold those they have.
KEY_FIELDS = pa.schema([
    ("item_index", pa.int32()),
    ("item_id", pa.string()),  # the item's id in its dataset: beside item_index, which is what keys a row
    ("revision", pa.string()),
    ("experiment", pa.string()),
    ("precision", pa.string()),
    ("construction", pa.string()),
    ("replica", pa.int8()),
])
LEDGER_FIELDS = list(KEY_FIELDS)  # the first columns of the ledger and of the audit
ITEM_FIELDS = [KEY_FIELDS.field(name) for name in ("item_index", "item_id", "revision", "precision")]  # the others'

LEDGER_KEY = tuple(name for name in KEY_FIELDS.names if name != "item_id")  # what names a ledger (or audit) row
ITEM_KEY = tuple(field.name for field in ITEM_FIELDS if field.name != "item_id")  # every other table's key starts so


def within_revision(key: tuple[str, ...]) -> list[str]:
    """``key`` less ``revision``: the key of a row within one revision's file, and the order that file is sorted in."""
    return [name for name in key if name != "revision"]
