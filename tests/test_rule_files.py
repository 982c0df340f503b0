"""What each .smk file may use. The workflow's helpers (settings, input functions, targets, checks) live in the helper
files below; a rule file declares rules only: it defines no global of its own, and every helper name it uses is
defined in exactly one helper file. So a reader finds any name a rule uses in one place, and a new rule file needs
nothing from another rule file."""

from __future__ import annotations

import re
from pathlib import Path

RULES = Path(__file__).resolve().parents[1] / "workflow" / "rules"
HELPERS = ("config.smk", "settings.smk", "inputs.smk", "targets.smk", "engine_inputs.smk", "integrity.smk",
           "preflight.smk")
NAME = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\b")


def defined(text: str) -> set[str]:
    """Top-level names a .smk file defines: assignments and functions at column 0."""
    return (set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\s*=", text, re.M))
            | set(re.findall(r"^def ([A-Za-z_][A-Za-z0-9_]*)", text, re.M)))


def audit(files: dict[str, str]) -> list[str]:
    """Breaches of the rule above in ``files`` (name -> text)."""
    owners: dict[str, list[str]] = {}
    for name, text in files.items():
        for symbol in defined(text):
            owners.setdefault(symbol, []).append(name)
    problems = [f"{symbol} is defined in {sorted(where)}" for symbol, where in owners.items() if len(where) > 1]
    for name, text in files.items():
        if name in HELPERS:
            continue
        if not re.search(r"^rule ", text, re.M):
            problems.append(f"{name} has no rule: a file of helpers belongs among HELPERS")
        own = defined(text)
        if own:
            problems.append(f"{name} defines globals {sorted(own)}: move them to a helper file")
        for symbol in set(NAME.findall(text)):
            for owner in owners.get(symbol, []):
                if owner not in HELPERS and owner != name:
                    problems.append(f"{name} uses {symbol} of the rule file {owner}")
    return problems


def test_rule_files_use_only_the_helper_files():
    files = {p.name: p.read_text() for p in sorted(RULES.glob("*.smk"))}
    assert set(HELPERS) <= set(files), "a helper file named here is missing"
    assert audit(files) == []


def test_the_audit_catches_a_rule_file_with_its_own_global():
    files = {"config.smk": "RUN = 'x'\n", "a.smk": "rule a:\n    output: RUN\nPARTS = 3\n",
             "b.smk": "rule b:\n    input: PARTS\n"}
    problems = audit(files)
    assert "a.smk defines globals ['PARTS']: move them to a helper file" in problems
    assert "b.smk uses PARTS of the rule file a.smk" in problems
