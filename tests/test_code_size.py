"""The code reads in pieces: no module over 450 lines, no function (or method) over 80, in src/stagereplay and in
the scripts beside it (bench/*.py, scripts/*.py, workflow/scripts/*.py).

A module that grows past the limit is split along what it owns; a function, into one function per phase.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "stagereplay"
SCRIPT_FOLDERS = ("bench", "scripts", "workflow/scripts")  # their own *.py files (not the folders below them)
MODULE_LINES = 450
FUNCTION_LINES = 80
ALLOWED: set[str] = set()  # modules of the package let off the limits (paths relative to the package): none


def oversized(root: Path = PACKAGE, allowed=frozenset(ALLOWED), pattern: str = "**/*.py") -> list[str]:
    """Each module of ``root`` matching ``pattern`` (default: every one, at any depth) over :data:`MODULE_LINES`
    lines and each function over :data:`FUNCTION_LINES`, as ``path: what (lines)``, except the modules in
    ``allowed`` (paths relative to ``root``)."""
    found = []
    for path in sorted(root.glob(pattern)):
        name = path.relative_to(root).as_posix()
        if name in allowed:
            continue
        text = path.read_text()
        if (lines := len(text.splitlines())) > MODULE_LINES:
            found.append(f"{name}: module ({lines} lines)")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # decorators aside
                if length > FUNCTION_LINES:
                    found.append(f"{name}: {node.name} at line {node.lineno} ({length} lines)")
    return found


def test_no_module_or_function_of_the_package_is_over_its_limit():
    offenders = oversized()
    assert not offenders, "over the size limits (module 450 lines, function 80):\n" + "\n".join(offenders)


@pytest.mark.parametrize("folder", SCRIPT_FOLDERS)
def test_no_script_beside_the_package_is_over_its_limit(folder):
    assert sorted((REPO / folder).glob("*.py")), f"no scripts in {folder}: a folder moved away is checked no more"
    offenders = [f"{folder}/{line}" for line in oversized(REPO / folder, frozenset(), "*.py")]
    assert not offenders, "over the size limits (module 450 lines, function 80):\n" + "\n".join(offenders)


def test_the_size_check_finds_a_long_module_and_a_long_function(tmp_path):
    body = "\n".join(f"    x = {i}" for i in range(FUNCTION_LINES))
    (tmp_path / "long_function.py").write_text(f"def long():\n{body}\n")
    (tmp_path / "long_module.py").write_text("\n".join(f"X{i} = {i}" for i in range(MODULE_LINES + 1)) + "\n")
    (tmp_path / "allowed.py").write_text("\n".join(f"X{i} = {i}" for i in range(MODULE_LINES + 1)) + "\n")
    (tmp_path / "short.py").write_text(f"def short():\n{body[:body.rindex(chr(10))]}\n")
    assert oversized(tmp_path, {"allowed.py"}) == [
        f"long_function.py: long at line 1 ({FUNCTION_LINES + 1} lines)",
        f"long_module.py: module ({MODULE_LINES + 1} lines)"]


def test_the_scripts_pattern_checks_a_folder_s_own_modules_only(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "long_module.py").write_text("\n".join(f"X{i} = {i}" for i in range(MODULE_LINES + 1)))
    assert oversized(tmp_path, frozenset()) == [f"runs/long_module.py: module ({MODULE_LINES + 1} lines)"]
    assert oversized(tmp_path, frozenset(), "*.py") == []


def test_every_allowance_names_a_module_that_exists():
    assert all((PACKAGE / name).is_file() for name in ALLOWED)  # none today; one named here must exist
