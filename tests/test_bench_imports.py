"""The scripts under bench/ run one way: ``python bench/NAME.py``, from any folder, with the package importable
(``pip install -e .``, or ``PYTHONPATH=src``). They import one another by name because Python puts a script's own
folder first on ``sys.path``; none of them edits ``sys.path`` (docs/BENCHMARKS.md, "How the scripts run").

Every script's ``--help`` is run in a fresh process from a folder outside the repository: a script whose imports
(the package's, or another bench script's) do not resolve that way fails here. No script needs CUDA to be
imported: each runs on a CPU machine.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))
# Scripts whose __main__ is no command line: they are imported in a fresh process instead of asked for --help.
NOT_A_COMMAND = {
    "job_overhead": "its __main__ is the child process `pipeline_projection.py --measure-overhead` starts, which "
                    "reads its settings as JSON from argv",
}


def sys_path_edits(source: str) -> list[int]:
    """The lines of ``source`` that touch ``sys.path`` (``sys.path.insert``, ``sys.path[:0] = ...``,
    ``from sys import path``, ...) or add a site folder."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "addsitedir":
            lines.append(node.lineno)
    return sorted(lines)


def has_main(source: str) -> bool:
    """Whether ``source`` has an ``if __name__ == "__main__":`` block (a command line; the others are helpers the
    scripts import)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) \
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            return True
    return False


def package_env() -> dict:
    """The environment a reader runs a bench script in: this checkout's package first on PYTHONPATH (what
    ``pip install -e .`` gives, without depending on which checkout the installed package is)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"),
                                                                      os.environ.get("PYTHONPATH")]))}


def test_there_are_bench_scripts_to_check():
    assert len(SCRIPTS) > 20 and (BENCH / "transplant_speed.py") in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_no_bench_script_edits_sys_path(script):
    assert sys_path_edits(script.read_text()) == [], f"{script.name} edits sys.path"


@pytest.mark.parametrize("source, found", [
    ("import sys\nsys.path.insert(0, 'src')\n", [2]),
    ("import sys\nsys.path.append('bench')\n", [2]),
    ("import sys\nsys.path[:0] = ['src']\n", [2]),
    ("from sys import path\npath.insert(0, 'src')\n", [1]),
    ("import site\nsite.addsitedir('src')\n", [2]),
    ("import sys\nsys.exit(sys.argv[1])\n", []),
])
def test_the_check_finds_an_edit_of_sys_path(source, found):
    assert sys_path_edits(source) == found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_each_bench_script_runs_from_another_folder(script, tmp_path):
    source = script.read_text()
    if script.stem in NOT_A_COMMAND:
        # imported as a module would be, under another name than __main__
        argv = [sys.executable, "-c", f"import runpy; runpy.run_path({str(script)!r}, run_name='imported')"]
    else:
        argv = [sys.executable, str(script), "--help"]
    proc = subprocess.run(argv, cwd=tmp_path, env=package_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if has_main(source) and script.stem not in NOT_A_COMMAND:
        assert proc.stdout.startswith("usage:"), proc.stdout[:500]


def test_a_script_that_imports_a_missing_sibling_fails_here(tmp_path):
    """The control: the check above does fail for a script whose bench import does not resolve."""
    (tmp_path / "bench").mkdir()
    broken = tmp_path / "bench" / "broken.py"
    broken.write_text("from no_such_bench_script import thing\n")
    proc = subprocess.run([sys.executable, str(broken), "--help"], cwd=tmp_path, env=package_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr
