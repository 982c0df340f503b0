"""The catalogue (src/stagereplay/catalogue.py) is the one place that names constructions, figures, results files and
engines: the config schema offers exactly its names, every figure has its caption, plotter, caption file and target,
every results file its rule, and no construction context in src/ or workflow/ spells a name it does not hold."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import yaml

from stagereplay import catalogue, config
from stagereplay.analysis import captions, figures
from workflow_runner import REPO, snakemake, tiny_config

SCHEMA = REPO / "workflow/schemas/config.schema.yaml"


# ---- (a) the schema's enums are the catalogue's names -------------------------------------------------------------
def enum_of(schema: dict, key: str) -> list[str]:
    """The enum of a dotted config key's values (of its items where it is an array)."""
    node = schema
    for part in key.split("."):
        node = node["properties"][part]
    return list(node.get("items", node)["enum"])


def every_enum(node, where=()):
    """(dotted key, enum) of every enum in a schema node, array items under their array's key."""
    if isinstance(node, dict):
        if "enum" in node:
            yield ".".join(where), list(node["enum"])
        for name, child in node.get("properties", {}).items():
            yield from every_enum(child, (*where, name))
        if isinstance(node.get("items"), dict):
            yield from every_enum(node["items"], where)
        for alternative in node.get("oneOf", []) + node.get("anyOf", []):
            yield from every_enum(alternative, where)


def schema_mismatches(schema: dict) -> dict[str, tuple[list[str], list[str]]]:
    """{key: (the schema's enum, the catalogue's names)} where they differ."""
    found = {key: (enum_of(schema, key), names) for key, names in catalogue.schema_enums().items()}
    return {key: pair for key, pair in found.items() if pair[0] != pair[1]}


def test_the_schema_yaml_leaves_the_catalogues_enums_to_it_and_the_validated_schema_has_them():
    """The YAML spells no catalogue name in an enum; the schema the workflow validates with (config.schema_file)
    offers exactly the catalogue's names at each key of SCHEMA_ENUMS, and nowhere else."""
    written = yaml.safe_load(SCHEMA.read_text())
    names = known_names() | {e.name for e in catalogue.ENGINES}
    assert not {key for key, enum in every_enum(written) if set(enum) & names}, "an enum of catalogue names in YAML"
    validated = json.loads(Path(config.schema_file()).read_text())
    assert not schema_mismatches(validated)
    offering = {key for key, enum in every_enum(validated) if set(enum) & names}
    assert offering == set(catalogue.SCHEMA_ENUMS)
    written["properties"]["engines"]["items"]["enum"] = ["llama_cpp"]  # the control: one written out is refused
    with pytest.raises(ValueError, match="writes out the enum of 'engines'"):
        config.with_catalogue_enums(written)


# ---- (b) figures, results files, engines ---------------------------------------------------------------------------
def dotted(path: str):
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


@pytest.mark.parametrize("figure", catalogue.FIGURES, ids=lambda f: f.name)
def test_every_figure_has_its_caption_plotter_inputs_and_caption_file(figure):
    assert figure.title and figure.caption and captions.CAPTIONS[figure.name] == (figure.title, figure.caption)
    assert callable(dotted(figure.plotter)) and figures.PLOTTERS[figure.name] is dotted(figure.plotter)
    assert figure.inputs and set(figure.inputs) <= {r.name for r in catalogue.RESULT_FILES}
    rst = REPO / "workflow/report" / f"{figure.name}.rst"
    assert rst.is_file() and rst.read_text() == captions.rst_text(figure.name), (
        f"write {rst.relative_to(REPO)}: python -c \"from stagereplay.analysis.captions import rst_text; "
        f"print(rst_text('{figure.name}'), end='')\" > {rst.relative_to(REPO)}")


def test_every_figure_is_a_target_of_the_workflow(tmp_path):
    """A dry run of the tiny config plans every figure of the catalogue, as PDF and PNG, for `rule all`."""
    tiny_config(tmp_path)
    planned = snakemake(tmp_path, "--dry-run", "--no-hooks").stdout
    for name in catalogue.figure_names():
        for fmt in ("pdf", "png"):
            assert f"report/figures/{name}.{fmt}" in planned, (name, fmt)


def rule_outputs() -> dict[str, str]:
    """{rule: its output section's text} of every rule of workflow/rules."""
    found = {}
    for path in (REPO / "workflow/rules").glob("*.smk"):
        for match in re.finditer(r"^rule (\w+):\n((?:[ \t]+.*\n|\n)*)", path.read_text(), re.M):
            output = re.search(r"^    output:\n((?:        .*\n)*)", match.group(2), re.M)
            found[match.group(1)] = output.group(1) if output else ""
    return found


def test_every_results_file_is_written_by_its_rule():
    """An engine's files are written by the rules over the {engine} wildcard, at the engine's name."""
    outputs = rule_outputs()
    engine_of = {output: e.name for e in catalogue.ENGINES for output in e.outputs}
    for result in catalogue.RESULT_FILES:
        path = result.path.replace("{revision}", "{{revision}}")
        written = outputs.get(result.rule, "")
        if result.name in engine_of:
            written = written.replace("{{engine}}", engine_of[result.name])
        assert f"{{RESULTS}}/{path}" in written, (result.name, result.rule)


def test_every_engine_has_its_class_outputs_and_constructions():
    results = {r.name for r in catalogue.RESULT_FILES}
    for engine in catalogue.ENGINES:
        assert isinstance(dotted(engine.engine_class), type)
        assert set(engine.outputs) <= results
        assert {c.forwards_of for c in engine.constructions} <= set(catalogue.construction_names())
    assert len({f.name for f in catalogue.FIGURES}) == len(catalogue.FIGURES)
    assert len(set(catalogue.construction_names())) == len(catalogue.CONSTRUCTIONS)


# ---- (c) no construction context spells a name the catalogue does not hold ----------------------------------------
NAME_LIKE = re.compile(r"[a-z][a-z0-9_]*")
STOPS = {",", ";", "and", "or", "if", "else", "for", "lambda"}


def string_value(token) -> str | None:
    """A plain string literal's text (None for f-strings, bytes and implicit joins)."""
    match = re.fullmatch(r"[rRuU]?('|\")(.*)\1", token.string)
    return match.group(2) if match else None


def construction_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of every identifier-like string literal in a construction context: the value assigned to, given
    as keyword or default to, or compared with (``==``, ``!=``, ``in``, ``not in``) a name containing
    "construction" (``constructions=("live", "prefill")``, ``construction == "chunked"``), or compared with or keyed
    to a column so named (``row["construction"] == "live"``, ``{"construction": "live"}``). Dict keys, column
    subscripts and strings that themselves contain "construction" are left out; so is a ``for`` loop's name."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)]
    found, i = [], 0
    while i < len(tokens) - 1:
        token = tokens[i]
        if token.type == tokenize.NAME and "construction" in token.string.lower() and tokens[i - 1].string != "for":
            openers = {"=", "==", "!=", "in", "not"}
        elif token.type == tokenize.STRING and re.fullmatch(r"\w*constructions?", string_value(token) or ""):
            openers = {"==", "!=", "in", ":"}
        else:
            i += 1
            continue
        j = i + 1
        while tokens[j].string in ("]", ")"):
            j += 1
        if token.type == tokenize.NAME and tokens[j].string == ":":  # an annotation: the value follows its "="
            while tokens[j].type != tokenize.NEWLINE and tokens[j].string != "=":
                j += 1
        if tokens[j].string not in openers:
            i += 1
            continue
        depth, k = 0, j + 1
        while k < len(tokens):
            s = tokens[k]
            if s.type in (tokenize.NEWLINE, tokenize.ENDMARKER) or (depth == 0 and s.string in STOPS):
                break
            if s.type == tokenize.OP and s.string in "([{":
                depth += 1
            elif s.type == tokenize.OP and s.string in ")]}":
                depth -= 1
                if depth < 0:
                    break
            elif s.type == tokenize.STRING:
                value, before, after = string_value(s), tokens[k - 1], tokens[k + 1]
                subscript = before.string == "[" and after.string == "]" and (
                    tokens[k - 2].type in (tokenize.NAME, tokenize.STRING) or tokens[k - 2].string in (")", "]"))
                if (value is not None and NAME_LIKE.fullmatch(value) and "construction" not in value
                        and after.string not in (":", "in") and not subscript):
                    found.append((s.start[0], value))
            k += 1
        i = k
    return found


def scanned_files() -> list[Path]:
    """src/ and workflow/ (rules, scripts, the Snakefile), but the catalogue itself."""
    paths = [*REPO.glob("src/**/*.py"), *REPO.glob("workflow/**/*.py"), *REPO.glob("workflow/**/*.smk"),
             REPO / "Snakefile"]
    return sorted(p for p in paths if p != REPO / "src/stagereplay/catalogue.py")


def known_names() -> set[str]:
    return set(catalogue.construction_names()) | {c.name for e in catalogue.ENGINES for c in e.constructions}


def test_the_scan_finds_names_in_construction_contexts_and_nothing_else():
    """The control: a name the catalogue lacks is found in each kind of context, and no column or key is."""
    source = '''
def replay(constructions=("live", "paged")):
    pair: tuple[str, ...] = ("x",)
    FIXED_CONSTRUCTIONS = ("incremental", "paged_prefill")
    if row["construction"] == "radix" and construction not in ("chunked", "spec"):
        rows.append({"construction": "lookahead", "experiment": "matched"})
    for construction in sorted(frame["construction"].unique()):
        frame.loc[frame["precision"] == "bf16", "construction"]
    return {"construction": row["construction"], "status": "ok"}
'''
    assert construction_literals(source) == [(2, "live"), (2, "paged"), (4, "incremental"), (4, "paged_prefill"),
                                             (5, "radix"), (5, "chunked"), (5, "spec"), (6, "lookahead")]
    unknown = [value for _, value in construction_literals(source) if value not in known_names()]
    assert unknown == ["paged", "paged_prefill", "radix", "spec", "lookahead"]


def test_no_construction_context_spells_a_name_the_catalogue_lacks():
    names = known_names()
    unknown = [f"{path.relative_to(REPO)}:{line}: {value!r}" for path in scanned_files()
               for line, value in construction_literals(path.read_text()) if value not in names]
    assert not unknown, "construction names the catalogue does not hold:\n" + "\n".join(unknown)
    assert sum(len(construction_literals(p.read_text())) for p in scanned_files()) > 10  # the scan sees the code


# ---- (d) a new catalogue entry reaches the registry, the figures' styles and the schema's lists --------------------
ADD_DUMMY = """
import json, sys
from stagereplay import catalogue
dummy = catalogue.Construction("dummy", "a dummy", "every id in one forward", "prefill",
                               style={"color": "#000000", "marker": "x", "linestyle": "-"})
catalogue.CONSTRUCTIONS = (*catalogue.CONSTRUCTIONS, dummy)
from stagereplay.experiments import constructions
from stagereplay.analysis.fidelity_figures import CONSTRUCTION_STYLE
entry = constructions.get("dummy")
json.dump({"registry": list(constructions.REGISTRY), "label": entry.label,
           "segments": entry.cache_build().segments(7, 3), "style": CONSTRUCTION_STYLE["dummy"]["color"],
           "enums": catalogue.schema_enums()}, sys.stdout)
from stagereplay.config import schema
import jsonschema
chosen = {"constructions": ["incremental", "dummy"]}  # the block fixed_prefix
jsonschema.validate(chosen, schema()["properties"]["fixed_prefix"])  # the workflow's schema takes it: no YAML edit
"""


def test_a_new_catalogue_construction_reaches_the_registry_styles_and_schema_lists():
    """Declared in the catalogue alone (reusing a segment rule), a construction is in the registry (built when the
    module is imported: a fresh process), the fidelity figures' styles and the schema's enums, so a config that
    chooses it validates with no edit of the YAML; without the entry, the same config is refused."""
    proc = subprocess.run([sys.executable, "-c", ADD_DUMMY], capture_output=True, text=True, check=True)
    seen = json.loads(proc.stdout)
    assert seen["registry"] == [*catalogue.construction_names(), "dummy"]
    assert seen["label"] == "a dummy" and seen["segments"] == [10] and seen["style"] == "#000000"
    for key in ("fixed_prefix.constructions", "transplant.constructions", "fidelity.constructions"):
        assert seen["enums"][key][-1] == "dummy", key
    import jsonschema

    with pytest.raises(jsonschema.ValidationError, match="'dummy' is not one of"):
        jsonschema.validate({"constructions": ["incremental", "dummy"]}, config.schema()["properties"]["fixed_prefix"])
