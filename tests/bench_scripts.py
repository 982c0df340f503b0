"""The scripts under bench/ as modules, for the tests that check them (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """``bench/<name>.py``, loaded afresh as the module ``name``: with bench/ on ``sys.path``, as running
    ``python bench/<name>.py`` puts it (the scripts import one another by name), and registered in ``sys.modules``
    while it runs (dataclasses look their module up then)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
