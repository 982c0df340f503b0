"""The package's layers: a module imports only from its own layer or the layers below, and no modules import each
other in a loop.

The layers, from the ground up: the catalogue (the extension points, declared by name), data, io, config, runtime
(process infrastructure) and testing (the test and bench GGUF writer) at 1; models and analysis at 2; decode at 3;
experiments and engines (replay on llama.cpp and other serving engines) at 4; stages and projection (the workflow's priced DAG) and api (the library's functions) at 5;
the package itself (``stagereplay/__init__``, which hands out the API) at 6 (the workflow's rules and the
benchmarks sit above the package). Every
import counts, at any depth of the code (an import inside a function, or under ``if TYPE_CHECKING:``), read from the
source with :mod:`ast`: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "stagereplay"
SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = {"version": 1, "catalogue": 1, "data": 1, "io": 1, "config": 1, "runtime": 1, "testing": 1, "models": 2, "analysis": 2,
          "decode": 3, "experiments": 4, "engines": 4, "stages": 5, "projection": 5, "api": 5}
ROOT_LAYER = 6  # stagereplay/__init__.py: the public face (the library API, imported lazily) over everything


def modules(src: Path) -> dict[str, Path]:
    """{dotted name: file} of every module of the package under ``src`` (a package by its ``__init__``)."""
    found = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(module of the package, line) for every import in ``path``, module ``name``: ``from a import b`` is module
    ``a.b`` where that is one, else ``a``; relative imports are resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.append((child if child in known else base, node.lineno))
    return [(module, line) for module, line in found if module == PACKAGE or module.startswith(PACKAGE + ".")]


def layer_of(module: str) -> tuple[str, int]:
    """(part, layer) of a module: the package's top-level part it belongs to."""
    parts = module.split(".")
    if len(parts) == 1:
        return PACKAGE, ROOT_LAYER
    return parts[1], LAYERS.get(parts[1], 0)


def graph(src: Path) -> dict[str, dict[str, int]]:
    """{module: {module it imports: first line}}, the package's modules only."""
    known = modules(src)
    edges = {}
    for name, path in known.items():
        edges[name] = {}
        for module, line in imports(name, path, known):
            if module != name:
                edges[name].setdefault(module, line)
    return edges


def upward_imports(src: Path) -> list[str]:
    """One line per import from a lower layer to a higher one."""
    known = modules(src)
    lines = []
    for name, targets in graph(src).items():
        part, layer = layer_of(name)
        for module, line in targets.items():
            other, other_layer = layer_of(module)
            if other_layer > layer:
                where = known[name].relative_to(src)
                lines.append(f"{where}:{line} ({part}, layer {layer}) imports {module} ({other}, layer {other_layer})")
    return lines


def cycles(src: Path) -> list[list[str]]:
    """The loops of imports: each strongly connected set of two modules or more (Tarjan's algorithm), sorted."""
    edges = graph(src)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, {}):
            if nxt not in edges:
                continue  # a name the package does not define: another test's business
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def test_every_part_of_the_package_has_a_layer():
    parts = {layer_of(name)[0] for name in modules(SRC)} - {PACKAGE}
    assert parts <= set(LAYERS), f"give {sorted(parts - set(LAYERS))} a layer in LAYERS"


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    upward = upward_imports(SRC)
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_modules_import_each_other_in_a_loop():
    loops = cycles(SRC)
    assert not loops, "modules that import each other in a loop:\n" + "\n".join(" <-> ".join(c) for c in loops)


def test_the_checks_see_an_upward_import_and_a_loop(tmp_path):
    """The control: a planted import of a stage from a model module is named, with its line, and so is a loop
    through an import inside a function and a relative one."""
    package = tmp_path / PACKAGE
    for folder in ("models", "stages"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text('__version__ = "0"\n')
    (package / "stages" / "jobs.py").write_text("from stagereplay.models.loading import load\n")
    (package / "models" / "loading.py").write_text(
        "import os\n\n\ndef load():\n    from stagereplay.stages import jobs\n    from . import store\n")
    (package / "models" / "store.py").write_text("from .loading import load\n")
    assert upward_imports(tmp_path) == [
        "stagereplay/models/loading.py:5 (models, layer 2) imports stagereplay.stages.jobs (stages, layer 5)"]
    assert cycles(tmp_path) == [["stagereplay.models.loading", "stagereplay.models.store", "stagereplay.stages.jobs"]]
