"""Jobs that load no model import no model stack: each rule script's package imports, in a fresh process.

A job is a fresh Python process; torch alone costs it 2 to 3 CPU-s to import, transformers and scipy more. The
selection, the gathers of the model stages' parts and the audit's check read and write tables only, so importing
what their scripts import must not pull any of those in (bench/job_start.py measures what that saves).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "workflow" / "scripts"
# The model stack and the analysis stack: none of it belongs in a job that only reads and writes tables.
HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "triton", "scipy", "statsmodels", "matplotlib",
         "sympy")
TABLE_JOBS = ["select_items", "gather_ledger", "gather_audit", "check_audit", "select_transplant_items",
              "gather_replay_baseline", "gather_transplants", "gather_minimal_transplants", "gather_divergence_onset",
              "gather_batch_invariance", "gather_cache_differences", "gather_caches", "gather_fidelity"]


def script_imports(script: Path) -> list[str]:
    """The ``stagereplay`` modules a rule script imports, as the script names them."""
    names = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stagereplay"):
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names if alias.name.startswith("stagereplay")]
    return names


def heavy_after_import(modules: list[str]) -> list[str]:
    """The packages of HEAVY in ``sys.modules`` of a fresh interpreter after importing ``modules``."""
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", TABLE_JOBS)
def test_table_jobs_import_no_model_stack(script):
    modules = script_imports(SCRIPTS / f"{script}.py")
    assert modules, f"{script}.py imports nothing from stagereplay: the test would check nothing"
    heavy = heavy_after_import(modules)
    assert not heavy, (f"workflow/scripts/{script}.py's imports ({', '.join(modules)}) pull in {heavy}: a job that "
                       "loads no model must not; import the heavy package inside the function that needs it, or "
                       "keep the stage in a module without it (python -X importtime names the chain)")


def test_the_check_sees_torch_where_it_is_imported():
    """The control: a model stage's module does pull torch in, so the check above can fail."""
    assert "torch" in heavy_after_import(["stagereplay.stages.jobs"])


def test_the_software_versions_are_the_modules_own_strings_without_importing_them():
    """Every results file records ``torch.__version__`` and ``transformers.__version__`` (a GPU build's torch says
    ``2.11.0+cu130``, its distribution ``2.11.0``): a table job reads them from the files that assign them, so it
    records the same strings as a model job without importing either package."""
    code = ("import json, sys\n"
            "from stagereplay.io.provenance import software_versions\n"
            "read = software_versions()\n"
            "imported = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            "import torch, transformers\n"
            "print(json.dumps([read['torch'], read['transformers'], torch.__version__, transformers.__version__,"
            " imported]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    torch_read, transformers_read, torch_version, transformers_version, imported = json.loads(proc.stdout)
    assert (torch_read, transformers_read) == (torch_version, transformers_version)
    assert imported == []
