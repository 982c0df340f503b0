"""Several runs side by side (target compare): two toy runs that differ in the numerics regime alone, compared by
the README's command; each run's claims as its own report states them; the refusals (a damaged ledger, a failed
audit, a missing run, a run listed twice, one run) that write nothing; and the fidelity tables, absent and present."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from stagereplay.experiments.audit import AUDIT_SCHEMA
from stagereplay.io.parquet import read_parquet, write_parquet
from stagereplay.stages.compare import CompareError, compare_runs
from workflow_runner import REPO, snakemake, tiny_config

EXAMPLE = REPO / "config" / "compare-example.yaml"
pytestmark = pytest.mark.slow  # every test reads the two runs the workflow makes


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> Path:
    """The example config's two runs, `default` and `invariant` (`--config numerics=invariant run=invariant`): eight
    items with the default config's boundary and 12-token suffixes, made in one work folder."""
    workdir = tmp_path_factory.mktemp("compare")
    boundary = yaml.safe_load((REPO / "config.yaml").read_text())["boundary"]
    settings = dict(n_items=8, max_new_tokens=12, boundary=boundary,
                    bridge={"n_rows": 2, "seed": 0}, transplant={"select": "divergent:1", "sweeps": ["all"]},
                    cache_differences={"n_items": 1})
    for run, numerics in (("default", "default"), ("invariant", "invariant")):
        tiny_config(workdir, run=run, numerics=numerics, **settings)
        snakemake(workdir, "--cores", "2")
    return workdir


def copy_runs(two_runs: Path, tmp_path: Path) -> Path:
    """A copy of the two runs to change (their hash records come along; a copy is hashed once, same bytes)."""
    shutil.copytree(two_runs / "results", tmp_path / "results", symlinks=True)
    return tmp_path / "results"


def files_of(folder: Path) -> dict[str, tuple[int, int, str]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_readme_command_compares_two_runs_naming_the_one_factor_that_differs(two_runs):
    runs_before = {run: files_of(two_runs / "results" / run) for run in ("default", "invariant")}
    # The example config names the run `default`, as the config's own run is named too: it is read, never rebuilt.
    snakemake(two_runs, "--cores", "1", "compare", configfile=EXAMPLE)
    assert {run: files_of(two_runs / "results" / run) for run in ("default", "invariant")} == runs_before
    out = two_runs / "results" / "compare" / "numerics"
    stats = json.loads((out / "stats.json").read_text())
    report = (out / "report.md").read_text()
    assert stats["factors"]["differ"] == ["numerics"], stats["factors"]["differ"]
    assert "The runs differ in: **numerics**." in report
    numerics_row = next(line for line in report.splitlines() if line.startswith("| numerics |"))
    assert "**differs**" in numerics_row and "`invariant`" in numerics_row
    assert sum("**differs**" in line for line in report.splitlines()) == 1
    # Each run's column of the claim tables is its own report's Findings, row for row.
    for run in ("default", "invariant"):
        own = json.loads((two_runs / "results" / run / "report" / "stats.json").read_text())["findings"]
        column = [(c["claim"], c["runs"][run]) for c in stats["claims"] if c["runs"][run] is not None]
        assert column == [(f["claim"], {"this_run": f["this_run"], "holds": f["holds"]}) for f in own]
        assert own, "the run's report has no findings: the comparison would check nothing"
    # The divergence cells count what each run's stats.json counts.
    for cell in stats["divergence"]:
        own = json.loads((two_runs / "results" / cell["run"] / "report" / "stats.json").read_text())
        numbers = own["revisions"][cell["revision"]][cell["experiment"]][cell["precision"]]
        if cell["experiment"] == "fixed_prefix" and cell["construction_b"] != numbers["constructions"][1]:
            numbers = numbers["against_reference"][cell["construction_b"]]
        assert (cell["k"], cell["n"]) == (numbers["suffix_disagreements"]["k"], numbers["suffix_disagreements"]["n"])
        assert cell["wilson_high"] == numbers["suffix_disagreements"]["wilson_high"]
    assert {c["run"] for c in stats["divergence"]} == {"default", "invariant"}
    # both runs measured fidelity (the default config's stage): each run's pairs are summarised from its own table
    assert "The runs have no fidelity table" not in report and stats["fidelity"]["runs_without_table"] == []
    for run in ("default", "invariant"):
        table = pd.read_parquet(two_runs / "results" / run / "primary" / "fidelity.parquet")
        cells = [c for c in stats["fidelity"]["cells"] if c["run"] == run]
        assert sum(c["steps"] for c in cells) == len(table) > 0
    for name in ("divergence", "fidelity"):
        for fmt in ("png", "pdf"):
            assert (out / "figures" / f"{name}.{fmt}").stat().st_size > 1000
    assert "Nothing to be done" in snakemake(two_runs, "--cores", "1", "compare", configfile=EXAMPLE).stderr
    print(report, file=sys.stderr)  # the report text, for the record (pytest -s)


def test_a_changed_run_is_compared_again_and_one_that_fails_its_results_check_is_refused(two_runs, tmp_path):
    results = copy_runs(two_runs, tmp_path)
    shutil.rmtree(results / "compare", ignore_errors=True)
    snakemake(tmp_path, "--cores", "1", "compare", configfile=EXAMPLE)
    assert "Nothing to be done" in snakemake(tmp_path, "--cores", "1", "compare", configfile=EXAMPLE).stderr
    # A results file the comparison reads changes: compared again (its files are no inputs of the rule, so that the
    # runs themselves are never rebuilt; their recorded sha256 are in its params).
    write_parquet(fidelity_table(2, 3, 0.5, 0), results / "default" / "primary" / "fidelity.parquet", {"stage": "t"})
    proc = snakemake(tmp_path, "--cores", "1", "compare", configfile=EXAMPLE)
    assert "Params have changed since last execution" in proc.stdout + proc.stderr
    stats = json.loads((results / "compare" / "numerics" / "stats.json").read_text())
    assert sum(c["steps"] for c in stats["fidelity"]["cells"] if c["run"] == "default") == 2 * 3 * 2  # the new one
    shutil.rmtree(results / "compare")
    ledger = results / "invariant" / "primary" / "ledger.parquet"
    table = pq.read_table(ledger)
    frame = table.to_pandas()
    frame.loc[3, "correct"] = not frame.loc[3, "correct"]  # one ledger row edited, its metadata kept
    pq.write_table(pa.Table.from_pandas(frame, schema=table.schema, preserve_index=False)
                   .replace_schema_metadata(table.schema.metadata), ledger)
    proc = snakemake(tmp_path, "--cores", "1", "compare", check=False, configfile=EXAMPLE)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "COMPARISON REFUSED: run `invariant` (results/invariant) fails the results check: " \
           "results/invariant/primary/ledger.parquet is damaged" in out, out[-3000:]
    assert not (results / "compare").exists()


def refused(results: Path, runs: list[str], match: str) -> None:
    out = results / "compare" / "x"
    with pytest.raises(CompareError, match=match):
        compare_runs("x", runs, str(out / "report.md"), str(out / "stats.json"), str(out / "figures"), results)
    assert not out.exists()


def test_refusals_name_the_run_and_the_check_and_write_nothing(two_runs, tmp_path):
    results = copy_runs(two_runs, tmp_path)
    refused(results, ["default"], r"compare.runs lists 1 run\(s\) \['default'\]: a comparison needs at least two")
    refused(results, ["default", "invariant", "default"], "lists the run `default` .* twice")
    refused(results, ["default", str(results / "default")], "lists the run .* twice")
    refused(results, ["default", "nope"], r"run `nope` has no results folder .*nope; finish that run first")
    refused(results, ["default", "compare"], "the comparisons' own folder")
    # An audit row marked not reproduced, written with its records as a stage writes it: the results check passes,
    # the audit check (rule check_audit's) does not.
    audit_path = results / "invariant" / "primary" / "audit.parquet"
    audit = read_parquet(audit_path)
    audit.loc[0, "reproduced"] = False
    audit.at[0, "differed"] = ["suffix_fingerprint"]
    write_parquet(audit, audit_path, {"stage": "test"}, AUDIT_SCHEMA)
    refused(results, ["default", "invariant"], r"run `invariant` .*revision `primary`, fails the audit check "
                                               r"\(rule check_audit\).*did not reproduce")
    audit_path.unlink()
    refused(results, ["default", "invariant"], "no audit.parquet, so the audit check cannot pass")


def fidelity_table(items: int, steps: int, zero_share: float, seed: int) -> pd.DataFrame:
    """A hand-written fidelity table of the contract's columns: exact zeros (with bit-equal logits) and positive
    KLs over four decades."""
    rng = np.random.default_rng(seed)
    rows = []
    for precision in ("bf16", "fp32"):
        for item in range(items):
            for step in range(steps):
                equal = bool(rng.random() < (zero_share if precision == "bf16" else 0.9))
                kl = 0.0 if equal else float(10.0 ** rng.uniform(-10 if precision == "fp32" else -6, -2))
                rows.append({"item_index": item, "item_id": f"toy-{item}", "revision": "primary",
                             "precision": precision, "reference": "incremental",
                             "construction": "prefill", "step": step, "token_id": 5, "kl_forward": kl / 2,
                             "kl_reverse": kl / 2, "kl_sym": kl, "max_abs_logit_diff": 0.0 if equal else 0.01,
                             "margin_reference": 1.0, "margin_construction": 1.0, "argmax_differs": False,
                             "logits_equal": equal, "cache_equal": equal})
    return pd.DataFrame(rows)


def test_fidelity_tables_are_summarised_per_run_precision_and_pair(two_runs, tmp_path):
    results = copy_runs(two_runs, tmp_path)
    tables = {"default": fidelity_table(5, 12, 0.2, 0), "invariant": fidelity_table(5, 12, 1.0, 1)}
    for run, table in tables.items():
        write_parquet(table, results / run / "primary" / "fidelity.parquet", {"stage": "test"})
    out = results / "compare" / "fid"
    # In a fresh interpreter: the whole comparison, checks included, imports no model stack.
    code = ("import sys\nfrom stagereplay.stages.compare import compare_runs\n"
            f"compare_runs('fid', ['default', 'invariant'], {str(out / 'report.md')!r}, {str(out / 'stats.json')!r}, "
            f"{str(out / 'figures')!r}, {str(results)!r})\n"
            "print(sorted(m for m in ('torch', 'transformers', 'tokenizers', 'triton') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
    stats = json.loads((out / "stats.json").read_text())
    cells = {(c["run"], c["precision"]): c for c in stats["fidelity"]["cells"]}
    assert len(cells) == 4 and stats["fidelity"]["runs_without_table"] == []
    for (run, precision), cell in cells.items():
        g = tables[run][tables[run]["precision"] == precision]
        assert (cell["items"], cell["steps"]) == (5, 12 * 5)
        assert cell["logits_equal"] == int(g["logits_equal"].sum())
        assert cell["kl_sym_zero"] == int((g["kl_sym"] == 0).sum())
        assert cell["kl_sym_median"] == float(g["kl_sym"].median()) and cell["kl_sym_max"] == float(g["kl_sym"].max())
    assert cells[("invariant", "bf16")]["kl_sym_max"] == 0.0  # every step bit-identical: a KL of exactly 0
    report = (out / "report.md").read_text()
    assert "| `invariant` | `primary` | bf16 | incremental vs prefill | 5 | 60 | 60 (100.0%) | 60 | 0 (exactly) | " \
           "0 (exactly) |" in report
    assert (out / "figures" / "fidelity.png").stat().st_size > (out / "figures" / "divergence.png").stat().st_size / 4
    # One run without a table: the other is shown, and the report says which has none.
    (results / "invariant" / "primary" / "fidelity.parquet").unlink()
    compare_runs("fid", ["default", "invariant"], str(out / "report.md"), str(out / "stats.json"),
                 str(out / "figures"), results)
    assert "Run(s) `invariant` have no fidelity table: only `default` are shown." in (out / "report.md").read_text()
    # A table without the contract's columns is refused, naming the file.
    write_parquet(tables["default"].drop(columns=["kl_sym"]), results / "default" / "primary" / "fidelity.parquet",
                  {"stage": "test"})
    with pytest.raises(ValueError, match=r"default/primary/fidelity.parquet: a fidelity table without the "
                                         r"column\(s\) kl_sym"):
        compare_runs("fid", ["default", "invariant"], str(out / "report.md"), str(out / "stats.json"),
                     str(out / "figures"), results)
