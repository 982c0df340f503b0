"""A results file is bound to its run by content: the rule, params and upstream files of the job that wrote it are
recorded beside it. One copied in from another run with its record (``cp -a``, ``rsync``) is refused before any job,
naming the file and the fix, with nothing rewritten; a rerun of an unchanged run, or of a run copied whole under
another name, reads its own files (docs/BAD_INPUTS.md)."""

import hashlib
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from stagereplay.io.bindings import bind_written_files, job_binding
from stagereplay.io.parquet import hash_record_path, read_hash_record, write_parquet
from stagereplay.stages.integrity import (
    ForeignResultsError,
    PlannedJob,
    foreign_files,
    foreign_inputs,
    refuse_foreign,
    verify_results,
)
from workflow_runner import snakemake, tiny_config


def write_as_job(rule: str, params: dict, inputs: list[str], outputs: dict[str, pd.DataFrame], root: str):
    """What a rule job does: bind, then write its outputs (stagereplay.stages.rule_job.bind_job)."""
    bind_written_files(job_binding(rule, params, inputs, root))
    try:
        for path, frame in outputs.items():
            write_parquet(frame, path, {"stage": rule})
    finally:
        bind_written_files(None)
    return PlannedJob(rule, params, inputs, list(outputs))


def small_run(workdir: Path, run: str, seed: int) -> list[PlannedJob]:
    """Selection -> part -> ledger, as three jobs of run ``run`` (paths relative to ``workdir``, the cwd)."""
    root = f"results/{run}"
    items = pd.DataFrame({"item_id": [f"toy-{seed}-{i}" for i in range(3)]})
    select = write_as_job("select_items", {"kwargs": {"seed": seed, "n_items": 3}}, [],
                          {f"{root}/selection/items.parquet": items}, root)
    part = write_as_job("reconstruct_prefixes", {"kwargs": {"prepared": f"{root}/models/primary.json"}},
                        [f"{root}/selection/items.parquet", f"{root}/models/primary.json", "data/toy/primary"],
                        {f"{root}/primary/parts/matched_bf16_0.parquet": items.assign(x=seed)}, root)
    ledger = write_as_job("gather_ledger", {"version": "1"}, [f"{root}/primary/parts/matched_bf16_0.parquet"],
                          {f"{root}/primary/ledger.parquet": items.assign(x=seed, y=1)}, root)
    return [select, part, ledger]


def copy_with_record(source: Path, target: Path) -> None:
    """What cp -a does to a file and its hash record."""
    for name in (source.name, hash_record_path(source).name):
        shutil.copy2(source.parent / name, target.parent / name)


def test_each_written_file_records_its_jobs_binding_and_sha256sum_still_reads_the_record(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    jobs = small_run(tmp_path, "tiny", 0)
    ledger = Path("results/tiny/primary/ledger.parquet")
    binding = read_hash_record(ledger).binding
    part = "primary/parts/matched_bf16_0.parquet"  # inputs named within the run; the model folder is in params
    assert binding == {"rule": "gather_ledger", "params": binding["params"],
                       "inputs": {part: read_hash_record(f"results/tiny/{part}").sha256}}
    # the record of the model store entries binds through the params (their keys), not the store's folder it names
    assert set(read_hash_record(f"results/tiny/{part}").binding["inputs"]) == {"selection/items.parquet"}
    check = subprocess.run(["sha256sum", "-c", hash_record_path(ledger).name], cwd=ledger.parent,
                           capture_output=True, text=True)
    assert (check.returncode, check.stdout, check.stderr) == (0, "ledger.parquet: OK\n", "")
    assert foreign_files(jobs, "results/tiny") == [] and foreign_inputs("results/tiny") == []


def test_a_file_of_another_run_copied_in_with_its_record_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    jobs = small_run(tmp_path, "tiny", 0)
    small_run(tmp_path, "other", 1)
    mine, theirs = Path("results/tiny/primary/ledger.parquet"), Path("results/other/primary/ledger.parquet")
    copy_with_record(theirs, mine)
    assert verify_results("results/tiny", refresh=False).hashed == [str(mine)]  # its bytes match its record
    for found in (foreign_files(jobs, "results/tiny"), foreign_inputs("results/tiny")):
        assert found == [
            f"{mine} is not this run's: it was made from another results/tiny/primary/parts/matched_bf16_0.parquet "
            f"(sha256 {read_hash_record(theirs).binding['inputs']['primary/parts/matched_bf16_0.parquet'][:16]}…) "
            f"than the one this run holds ({read_hash_record('results/tiny/primary/parts/matched_bf16_0.parquet').sha256[:16]}…). "
            "It was copied in from another run (cp -a, rsync) or left by a run on other inputs; move it and its "
            "record .ledger.parquet.sha256 out of results/tiny to recompute it (and what depends on it) with the "
            "next run, or restore this run's own copy"]
    with pytest.raises(ForeignResultsError, match="Nothing was run and nothing deleted.$"):
        refuse_foreign(foreign_files(jobs, "results/tiny"))
    # where Snakemake makes the file again (its job reruns), a foreign copy costs nothing: it is not judged
    assert foreign_files([j for j in jobs if j.rule != "gather_ledger"], "results/tiny") == []


def test_a_selection_of_other_settings_is_refused_by_its_params(tmp_path, monkeypatch):
    """The selection has no input in the run: what binds it is its settings (seed, n_items, dataset)."""
    monkeypatch.chdir(tmp_path)
    jobs = small_run(tmp_path, "tiny", 0)
    small_run(tmp_path, "other", 1)
    items = Path("results/tiny/selection/items.parquet")
    copy_with_record(Path("results/other/selection/items.parquet"), items)
    found = foreign_files(jobs, "results/tiny")
    assert found[0].startswith(f"{items} is not this run's: it was made with other settings than this run's "
                               "select_items has (its params: the config's values, the dataset's and model's "
                               "fingerprints, the package version). It was copied in from another run")
    assert found[1].startswith("results/tiny/primary/parts/matched_bf16_0.parquet is not this run's: it was made from "
                               "another results/tiny/selection/items.parquet")


def test_a_run_copied_whole_under_another_name_is_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small_run(tmp_path, "tiny", 0)
    shutil.copytree("results/tiny", "results/copy", copy_function=shutil.copy2)
    jobs = small_run_jobs("copy", 0)  # its paths and params name results/copy, its records results/tiny
    assert foreign_files(jobs, "results/copy") == []


def small_run_jobs(run: str, seed: int) -> list[PlannedJob]:
    """The jobs of :func:`small_run` as the workflow plans them, without writing anything."""
    root = f"results/{run}"
    return [PlannedJob("select_items", {"kwargs": {"seed": seed, "n_items": 3}}, [],
                       [f"{root}/selection/items.parquet"]),
            PlannedJob("reconstruct_prefixes", {"kwargs": {"prepared": f"{root}/models/primary.json"}},
                       [f"{root}/selection/items.parquet", f"{root}/models/primary.json", "data/toy/primary"],
                       [f"{root}/primary/parts/matched_bf16_0.parquet"]),
            PlannedJob("gather_ledger", {"version": "1"}, [f"{root}/primary/parts/matched_bf16_0.parquet"],
                       [f"{root}/primary/ledger.parquet"])]


def test_refreshing_a_copied_files_record_keeps_its_binding(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small_run(tmp_path, "tiny", 0)
    ledger = Path("results/tiny/primary/ledger.parquet")
    binding = read_hash_record(ledger).binding
    shutil.copy2(ledger, "copy")
    shutil.move("copy", ledger)  # the same bytes in another inode (restored with cp -p)
    assert verify_results("results/tiny").hashed == [str(ledger)]
    assert read_hash_record(ledger).binding == binding and verify_results("results/tiny").hashed == []


# --- the workflow --------------------------------------------------------------------------------------------

def results_state(root: Path) -> dict:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_the_workflow_refuses_another_runs_ledger_before_any_job_and_reruns_its_own(tmp_path):
    """Before: the copied ledger passed the results check, and 14 jobs rewrote the audit, dumps, fidelity, onset,
    figures and browser from it before check_audit stopped the run."""
    settings = dict(n_items=2, max_new_tokens=4, precisions=["bf16"], shards=1)
    for run, seed in (("other", 1), ("tiny", 0)):  # the other run older, as a copy kept from an earlier run is
        tiny_config(tmp_path, run=run, seed=seed, **settings)
        snakemake(tmp_path, "--cores", "2", f"results/{run}/primary/audit.parquet")
    target = "results/tiny/primary/audit.parquet"
    mine = tmp_path / "results/tiny/primary/ledger.parquet"
    original = {p: p.read_bytes() for p in (mine, hash_record_path(mine))}
    copy_with_record(tmp_path / "results/other/primary/ledger.parquet", mine)
    mine.touch()  # newer than this run's audit, as a copy of a later run is: Snakemake would rerun from it
    before = results_state(tmp_path / "results/tiny")
    for args in (["-n"], ["--cores", "2"]):
        proc = snakemake(tmp_path, *args, target, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-3000:]
        assert ("results/tiny/primary/ledger.parquet is not this run's: it was made from another "
                "results/tiny/primary/parts/") in out, out[-3000:]
        assert "move it and its record .ledger.parquet.sha256 out of results/tiny to recompute it" in out
        assert "Nothing was run and nothing deleted." in out
        assert results_state(tmp_path / "results/tiny") == before, args
    for path, data in original.items():
        path.write_bytes(data)
    proc = snakemake(tmp_path, "--cores", "2", target, "--forcerun", "gather_audit")  # this run's own files pass
    assert "Results checked:" in proc.stdout + proc.stderr


def test_gathered_cache_dumps_carry_their_records_so_other_dumps_of_the_same_names_are_told_apart(tmp_path):
    """gather_caches links the shards' dumps into caches/: each link gets the record of its part (a stat checks it
    before a run), so the folder's digest in its readers' bindings is by content, not by file names alone."""
    from stagereplay.io.bindings import recorded_digest
    from stagereplay.io.parquet import record_link, write_text_atomic

    folders = {}
    for run, content in (("mine", "dump a"), ("theirs", "dump b")):
        part = tmp_path / run / "parts" / "caches_0" / "item000001_bf16_live.safetensors"
        write_text_atomic(part, content)
        target = tmp_path / run / "caches" / part.name
        target.parent.mkdir()
        target.hardlink_to(part)
        record_link(part, target)
        assert read_hash_record(target).sha256 == read_hash_record(part).sha256
        assert verify_results(tmp_path / run).unrecorded == []
        folders[run] = recorded_digest(target.parent)
    assert folders["mine"] != folders["theirs"]
