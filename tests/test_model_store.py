"""The model store: entries keyed by content, prepared once under a lock, checked by content, listed and removed."""

from __future__ import annotations

import json
import multiprocessing
import shutil
from pathlib import Path

import pytest

from stagereplay.models import store as store_module
from stagereplay.models.opening import recorded_entry
from stagereplay.models.store import ModelStore, StoreError, converter_versions, ensure, entry_key
from stagereplay.stages.input_fingerprints import model_fingerprint
from stagereplay.stages.integrity import store_entries
from stagereplay.stages.prepare import prepare_again, prepare_model, snapshots_for
from stagereplay.stages.settings import PrepareSettings


def settings(model_dir, store, **extra) -> PrepareSettings:
    model = str(model_dir)
    return PrepareSettings(model=model, revision="local", device="cpu", threads=1, precisions=["bf16", "fp32"],
                           model_fingerprint=model_fingerprint(model, "local"), model_store=str(store), **extra)


def entry_files(store) -> dict:
    """The entries' files with their modification times (not the locks or the last-use dates)."""
    return {p: p.stat().st_mtime_ns for p in Path(store).glob("*/*")
            if not any(part.startswith(".") for part in p.relative_to(store).parts)}


def test_the_key_is_the_content_and_the_converters_not_the_path_or_optional_packages(tiny_model_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    link = tmp_path / "link"
    link.symlink_to(tiny_model_dir)
    digests = {model_fingerprint(str(p), "local")["sha256"] for p in (tiny_model_dir, copy, link)}
    assert len(digests) == 1  # the same files by three paths
    sha = digests.pop()
    assert entry_key(sha, "local", "bf16") != entry_key(sha, "local", "fp32")
    assert entry_key(sha, "local", "bf16") != entry_key("0" * 64, "local", "bf16")
    # gguf converts GGUF sources only: installing or removing it keys no safetensors model anew
    assert "gguf" not in converter_versions("local") and "gguf" in converter_versions("gguf")
    for optional in ("triton", "playwright", "pytest", "accelerate", "datasets"):
        assert optional not in converter_versions("gguf")


def test_a_second_run_prepares_nothing_and_reads_the_same_entries(tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    first = prepare_model(str(tmp_path / "a.json"), settings(tiny_model_dir, store))
    entries = sorted(p for p in store.iterdir() if not p.name.startswith("."))
    stamps = entry_files(store)
    # another run, through another path to the same files: the same keys, nothing written
    link = tmp_path / "elsewhere"
    link.symlink_to(tiny_model_dir)
    second = prepare_model(str(tmp_path / "b.json"), settings(link, store))
    assert second["snapshots"] == first["snapshots"] and len(entries) == 2
    assert entry_files(store) == stamps and stamps
    rows = {r["key"]: r for r in ModelStore(store).entries()}
    assert sorted(rows) == [e.name for e in entries]
    assert all(r["last_used"] and r["source"].endswith(tiny_model_dir.name) for r in rows.values())
    linked = [r for r in rows.values() if r["mode"] == "linked"]  # the toy is saved in fp32: links, no room taken
    assert len(linked) == 1 and linked[0]["bytes"] < 10_000


def _prepare_in_process(model_dir, store, out, counter):
    from stagereplay.models import snapshot

    write = snapshot.write_snapshots

    def counted(*args, **kwargs):
        with open(counter, "a") as f:
            f.write("prepared\n")
        return write(*args, **kwargs)

    snapshot.write_snapshots = counted
    record = prepare_model(out, settings(Path(model_dir), store))
    Path(out + ".done").write_text(json.dumps(record["snapshots"], sort_keys=True))


def test_two_runs_preparing_one_key_at_once_prepare_it_once(tiny_model_dir, tmp_path):
    store, counter = tmp_path / "store", tmp_path / "count"
    context = multiprocessing.get_context("spawn")  # fresh processes, as two Snakemake jobs are
    procs = [context.Process(target=_prepare_in_process, args=(str(tiny_model_dir), str(store),
                                                                  str(tmp_path / f"{i}.json"), str(counter)))
             for i in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(300)
        assert proc.exitcode == 0
    assert counter.read_text().count("prepared") == 1  # the second waited on the lock, then found the entries
    assert (tmp_path / "0.json.done").read_text() == (tmp_path / "1.json.done").read_text()
    assert not list((store / ".incoming").iterdir())  # nothing half-written left behind
    for key in json.loads((tmp_path / "0.json.done").read_text()).values():
        assert ModelStore(store).problems(key["key"]) == []


def test_an_entry_with_a_missing_or_changed_file_is_caught_and_prepared_again(tiny_model_dir, tmp_path):
    """A job refuses an entry that is gone or damaged, naming it and the fix, and prepares nothing; what the
    workflow runs before its first job (prepare_again) prepares it again, byte for byte the recorded snapshot."""
    store = tmp_path / "store"
    record_path = str(tmp_path / "models" / "local.json")
    s = settings(tiny_model_dir, store)
    record = prepare_model(record_path, s)
    key = record["snapshots"]["bf16"]["key"]
    entry = ModelStore(store).path(key)
    assert store_entries(tmp_path) == [] and prepare_again(record_path, s) == []  # the run's check: every entry whole
    assert recorded_entry(record_path, "bf16")[0] == entry
    (entry / "tokenizer_config.json").unlink()
    assert "tokenizer_config.json missing" in ModelStore(store).problems(key)[0]
    lines = store_entries(tmp_path)
    assert len(lines) == 1 and "bf16 snapshot" in lines[0] and "damaged" in lines[0]
    assert "prepares it again before its first job" in lines[0]
    stamps = entry_files(store)
    with pytest.raises(StoreError, match=rf"store entry {key} .* is gone or damaged .*tokenizer_config.json missing.*"
                                         "a job prepares nothing: rerun the workflow, which prepares it again"):
        recorded_entry(record_path, "bf16")
    assert entry_files(store) == stamps  # the job wrote nothing
    assert prepare_again(record_path, s) == ["bf16"]
    assert recorded_entry(record_path, "bf16")[0] == entry
    assert ModelStore(store).problems(key) == [] and store_entries(tmp_path) == []
    # bytes changed in place (same size, new mtime): caught by content
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert "model.safetensors changed since it was prepared" in ModelStore(store).problems(key)[0]
    with pytest.raises(StoreError, match="model.safetensors changed since it was prepared"):
        recorded_entry(record_path, "bf16")
    assert prepare_again(record_path, s) == ["bf16"] and ModelStore(store).problems(key) == []
    # gone: refused by the job, prepared again by the workflow
    assert store_module.main(["--store", str(store), "remove", key]) == 0 and not entry.exists()
    assert "is gone" in store_entries(tmp_path)[0]
    with pytest.raises(StoreError, match=rf"store entry {key} .* is gone or damaged .*does not exist"):
        recorded_entry(record_path, "bf16")
    assert not entry.exists()
    assert prepare_again(record_path, s) == ["bf16"]
    assert recorded_entry(record_path, "bf16")[0] == entry and ModelStore(store).problems(key) == []


def test_a_rebuilt_entry_that_is_not_the_recorded_snapshot_is_refused(tiny_model_dir, tmp_path):
    """The control of the test above: an entry that is not the snapshot the run recorded is refused by the job, and
    one prepared again with other bytes than the run recorded stops the workflow, naming both snapshots."""
    store = tmp_path / "store"
    record_path = str(tmp_path / "local.json")
    s = settings(tiny_model_dir, store)
    record = prepare_model(record_path, s)
    record["snapshots"]["bf16"]["snapshot_sha256"] = "f" * 64
    Path(record_path).write_text(json.dumps(record))
    with pytest.raises(StoreError, match=r"holds the snapshot \w{16} at 'bf16', not ffffffffffffffff at 'bf16' as "
                                         r".*local\.json records"):
        recorded_entry(record_path, "bf16")
    ModelStore(store).discard(record["snapshots"]["bf16"]["key"])
    with pytest.raises(StoreError, match=r"not .* \(ffffffffffffffff\) as .*local\.json records"):
        prepare_again(record_path, s)


@pytest.mark.slow
def test_a_removed_entry_plans_no_job_and_the_next_run_prepares_it_again_before_its_first_job(tmp_path):
    """The workflow's side of the test above: an entry removed from the store plans nothing (a rerun of
    prepare_model would rerun every job that loads the model); the run prepares it again before its first job, and
    the job that loads it computes the same bytes."""
    from workflow_runner import snakemake, tiny_config

    store = tmp_path / "store"
    tiny_config(tmp_path, n_items=2, max_new_tokens=4, precisions=["fp32"], reference_precision="fp32",
                bridge={"n_rows": 1, "seed": 0}, model_store=str(store))
    target = "results/tiny/primary/parts/matched_fp32_0.parquet"
    part = tmp_path / target
    snakemake(tmp_path, "--cores", "1", target)
    written = part.read_bytes()
    record = json.loads((tmp_path / "results/tiny/models/primary.json").read_text())
    key = record["snapshots"]["fp32"]["key"]
    assert store_module.main(["--store", str(store), "remove", key]) == 0
    part.unlink()  # the one job that loads the entry has to run again
    dry = snakemake(tmp_path, "-n", "--cores", "1", target)
    out = dry.stdout + dry.stderr
    assert "is gone in the model store" in out and "prepares it again before its first job" in out, out[-3000:]
    assert "reconstruct_prefixes" in dry.stdout and "prepare_model" not in dry.stdout
    assert not ModelStore(store).path(key).exists()  # a dry run prepares nothing
    run = snakemake(tmp_path, "--cores", "1", target)
    assert "Store entries of primary at fp32 prepared again" in run.stdout + run.stderr
    assert ModelStore(store).problems(key, record["source_sha256"]) == []
    assert part.read_bytes() == written


def test_the_command_lists_and_removes_entries(tiny_model_dir, tmp_path, capsys):
    store = tmp_path / "store"
    record = prepare_model(str(tmp_path / "r.json"), settings(tiny_model_dir, store))
    keys = sorted(s["key"] for s in record["snapshots"].values())
    assert store_module.main(["--store", str(store), "list"]) == 0
    listed = capsys.readouterr().out
    assert "2 entries" in listed and all(k in listed for k in keys) and "last used" in listed
    assert store_module.main(["--store", str(store), "check"]) == 0
    assert store_module.main(["--store", str(store), "remove", "bf16-nothere"]) == 2
    assert "not in" in capsys.readouterr().err
    assert store_module.main(["--store", str(store), "remove", "--unused-days", "1"]) == 2  # used just now
    assert store_module.main(["--store", str(store), "remove", keys[0]]) == 0
    assert [r["key"] for r in ModelStore(store).entries()] == keys[1:]
    assert store_module.main(["--store", str(store), "remove", "--all"]) == 0
    assert ModelStore(store).entries() == []


def test_a_failed_preparation_leaves_no_entry(tmp_path):
    store = ModelStore(tmp_path / "store")

    def fails(folders):
        for folder in folders.values():
            (folder / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        ensure(store, {"bf16": "bf16-x"}, "0" * 64, fails)
    assert store.entries() == [] and not list((store.root / ".incoming").iterdir())


def test_snapshots_for_refuses_a_source_it_cannot_fingerprint(tmp_path):
    with pytest.raises(Exception, match="neither a subfolder|not an existing folder"):
        snapshots_for(PrepareSettings(model=str(tmp_path / "nothing"), revision="local", precisions=["bf16"],
                                      model_store=str(tmp_path / "store")), ["bf16"])


def test_a_job_checks_its_entry_by_the_entrys_record_and_reads_no_weights_to_hash(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """A job's open of a store entry stats its files against the entry's own record (the weights are not read
    a second time to hash them: 1.7 s of a 0.5B job's start on the GPU host); a file changed in place since is
    still read, and refused."""
    from stagereplay.io import file_hashes

    store = tmp_path / "store"
    record_path = str(tmp_path / "local.json")
    record = prepare_model(record_path, settings(tiny_model_dir, store))
    entry = ModelStore(store).path(record["snapshots"]["bf16"]["key"])
    fingerprint = model_fingerprint(str(tiny_model_dir), "local")
    hashed = []
    real = file_hashes.sha256_of_file
    monkeypatch.setattr(file_hashes, "sha256_of_file", lambda path: hashed.append(Path(path).name) or real(path))
    assert recorded_entry(record_path, "bf16", fingerprint["sha256"])[0] == entry
    assert hashed == []
    # the control: without the entry's record the same check reads and hashes every file
    (entry / store_module.HASHES).rename(tmp_path / "record.json")
    recorded_entry(record_path, "bf16", fingerprint["sha256"])
    assert "model.safetensors" in hashed
    (tmp_path / "record.json").rename(entry / store_module.HASHES)
    hashed.clear()
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # same size, new mtime: read again, and refused by content
    with pytest.raises(StoreError, match="model.safetensors"):
        recorded_entry(record_path, "bf16", fingerprint["sha256"])
    assert hashed == ["model.safetensors"]
