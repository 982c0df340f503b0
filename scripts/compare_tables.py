"""Compare the tables of two runs' results folders row for row, ignoring provenance.

    python scripts/compare_tables.py OLD_RESULTS_DIR NEW_RESULTS_DIR [--ignore-columns a,b]

For every Parquet file present in both (selection, prefixes, ledger, bridge, audit, transplant,
cache_differences, ...), reads the table content (not the key-value metadata), drops the ignored columns and
columns that only one side has (reported), and says whether the rows are equal value for value. Exits 1 if any
shared table differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq


def table(path: Path, ignore: set[str]):
    t = pq.read_table(path)
    return t.drop_columns([c for c in t.column_names if c in ignore])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--ignore-columns", default="layout_pad,layout_position")
    args = parser.parse_args()
    ignore = {c for c in args.ignore_columns.split(",") if c}
    differs = 0
    for old in sorted(args.old.rglob("*.parquet")):
        rel = old.relative_to(args.old)
        if "parts" in rel.parts:
            continue
        new = args.new / rel
        if not new.exists():
            print(f"{rel}: only in {args.old}")
            continue
        a, b = table(old, ignore), table(new, ignore)
        only = sorted(set(a.column_names) ^ set(b.column_names))
        shared = [c for c in a.column_names if c in b.column_names]
        same = a.num_rows == b.num_rows and all(a.column(c).to_pylist() == b.column(c).to_pylist() for c in shared)
        if not same:
            differs += 1
            cols = [c for c in shared if a.num_rows == b.num_rows and a.column(c).to_pylist() != b.column(c).to_pylist()]
            print(f"{rel}: DIFFERS ({a.num_rows} vs {b.num_rows} rows; columns {cols})")
        else:
            print(f"{rel}: same {a.num_rows} rows" + (f" (columns on one side only: {only})" if only else ""))
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
