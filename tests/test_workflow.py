"""End to end: the Snakemake workflow on a tiny config in a temp directory, and the results contract."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from stagereplay import catalogue
from stagereplay.analysis import captions
from stagereplay.io.parquet import read_provenance
from test_model_store import entry_files
from test_prepared_model import assert_each_precision_prepared_once_and_loaded_by_every_job
from workflow_runner import REPO, snakemake, snakemake_command, tiny_config

# A sitecustomize that makes importlib.metadata say the packages ``hidden`` are not installed and the packages
# ``changed`` are another build of their version.
HIDE_PACKAGES = """
import importlib.metadata as metadata

_version = metadata.version


def version(name):
    if name.lower() in {hidden!r}:
        raise metadata.PackageNotFoundError(name)
    if name.lower() in {changed!r}:
        return _version(name) + "+another.build"
    return _version(name)


metadata.version = version
"""

FIGURES = catalogue.figure_names()


@pytest.mark.slow
def test_default_workflow_end_to_end(tmp_path):
    cfg = tiny_config(tmp_path)
    snakemake(tmp_path, "--cores", "2")
    assert_each_precision_prepared_once_and_loaded_by_every_job(tmp_path, cfg)
    res = tmp_path / "results/tiny"
    for rel in ["selection/items.parquet", "primary/prefixes.parquet", "primary/ledger.parquet",
                "report/report.md", "report/stats.json"]:
        assert (res / rel).is_file(), rel
    items = pd.read_parquet(res / "selection/items.parquet")
    ledger = pd.read_parquet(res / "primary/ledger.parquet")
    assert len(items) == 6
    # one row per (item, construction, replica) of the matched experiment; missing boundaries keep their live rows
    for precision in ("bf16", "fp32"):  # the default precisions
        matched = ledger[(ledger["experiment"] == "matched") & (ledger["precision"] == precision)]
        ok = matched[matched["status"] == "ok"]["item_index"].nunique()
        assert len(matched) == 4 * ok + 2 * (6 - ok)
        assert set(matched["construction"]) <= {"live", "prefill"}
    prov = read_provenance(res / "primary/ledger.parquet")
    part = prov["parts"][0]
    assert part["numerics"]["deterministic_algorithms"] is True and part["numerics"]["tf32_matmul"] is False
    assert part["attn_implementation"] == "sdpa" and part["dtype"] == "bfloat16"
    report = (res / "report/report.md").read_text()
    assert "166 / 200" in report and "suffixes that differ" in report
    # batch_size 1: the batch-invariance control has nothing to compare: not scheduled, and the report says why
    assert not (res / "primary/batch_invariance.parquet").exists()
    assert "_Not run: batch_size is 1, so every item was decoded alone" in report
    # The paper figures, the cache differences behind figure 4, and `snakemake --report` with their captions.
    for name in FIGURES:
        for fmt, magic in (("pdf", b"%PDF-"), ("png", b"\x89PNG")):
            data = (res / f"report/figures/{name}.{fmt}").read_bytes()
            assert len(data) > 1000 and data.startswith(magic), (name, fmt)
        assert f"![{name}](figures/{name}.png)" in report
    differences = pd.read_parquet(res / "primary/cache_differences.parquet")
    assert set(differences["precision"]) == {"bf16", "fp32"} and differences["item_index"].nunique() == min(2, ok)
    snakemake(tmp_path, "--report", str(tmp_path / "report.html"))
    page = (tmp_path / "report.html").read_text(errors="replace")
    assert "Paired accuracy difference between constructions" in page
    for number, (title, _) in enumerate(captions.CAPTIONS.values(), start=1):  # figures by number and title
        assert f"{number:02d}. {title}" in page, title
    assert "findings, claims and tables (report.md)" in page  # the report's own page, tables included
    rendered = (res / "report/report.html").read_text()
    assert "<h2>Findings</h2>" in rendered and "<table>" in rendered

    # a second run of another name on the same model prepares nothing: its record names the same store entries
    record = json.loads((res / "models/primary.json").read_text())
    entries = [Path(record["store"]) / snap["key"] for snap in record["snapshots"].values()]

    def entry_stamps():  # the run's entries only: other tests' workflows share the store
        return {path: stamp for entry in entries for path, stamp in entry_files(record["store"]).items()
                if path.parent == entry}

    stamps = entry_stamps()
    snakemake(tmp_path, "--cores", "2", "--config", "run=tiny2", "--until", "prepare_model")
    log = (tmp_path / "logs/tiny2/primary/prepare_model.log").read_text()
    assert log.count("already in the store") == 2 and "preparing" not in log
    assert (tmp_path / "results/tiny2/models/primary.json").read_text() == \
        (res / "models/primary.json").read_text()
    assert entry_stamps() == stamps and len({path.parent for path in stamps}) == 2

    # A package that takes no part in a job's result is in no job's params: with the optional ones hidden from
    # importlib.metadata the finished run plans nothing; another build of one that converts the model (tokenizers)
    # replans the preparation and what loaded it (the control).
    def planned_with(hidden=(), changed=()):
        site = tmp_path / f"hide_{'_'.join(hidden + changed)}"
        site.mkdir()
        (site / "sitecustomize.py").write_text(HIDE_PACKAGES.format(hidden=hidden, changed=changed))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(snakemake_command(tmp_path, "-n", "--cores", "1"), env=env, capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    assert "Nothing to be done" in planned_with(hidden=("gguf", "triton", "playwright", "datasets"))
    replanned = planned_with(changed=("tokenizers",))
    assert "prepare_model" in replanned and "reconstruct_prefixes" in replanned


@pytest.mark.slow
def test_bad_config_fails_before_any_work(tmp_path):
    tiny_config(tmp_path, n_itmes=3)
    proc = snakemake(tmp_path, "--cores", "1", check=False)
    assert proc.returncode != 0
    assert "n_itmes" in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_lint_is_clean(tmp_path):
    tiny_config(tmp_path)
    proc = snakemake(tmp_path, "--lint", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # and the workflow is formatted, at the line length pyproject.toml gives snakefmt (120)
    pytest.importorskip("snakefmt")
    proc = subprocess.run([sys.executable, "-m", "snakefmt", "--check", "Snakefile", "workflow"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_static_regime_end_to_end_is_audited_and_bridged(tmp_path):
    """The static-cache regime is a recorded construction factor: every later stage rebuilds its caches in it, so
    the audit reproduces every row and the bridge stays bit-exact within the regime."""
    tiny_config(tmp_path, n_items=4, precisions=["bf16"], decode_regime="static", cache_differences={"n_items": 1})
    res = tmp_path / "results/tiny/primary"
    # the files read below, and what they need: generation, the 2x2, the audit, the bridge, the transplants (the
    # whole workflow in the static regime runs in tests/test_batched_workflow.py)
    snakemake(tmp_path, "--cores", "2", *(str((res / f"{name}.parquet").relative_to(tmp_path))
                                          for name in ("ledger", "audit", "bridge", "transplant")))
    ledger = pd.read_parquet(res / "ledger.parquet")
    assert set(ledger["decode_regime"]) == {"static"} and set(ledger["experiment"]) == {"matched", "fixed_prefix"}
    audit = pd.read_parquet(res / "audit.parquet")
    assert len(audit) == len(ledger) and audit["reproduced"].all()
    bridge = pd.read_parquet(res / "bridge.parquet")
    ok = bridge[bridge["status"] == "ok"]
    assert len(ok) and ok["bit_exact"].all()
    assert read_provenance(res / "transplant.parquet")["parts"][0]["decode_regime"] == "static"
