"""No failure costs a result already computed: a damaged results file or a transplant selection that cannot be met
stops the run before Snakemake deletes anything, naming the file or key and the fix; and a job's progress reaches
the console at least once per interval while its per-batch bar stays in the job's log."""

import hashlib
import io
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from stagereplay.decode.greedy import TOKENS
from stagereplay.io import cache_dumps
from stagereplay.io.parquet import HashRecord, hash_record_path, read_hash_record, write_parquet, write_text_atomic
from stagereplay.stages.integrity import DamagedResultsError, verify_results
from stagereplay.stages.preflight import check_transplant_select
from stagereplay.stages.progress import Reporter, progress
from workflow_runner import snakemake, tiny_config


def results_hashes(root) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file under ``root`` (hash records included)."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def truncate(path: Path) -> bytes:
    """Cut ``path`` to half its bytes (a full disk, an interrupted copy); return the bytes it had."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return data


def restore(path: Path, data: bytes, mtime_ns: int) -> None:
    """Put ``data`` back as a copy that keeps times would (``cp -p``)."""
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


# --- the hash records ---------------------------------------------------------------------------------------

def test_every_atomic_write_records_the_sha256_of_its_bytes(tmp_path):
    parquet, text, dump = tmp_path / "a.parquet", tmp_path / "b.json", tmp_path / "caches" / "c.safetensors"
    write_parquet(pd.DataFrame({"x": [1, 2]}), parquet, {"stage": "test"})
    write_text_atomic(text, "{}\n")
    cache_dumps.save_cache(dump, [(torch.zeros(1, 1, 2, 2), torch.ones(1, 1, 2, 2))], {"item_id": "x"})
    for path in (parquet, text, dump):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert read_hash_record(path) == HashRecord(digest, path.stat().st_size, path.stat().st_ino)
        check = subprocess.run(["sha256sum", "-c", hash_record_path(path).name], cwd=path.parent,
                               capture_output=True, text=True)
        assert (check.returncode, check.stdout, check.stderr) == (0, f"{path.name}: OK\n", "")
    write_parquet(pd.DataFrame({"x": [3]}), parquet, {"stage": "test"})  # rewritten: the record follows
    assert read_hash_record(parquet).sha256 == hashlib.sha256(parquet.read_bytes()).hexdigest()


def written_run(root: Path) -> dict[str, Path]:
    files = {
        "selection": root / "selection" / "items.parquet",
        "ledger": root / "primary" / "ledger.parquet",
        "dump": root / "primary" / "caches" / "item000001_bf16_live.safetensors",
        "report": root / "report" / "report.md",
    }
    write_parquet(pd.DataFrame({"item_id": ["a", "b"]}), files["selection"], {"stage": "test"})
    write_parquet(pd.DataFrame({"item_id": ["a", "b"], "x": [1, 2]}), files["ledger"], {"stage": "test"})
    cache_dumps.save_cache(files["dump"], [(torch.zeros(1, 1, 4, 2), torch.ones(1, 1, 4, 2))], {"item_id": "a"})
    write_text_atomic(files["report"], "# report\n")
    return files


def test_an_intact_run_passes_and_each_damaged_file_is_named_with_its_fix(tmp_path):
    root = tmp_path / "results" / "tiny"
    files = written_run(root)
    checked = verify_results(root)
    assert checked.files == 4 and not checked.hashed and not checked.unrecorded
    truncate(files["selection"])
    truncate(files["dump"])
    files["report"].write_text("# edited by hand\n")  # in place, another length
    unrecorded = root / "primary" / "parts" / "audit_bf16_0.parquet"  # no record: it must at least open
    write_parquet(pd.DataFrame({"x": [1]}), unrecorded, {"stage": "test"})
    hash_record_path(unrecorded).unlink()
    truncate(unrecorded)
    with pytest.raises(DamagedResultsError) as err:
        verify_results(root)
    lines = str(err.value).splitlines()
    assert lines[-1] == "Nothing was run and nothing deleted."
    by_file = {line.split(" is damaged: ")[0]: line for line in lines[:-1]}
    assert set(by_file) == {str(files["selection"]), str(files["dump"]), str(files["report"]), str(unrecorded)}
    assert "not the" in by_file[str(files["selection"])] and "recorded when it was written" in by_file[
        str(files["selection"])]
    assert by_file[str(files["selection"])].endswith(
        "delete it to recompute it (and what depends on it) with the next run, or restore it from a copy")
    assert f"delete the folder {files['dump'].parent} to recompute it" in by_file[str(files["dump"])]
    assert "has no recorded sha256 and does not open" in by_file[str(unrecorded)]


def test_a_damaged_record_of_prepared_models_gets_advice_that_works(tmp_path):
    """A prepared snapshot lives in the model store, not in results: the run keeps only its record of the entries
    (models/<revision>.json), which every model-loading job takes as input. A missing or damaged store entry is
    named before any job by store_entries and prepared again before the first job (tests/test_model_store.py)."""
    root = tmp_path / "results" / "tiny"
    record = root / "models" / "primary.json"
    write_text_atomic(record, '{"format": 1}\n')
    record.write_text("{")
    with pytest.raises(DamagedResultsError) as err:
        verify_results(root)
    assert (f"{record} is damaged: its sha256 is" in str(err.value) and "restore it from a copy (cp -p), or delete "
            "it: the next run writes it again from the model store (nothing is converted while the store's entries "
            "are whole) and reruns every job that loads the model" in str(err.value))


def test_touched_files_are_trusted_and_a_copy_is_hashed_once_and_a_dry_run_writes_nothing(tmp_path):
    """Snakemake touches every output after its job: the mtime is not the key, the size and inode are."""
    root = tmp_path / "results" / "tiny"
    files = written_run(root)
    later = time.time_ns() + 10**9
    os.utime(files["ledger"], ns=(later, later))
    assert verify_results(root).hashed == []
    copy = tmp_path / "copy"
    shutil.copy2(files["ledger"], copy)
    os.replace(copy, files["ledger"])  # the same bytes in another inode, as a restored copy is
    record = hash_record_path(files["ledger"])
    record_before = (record.read_bytes(), record.stat().st_mtime_ns)
    assert verify_results(root, refresh=False).hashed == [str(files["ledger"])]
    assert (record.read_bytes(), record.stat().st_mtime_ns) == record_before  # a dry run writes nothing
    assert verify_results(root).hashed == [str(files["ledger"])]
    assert verify_results(root).hashed == []  # the record follows the copy: a stat is enough again


def test_transplant_ids_that_are_not_selected_items_are_refused():
    ids = ["toy-001", "toy-007", "toy-012"]
    check_transplant_select(["toy-007"], ids)
    check_transplant_select("divergent", ids)
    check_transplant_select("sample:3", ids)
    with pytest.raises(ValueError, match=r"transplant.select: item ids \['nope'\] are not among the 3 selected"):
        check_transplant_select(["toy-001", "nope"], ids)
    with pytest.raises(ValueError, match="sample:4 asks for more items than the 3 selected"):
        check_transplant_select("sample:4", ids)


def test_a_full_disk_while_writing_is_named_with_the_file_the_free_space_and_what_it_needed(tmp_path, monkeypatch):
    """The disk filling during a job gave `returned non-zero exit status 120` and an empty log: the job's log is on
    the full disk, so the message goes to the job's own stderr (Snakemake's console) as well as to the exception."""
    import errno

    import stagereplay.io.parquet as parquet

    path = tmp_path / "results" / "tiny" / "primary" / "ledger.parquet"
    write_parquet(pd.DataFrame({"x": [1]}), path, {"stage": "test"})
    before = path.read_bytes()

    def fills_the_disk(table, where, **kwargs):
        Path(where).write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    console, log = io.StringIO(), io.StringIO()
    monkeypatch.setattr(parquet.pq, "write_table", fills_the_disk)
    monkeypatch.setattr(parquet.sys, "__stderr__", console)
    monkeypatch.setattr(parquet.sys, "stderr", log)  # a job's stderr is its log
    with pytest.raises(parquet.NoSpaceError) as err:
        write_parquet(pd.DataFrame({"x": list(range(1000))}), path, {"stage": "test"})
    message = (rf"no space left on device writing {re.escape(str(path))}: the disk holding "
               rf"{re.escape(str(path.parent))} has [0-9.]+ [kMGT]?B(ytes)? free of [0-9.]+ [kMGT]?B; the file needed "
               r"about 8.0 kB \(its table before compression\), and 1.0 kB of it were written before the disk filled. "
               r"Free space there \(or point the run at a disk with room\) and rerun: ledger.parquet was not replaced, "
               "the results already there are as they were")
    assert re.search(message, str(err.value)) and re.search(message, console.getvalue()), console.getvalue()
    assert path.read_bytes() == before  # the old file as it was, its record beside it, no temp file left
    assert sorted(p.name for p in path.parent.iterdir()) == [".ledger.parquet.sha256", "ledger.parquet"]


# --- progress on the console ----------------------------------------------------------------------------------

def test_progress_line_reports_items_tokens_per_second_and_eta():
    now = [100.0]
    reporter = Reporter("reconstruct_prefixes primary/bf16 shard 0", 4, stream=io.StringIO(), clock=lambda: now[0])
    assert reporter.line().endswith("0/4 items, started")
    TOKENS.total += 300
    reporter.done, now[0] = 1, 130.0
    assert reporter.line() == ("[stagereplay] reconstruct_prefixes primary/bf16 shard 0: 1/4 items (25%), "
                               "10.0 tokens/s, ETA 1m30s")
    reporter.done = 4
    assert reporter.line().endswith("4/4 items (100%), 10.0 tokens/s, done in 0m30s")


def test_progress_reaches_the_console_while_a_long_batch_runs(monkeypatch):
    """A batch that outlasts the interval still gets lines (they come from a thread, not from the loop)."""
    console = io.StringIO()
    monkeypatch.setattr("sys.__stderr__", console)
    monkeypatch.setenv("STAGEREPLAY_PROGRESS_SECONDS", "0.01")
    lines_seen = threading.Event()

    def lines():
        return [line for line in console.getvalue().splitlines() if line.startswith("[stagereplay] job:")]

    for batch in progress([[1, 2], [3]], "job", items=len):
        if batch == [1, 2]:
            for _ in range(2000):  # the batch runs until the thread has written two lines beyond the first
                if len(lines()) >= 3:
                    lines_seen.set()
                    break
                time.sleep(0.005)
    assert lines_seen.is_set()
    assert lines()[0] == "[stagereplay] job: 0/3 items, started"
    assert lines()[-1].startswith("[stagereplay] job: 3/3 items (100%)") and "done in" in lines()[-1]


def test_a_bad_progress_interval_is_named(monkeypatch):
    monkeypatch.setenv("STAGEREPLAY_PROGRESS_SECONDS", "0")
    with pytest.raises(ValueError, match="STAGEREPLAY_PROGRESS_SECONDS='0'"):
        list(progress([[1]], "job", items=len))


# --- the workflow: failing runs after a good one ---------------------------------------------------------------

TARGETS = ["results/tiny/primary/caches.parquet", "results/tiny/primary/transplant_selection.parquet",
           "results/tiny/primary/audit.parquet"]
SETTINGS = dict(n_items=4, max_new_tokens=8, precisions=["bf16"], shards=2,
                transplant={"select": "sample:2", "sweeps": ["all"]}, dump={"items": "all"})


@pytest.mark.slow
def test_failing_runs_leave_every_results_file_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEREPLAY_PROGRESS_SECONDS", "60")
    tiny_config(tmp_path, **SETTINGS)
    good = snakemake(tmp_path, "--cores", "2", *TARGETS)
    # progress on the console (Snakemake shows the jobs' stderr), the bars still in the logs
    assert "[stagereplay] reconstruct_prefixes primary/bf16 shard 1: 2/2 items (100%)" in good.stderr
    assert "[stagereplay] audit_ledger primary/bf16 shard 0: 0/2 items, started" in good.stderr
    log = (tmp_path / "logs/tiny/primary/reconstruct_prefixes_bf16_1.log")
    assert log.exists() and "reconstruct_prefixes primary/bf16 shard 1: 100%" in log.read_text()
    res = tmp_path / "results"
    selection, ledger = res / "tiny/selection/items.parquet", res / "tiny/primary/ledger.parquet"
    assert {"tiny/primary/transplant_selection.parquet", "tiny/primary/caches.parquet",
            "tiny/primary/parts/audit_bf16_0.parquet", "tiny/primary/parts/matched_bf16_1.parquet"} <= set(
        results_hashes(res))

    for damaged in (selection, ledger):
        mtime = damaged.stat().st_mtime_ns
        data = truncate(damaged)
        before = results_hashes(res)
        proc = snakemake(tmp_path, "--cores", "2", *TARGETS, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0
        assert f"results/tiny/{damaged.relative_to(res / 'tiny')} is damaged: its sha256 is" in out, out[-3000:]
        assert "delete it to recompute it (and what depends on it) with the next run, or restore it" in out
        assert results_hashes(res) == before, damaged
        restore(damaged, data, mtime)

    tiny_config(tmp_path, **{**SETTINGS, "transplant": {"select": ["toy-nope"], "sweeps": ["all"]}})
    before = results_hashes(res)
    proc = snakemake(tmp_path, "--cores", "2", *TARGETS, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "transplant.select: item ids ['toy-nope'] are not among the 4 selected items" in out, out[-3000:]
    assert results_hashes(res) == before

    assert verify_results(res / "tiny").hashed == []  # restored as cp -p would: trusted again, by a stat
