"""The run's note for a host whose Python recompiles torch in every process (no bytecode written, none shipped)."""

import py_compile
import sys

from stagereplay.runtime.bytecode import uncompiled_note


def _package(tmp_path, monkeypatch, name):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return folder


def test_a_package_without_bytecode_under_dont_write_gets_the_note(tmp_path, monkeypatch):
    folder = _package(tmp_path, monkeypatch, "nobytecodepkg")
    note = uncompiled_note("nobytecodepkg", dont_write=True)
    assert note is not None
    assert "nobytecodepkg" in note and f"python -m compileall -q {folder}" in note
    assert "nobytecodepkg" not in sys.modules  # located, not imported


def test_no_note_once_compiled_or_where_python_writes_bytecode(tmp_path, monkeypatch):
    folder = _package(tmp_path, monkeypatch, "compiledpkg")
    assert uncompiled_note("compiledpkg", dont_write=False) is None
    assert uncompiled_note("compiledpkg", dont_write=True) is not None
    py_compile.compile(str(folder / "__init__.py"))
    assert uncompiled_note("compiledpkg", dont_write=True) is None


def test_no_note_for_a_missing_package():
    assert uncompiled_note("no_such_package_here_at_all", dont_write=True) is None


def test_the_preflight_logs_the_note():
    from pathlib import Path

    rules = (Path(__file__).resolve().parents[1] / "workflow/rules/common/preflight.smk").read_text()
    assert "uncompiled_note(\"torch\")" in rules and "logger.warning(note)" in rules
