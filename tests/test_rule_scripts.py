"""Every rule script starts its job in one place: its first statement is ``start_job(snakemake)`` of
stagereplay.stages.rule_job (the log, the logging and, for the warm rules, the hand-over to the job server), and no
script does any of that itself."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_job_imports import TABLE_JOBS, script_imports

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "workflow" / "scripts").glob("*.py"))
RUNNER = "stagereplay.stages.rule_job"


def start_call(script: Path) -> ast.Call:
    """The script's call of ``start_job``, checked to be its first statement after importing it, and its only use."""
    tree = ast.parse(script.read_text())
    first, second = tree.body[:2]
    imports_it = isinstance(first, ast.ImportFrom) and first.module == RUNNER \
        and [alias.name for alias in first.names] == ["start_job"]
    assert imports_it, f"{script.name} does not begin by importing start_job from {RUNNER}"
    calls_it = isinstance(second, ast.Expr) and isinstance(second.value, ast.Call) \
        and getattr(second.value.func, "id", None) == "start_job"
    assert calls_it, f"{script.name}'s second statement is not start_job(...)"
    uses = [node for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "start_job"]
    assert len(uses) == 1, f"{script.name} calls start_job more than once"
    return second.value


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_rule_script_starts_its_job_with_the_runner_alone(script):
    call = start_call(script)
    assert [ast.unparse(arg) for arg in call.args] == ["snakemake"]
    assert all(k.arg == "warm" and isinstance(k.value, ast.Constant) for k in call.keywords), ast.unparse(call)
    tree = ast.parse(script.read_text())
    for node in ast.walk(tree):
        text = ast.unparse(node) if isinstance(node, (ast.Assign, ast.Call, ast.Attribute, ast.Name)) else ""
        assert not (isinstance(node, ast.Assign) and any(ast.unparse(t) == "sys.stderr" for t in node.targets)), \
            f"{script.name} redirects its standard error itself: start_job does"
        assert text != "logging.basicConfig", f"{script.name} sets logging up itself: start_job does"
        assert text != "snakemake.log", f"{script.name} opens its log itself: start_job does"
        assert text != "hand_over", f"{script.name} hands itself over: start_job(snakemake, warm=True) does"


def is_warm(script: Path) -> bool:
    return any(k.arg == "warm" and k.value.value for k in start_call(script).keywords)


def test_the_jobs_that_import_the_preloaded_stack_start_warm_and_table_jobs_do_not():
    from stagereplay.stages.rule_job import PRELOAD

    warm = {script.stem for script in SCRIPTS if is_warm(script)}
    assert warm and not warm & set(TABLE_JOBS), warm & set(TABLE_JOBS)  # a server would import torch for them
    preloaded = {script.stem for script in SCRIPTS if set(script_imports(script)) & set(PRELOAD)}
    assert preloaded <= warm, f"import preloaded modules but do not start warm: {sorted(preloaded - warm)}"


def test_the_runner_sends_standard_error_and_logging_to_the_log(tmp_path):
    """What a job writes to standard error, and what it logs at INFO, lands in its log (a job's own process empties
    the log first)."""
    log = tmp_path / "job.log"
    log.write_text("an earlier attempt's lines\n")
    code = ("import logging, sys, types\n"
            f"from {RUNNER} import start_job\n"
            f"start_job(types.SimpleNamespace(log=[{str(log)!r}], config={{}}))\n"
            "logging.getLogger('stagereplay').info('a logged line')\n"
            "print('a line to stderr', file=sys.stderr)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert proc.stderr == "" and log.read_text() == "INFO:stagereplay:a logged line\na line to stderr\n"
