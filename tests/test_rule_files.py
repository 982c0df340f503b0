"""What each .smk file may use. The workflow's helpers (the config and its constants, the jobs' params, the input
functions, the targets, the checks before the first job) are the files of workflow/rules/common/, all included by
workflow/rules/common.smk in the order they need, which the Snakefile includes before any rule file. A rule file
declares rules only: it defines no global of its own, every name it uses is Python's, Snakemake's or one that a
helper file defines (each in exactly one of them), and of the rules it names only its own (``rules.<name>``). So a
reader finds any name a rule uses in one place, and a new rule file needs nothing from another rule file. Names are
read from Snakemake's own translation of each file into Python."""

from __future__ import annotations

import ast
import builtins
import io
import re
from pathlib import Path
from types import SimpleNamespace

import snakemake.api  # noqa: F401  (snakemake.workflow can only be imported after it)
import snakemake.workflow
from snakemake.parser import parse
from snakemake.sourcecache import LocalSourceFile

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "workflow" / "rules"
COMMON = RULES / "common"
# Every global of a workflow file that no workflow file defines: Snakemake's module and what it adds when it runs one.
PROVIDED = (set(dir(builtins)) | set(vars(snakemake.workflow))
            | {"workflow", "config", "rules", "checkpoints", "scatter", "gather", "storage", "access", "shell",
               "logger", "github", "gitlab", "gitfile", "from_queue"})
INCLUDE = re.compile(r'^include:\s*"([^"]+)"', re.M)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
          ast.GeneratorExp)


def translated(text: str) -> ast.Module:
    """The Python that Snakemake makes of a .smk file's text."""
    source = SimpleNamespace(open=lambda path, mode="r": io.StringIO(text))
    code, _ = parse(LocalSourceFile("file.smk"), SimpleNamespace(sourcecache=source), {})
    return ast.parse(code)


def globals_of(node: ast.AST) -> set[str]:
    """The globals a statement binds (not those of the functions, classes and comprehensions in it); Snakemake's
    own (a rule's run function, a hook) start with two underscores."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return set() if node.name.startswith("__") else {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return {node.id}
    if isinstance(node, SCOPES):
        return set()
    return set().union(*map(globals_of, ast.iter_child_nodes(node)))


def defined(tree: ast.Module) -> set[str]:
    return set().union(*map(globals_of, tree.body))


def used(tree: ast.AST) -> set[str]:
    """Names a file reads and binds nowhere itself (an argument, a local, a comprehension's variable)."""
    read, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return read - bound - defined(tree)


def read_at_parse(tree: ast.Module) -> set[str]:
    """Names a file reads while Snakemake parses it: outside function bodies (decorators and defaults included)."""
    read = set()

    def visit(node):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            read.add(node.id)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            children = [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]
        elif isinstance(node, ast.Lambda):
            children = [*node.args.defaults, *node.args.kw_defaults]
        else:
            children = ast.iter_child_nodes(node)
        for child in children:
            if child is not None:
                visit(child)

    for statement in tree.body:
        visit(statement)
    return read - used_locally(tree)


def used_locally(tree: ast.Module) -> set[str]:
    """Comprehension variables and lambda arguments: bound where they are read."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.comprehension):
            names |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def named_rules(tree: ast.AST) -> set[str]:
    """The rules a file names through ``rules.<name>`` or ``checkpoints.<name>``."""
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id in ("rules", "checkpoints")}


def audit(helpers: dict[str, str], rule_files: dict[str, str]) -> list[str]:
    """Breaches of the rule above: ``helpers`` the files of common/ in common.smk's order, ``rule_files`` the
    others (name -> text)."""
    problems, owners, earlier = [], {}, set()
    for name, text in helpers.items():
        tree = translated(text)
        own = defined(tree)
        for symbol in sorted(read_at_parse(tree) - PROVIDED - earlier - own):
            problems.append(f"{name} reads {symbol} while parsed, before a helper file defines it")
        earlier |= own
        for symbol in own:
            owners.setdefault(symbol, []).append(name)
    problems += [f"{symbol} is defined in {sorted(where)}" for symbol, where in owners.items()
                 if len(where) > 1 and not symbol.startswith("_")]
    public = {symbol for symbol in owners if not symbol.startswith("_")}
    for name, text in helpers.items():
        for symbol in sorted(used(translated(text)) - PROVIDED - set(owners)):
            problems.append(f"{name} uses {symbol}, which no helper file defines")
    trees = {name: translated(text) for name, text in rule_files.items()}
    rule_globals = {name: defined(tree) for name, tree in trees.items()}
    for name, tree in trees.items():
        own_rules = set(re.findall(r"^(?:rule|checkpoint) (\w+):", rule_files[name], re.M))
        if not own_rules:
            problems.append(f"{name} has no rule: a file of helpers belongs in workflow/rules/common/")
        if rule_globals[name]:
            problems.append(f"{name} defines globals {sorted(rule_globals[name])}: move them to workflow/rules/common/")
        for symbol in sorted(used(tree) - PROVIDED - public):
            where = [other for other, names in rule_globals.items() if symbol in names and other != name]
            problems.append(f"{name} uses {symbol} of the rule file {where[0]}" if where
                            else f"{name} uses {symbol}, which no file of workflow/rules/common/ defines")
        for rule in sorted(named_rules(tree) - own_rules):
            problems.append(f"{name} names rules.{rule}, a rule of another file")
    return problems


def include_problems(snakefile: str, common_smk: str, helpers: list[str], rule_files: list[str]) -> list[str]:
    """How the includes break the rule above: common.smk includes each helper file once and nothing else, and
    defines nothing itself; the Snakefile includes common.smk first, then each rule file once, no helper file."""
    problems = []
    listed = INCLUDE.findall(common_smk)
    for name in helpers:
        if listed.count(f"common/{name}") != 1:
            problems.append(f"common.smk includes common/{name} {listed.count(f'common/{name}')} times, not once")
    problems += [f"common.smk includes {path}, no file of workflow/rules/common/" for path in listed
                 if path.removeprefix("common/") not in helpers or not path.startswith("common/")]
    if defined(translated(common_smk)):
        problems.append(f"common.smk defines {sorted(defined(translated(common_smk)))}: helpers go to common/")
    top = INCLUDE.findall(snakefile)
    if top[:1] != ["workflow/rules/common.smk"] or top.count("workflow/rules/common.smk") != 1:
        problems.append("the Snakefile must include workflow/rules/common.smk once, before anything else")
    problems += [f"the Snakefile includes the helper file {path}: common.smk includes it" for path in top
                 if path.startswith("workflow/rules/common/")]
    for name in rule_files:
        if top.count(f"workflow/rules/{name}") != 1:
            problems.append(f"the Snakefile includes workflow/rules/{name} {top.count(f'workflow/rules/{name}')} "
                            "times, not once")
    return problems


def workflow_files() -> tuple[dict[str, str], dict[str, str]]:
    """({helper file: text} in common.smk's order, {rule file: text}); a helper left out of common.smk last."""
    order = [path.removeprefix("common/") for path in INCLUDE.findall((RULES / "common.smk").read_text())]
    names = sorted((p.name for p in COMMON.glob("*.smk")), key=lambda n: order.index(n) if n in order else len(order))
    helpers = {name: (COMMON / name).read_text() for name in names}
    rule_files = {p.name: p.read_text() for p in sorted(RULES.glob("*.smk")) if p.name != "common.smk"}
    return helpers, rule_files


def test_rule_files_use_only_the_helper_files():
    helpers, rule_files = workflow_files()
    assert {"config.smk", "settings.smk", "inputs.smk", "targets.smk"} <= set(helpers)
    assert "engine.smk" in rule_files and "select.smk" in rule_files
    assert audit(helpers, rule_files) == []


def test_common_smk_includes_every_helper_file_and_the_snakefile_only_common_smk_and_rule_files():
    helpers, rule_files = workflow_files()
    assert include_problems((REPO / "Snakefile").read_text(), (RULES / "common.smk").read_text(), list(helpers),
                            list(rule_files)) == []


def test_the_audit_catches_a_rule_file_with_its_own_global():
    helpers = {"config.smk": "RUN = 'x'\n"}
    rule_files = {"a.smk": "rule a:\n    output: RUN\nPARTS = 3\n", "b.smk": "rule b:\n    input: PARTS\n",
                  "c.smk": "rule c:\n    input: rules.a.output, LATER\n"}
    problems = audit(helpers, rule_files)
    assert "a.smk defines globals ['PARTS']: move them to workflow/rules/common/" in problems
    assert "b.smk uses PARTS of the rule file a.smk" in problems
    assert "c.smk names rules.a, a rule of another file" in problems
    assert "c.smk uses LATER, which no file of workflow/rules/common/ defines" in problems
    assert audit(helpers, {"a.smk": "rule a:\n    output: RUN\n"}) == []


def test_the_audit_catches_helper_files_in_the_wrong_order():
    helpers = {"targets.smk": "ALL = [RESULTS]\n\ndef late():\n    return RESULTS\n", "config.smk": "RESULTS = 'r'\n"}
    assert audit(helpers, {}) == ["targets.smk reads RESULTS while parsed, before a helper file defines it"]
    assert audit(dict(reversed(helpers.items())), {}) == []


def test_the_includes_catch_a_helper_file_left_out_of_common_smk():
    snakefile = 'include: "workflow/rules/common.smk"\ninclude: "workflow/rules/a.smk"\n'
    common = 'include: "common/config.smk"\n'
    assert include_problems(snakefile, common, ["config.smk"], ["a.smk"]) == []
    assert include_problems(snakefile, common, ["config.smk", "inputs.smk"], ["a.smk"]) == [
        "common.smk includes common/inputs.smk 0 times, not once"]
    late = ('include: "workflow/rules/a.smk"\ninclude: "workflow/rules/common.smk"\n'
            'include: "workflow/rules/common/x.smk"\n')
    assert include_problems(late, common, ["config.smk"], ["a.smk"]) == [
        "the Snakefile must include workflow/rules/common.smk once, before anything else",
        "the Snakefile includes the helper file workflow/rules/common/x.smk: common.smk includes it"]
