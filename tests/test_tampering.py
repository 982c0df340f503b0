"""Tampering and corruption: a truncated, bit-flipped or edited Parquet file is refused, naming the file; it is
never read back with different content."""

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stagereplay.analysis.report import build_report
from stagereplay.experiments.rows import LEDGER_SCHEMA
from stagereplay.io.parquet import CorruptFileError, read_parquet, write_parquet
from stagereplay.stages.gather import gather_ledger


def ledger_rows(n=6):
    rows = []
    for i in range(n):
        rows.extend({
            "item_index": i, "item_id": f"toy-{i:03d}", "revision": "primary", "experiment": "matched",
            "precision": "bf16", "construction": construction, "replica": replica, "status": "ok",
            "prompt_ids": [19, 18, i], "stage_ids": [7, 11, 3], "prefix_fingerprint": "ab" * 32,
            "cache_fingerprint": "cd" * 32, "cache_k_fingerprints": ["01" * 32] * 2,
            "cache_v_fingerprints": ["02" * 32] * 2, "suffix_ids": [5, 6, i % 3, 1],
            "suffix_fingerprint": "ef" * 32, "margins": [0.5, 1.25, 0.0078125, 3.0], "stop_reason": "eos",
            "suffix_text": f"A:{i}", "answer": str(i), "gold_answer": str(i), "correct": True,
        } for construction in ("live", "prefill") for replica in (1, 2))
    return pd.DataFrame(rows, columns=LEDGER_SCHEMA.names)


@pytest.fixture
def ledger_file(tmp_path):
    path = tmp_path / "primary" / "ledger.parquet"
    write_parquet(ledger_rows(), path, {"stage": "test"}, LEDGER_SCHEMA)
    return path


def test_truncated_file_is_refused_naming_it(ledger_file):
    data = ledger_file.read_bytes()
    for keep in (len(data) - 1, len(data) // 2, 8, 0):
        ledger_file.write_bytes(data[:keep])
        with pytest.raises(CorruptFileError, match=f"{ledger_file}.*rerun the rule that makes it"):
            read_parquet(ledger_file)


def test_no_flipped_bit_goes_unnoticed(ledger_file, tmp_path):
    """Every sampled single-bit flip is refused, or reads back exactly the content that was written."""
    data = ledger_file.read_bytes()
    expected = read_parquet(ledger_file).to_json()
    flipped = tmp_path / "flipped.parquet"
    refused = 0
    for i in range(0, len(data), 13):
        damaged = bytearray(data)
        damaged[i] ^= 1 << (i % 8)
        flipped.write_bytes(bytes(damaged))
        try:
            got = read_parquet(flipped)
        except CorruptFileError as err:
            assert str(flipped) in str(err)
            refused += 1
            continue
        assert got.to_json() == expected, f"a flip at byte {i} changed the content silently"
    assert refused > len(data) // 26  # most flips land in pages, headers or the footer and are refused


def test_an_edited_value_with_the_metadata_kept_is_refused(ledger_file):
    table = pq.read_table(ledger_file)
    df = table.to_pandas()
    df.loc[3, "correct"] = False  # a label quietly changed, provenance and fingerprint copied over
    edited = pa.Table.from_pandas(df, schema=table.schema, preserve_index=False)
    pq.write_table(edited.replace_schema_metadata(table.schema.metadata), ledger_file)
    with pytest.raises(CorruptFileError, match="does not match the fingerprint recorded when it was written"):
        read_parquet(ledger_file)


def test_edited_provenance_is_refused(ledger_file):
    table = pq.read_table(ledger_file)
    meta = dict(table.schema.metadata)
    prov = json.loads(meta[b"stagereplay"])
    prov["stage"] = "something else"
    meta[b"stagereplay"] = json.dumps(prov).encode()
    pq.write_table(table.replace_schema_metadata(meta), ledger_file)
    with pytest.raises(CorruptFileError, match=str(ledger_file)):
        read_parquet(ledger_file)


def test_stages_refuse_a_damaged_input_naming_it(ledger_file, tmp_path):
    data = bytearray(ledger_file.read_bytes())
    data[len(data) // 3] ^= 0xFF
    ledger_file.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=str(ledger_file)):
        gather_ledger([str(ledger_file)], str(tmp_path / "gathered.parquet"))
    with pytest.raises(CorruptFileError, match=str(ledger_file)):
        build_report({"primary": str(ledger_file)}, str(tmp_path / "r.md"), str(tmp_path / "s.json"), "t")
    assert not (tmp_path / "gathered.parquet").exists() and not (tmp_path / "r.md").exists()
