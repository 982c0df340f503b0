"""The package reads in pieces: no module of src/stagereplay over 450 lines, no function (or method) over 80.

A module that grows past the limit is split along what it owns; a function, into one function per phase.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "stagereplay"
MODULE_LINES = 450
FUNCTION_LINES = 80
ALLOWED: set[str] = set()  # modules let off the limits (paths relative to the package): none


def oversized(root: Path = PACKAGE, allowed=frozenset(ALLOWED)) -> list[str]:
    """Each module over :data:`MODULE_LINES` lines and each function over :data:`FUNCTION_LINES`, as
    ``path: what (lines)``, except the modules in ``allowed`` (paths relative to ``root``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
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


def test_the_size_check_finds_a_long_module_and_a_long_function(tmp_path):
    body = "\n".join(f"    x = {i}" for i in range(FUNCTION_LINES))
    (tmp_path / "long_function.py").write_text(f"def long():\n{body}\n")
    (tmp_path / "long_module.py").write_text("\n".join(f"X{i} = {i}" for i in range(MODULE_LINES + 1)) + "\n")
    (tmp_path / "allowed.py").write_text("\n".join(f"X{i} = {i}" for i in range(MODULE_LINES + 1)) + "\n")
    (tmp_path / "short.py").write_text(f"def short():\n{body[:body.rindex(chr(10))]}\n")
    assert oversized(tmp_path, {"allowed.py"}) == [
        f"long_function.py: long at line 1 ({FUNCTION_LINES + 1} lines)",
        f"long_module.py: module ({MODULE_LINES + 1} lines)"]


def test_every_allowance_names_a_module_that_exists():
    assert all((PACKAGE / name).is_file() for name in ALLOWED)  # none today; one named here must exist
