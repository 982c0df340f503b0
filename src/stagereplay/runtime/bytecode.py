"""Whether this host's Python recompiles a package's source in every process: it writes no bytecode
(``PYTHONDONTWRITEBYTECODE``, ``-B``) and the package was installed without any. Every job process then compiles
the package again as it imports it (torch: about 2 of the 4 seconds its import took on one such host).

Reads the package's location only (:func:`importlib.util.find_spec` of a top-level name does not import it)."""

from __future__ import annotations

import importlib.util
import os
import sys


def uncompiled_note(package: str = "torch", dont_write: bool | None = None) -> str | None:
    """A one-line note for the run's log when ``package`` is compiled again in every process, else None.

    ``dont_write``: whether Python writes no bytecode (``sys.dont_write_bytecode``, set by ``-B`` and
    ``PYTHONDONTWRITEBYTECODE``, when None)."""
    if not (sys.dont_write_bytecode if dont_write is None else dont_write):
        return None
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    compiled = importlib.util.cache_from_source(spec.origin)
    if os.path.exists(compiled):
        return None
    folder = os.path.dirname(spec.origin)
    return (f"Python writes no bytecode here (PYTHONDONTWRITEBYTECODE or -B) and {package} has none ({compiled} is "
            f"missing): every job process compiles {package} again as it imports it, seconds each. Compile it once "
            f"(python -m compileall -q {folder}), or unset PYTHONDONTWRITEBYTECODE (docs/SPEED.md)")
