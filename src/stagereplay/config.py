"""The workflow's config before schema validation: the values a user gave, typed, and the checks that need them.

Two things the schema cannot do by itself. Snakemake reads a nested ``--config`` value (``bridge={n_rows: 2}``)
with YAML's base loader, which leaves every scalar inside it a string; :func:`typed_command_line_values` types those
strings by the schema before validation. And validation with defaults fills in every key a config leaves out, after
which a key the user set cannot be told from its default; :func:`check_boundary` runs on the values the user gave.

The schema itself (:func:`schema`, :func:`schema_default`) is read from the checkout this package sits in, as the
workflow reads it: its defaults are the only spelling of a setting's default (stagereplay.stages.settings).

Knows nothing of Snakemake's objects: the workflow passes plain dicts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

import yaml

from stagereplay import catalogue

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow/schemas/config.schema.yaml"


@functools.cache
def schema() -> dict:
    """The workflow's config schema, parsed once per process (the C loader where PyYAML has it: a few ms), with the
    catalogue's names filled in as the enums of the keys :data:`catalogue.SCHEMA_ENUMS` names (the YAML leaves
    those open: a new construction or engine is a catalogue entry, not also a schema edit)."""
    try:
        text = SCHEMA_PATH.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the workflow's config schema {SCHEMA_PATH} is not there: the workflow's stages read their defaults from "
            "it, beside the package in a checkout of this repository; install from a checkout (pip install -e .), "
            "or use the library (stagereplay.replay, stagereplay.transplant), which needs no workflow") from None
    return with_catalogue_enums(yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))


def with_catalogue_enums(parsed: dict) -> dict:
    """``parsed`` (a parsed schema) with each key of :data:`catalogue.SCHEMA_ENUMS` limited to the catalogue's names
    (its items' enum where it is an array), refusing a key the schema lacks or one whose enum is written out."""
    for key, names in catalogue.schema_enums().items():
        node = parsed
        for part in key.split("."):
            if part not in node.get("properties", {}):
                raise KeyError(f"catalogue.SCHEMA_ENUMS names {key!r}, which the config schema lacks")
            node = node["properties"][part]
        node = node["items"] if node.get("type") == "array" else node
        if "enum" in node:
            raise ValueError(f"the config schema writes out the enum of {key!r}: leave it to the catalogue")
        node["enum"] = list(names)
    return parsed


def schema_file() -> str:
    """A file of :func:`schema` (JSON, which YAML reads), for Snakemake's ``validate``: in the temporary folder,
    named by its content, written once."""
    text = json.dumps(schema(), sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"stagereplay-config-schema-{digest}.json"
    if not path.exists() or path.read_text() != text:
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_text(text)
        partial.replace(path)  # whole or absent, for runs side by side
    return str(path)


def schema_node(key: str) -> dict:
    """The schema's node of a dotted config key (``transplant.minimal.budget``), refusing an unknown key by name."""
    node = schema()
    for part in key.split("."):
        properties = node.get("properties", {})
        if part not in properties:
            raise KeyError(f"config key {key!r}: the schema ({SCHEMA_PATH.name}) has no {part!r} there")
        node = properties[part]
    return node


def schema_default(key: str):
    """The schema's default of a dotted config key, which ``validate(config, schema, set_default=True)`` fills in."""
    node = schema_node(key)
    if "default" not in node:
        raise KeyError(f"config key {key!r} has no default in the schema")
    return node["default"]

# The spellings YAML reads as null; a string of one of them, where the schema allows null, means null.
_NULLS = ("null", "Null", "NULL", "~")
_PYTHON_TYPES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _alternatives(schema: dict) -> list[dict]:
    """A schema node and the alternatives of its ``oneOf``/``anyOf``."""
    return [schema, *schema.get("oneOf", []), *schema.get("anyOf", [])]


def _types(schema: dict) -> set[str]:
    types = set()
    for alternative in _alternatives(schema):
        declared = alternative.get("type", [])
        types.update([declared] if isinstance(declared, str) else declared)
    return types


def _subschema(schema: dict, kind: str) -> dict:
    """The alternative of ``schema`` that describes an ``object`` or an ``array``."""
    for alternative in _alternatives(schema):
        declared = alternative.get("type", [])
        if kind in ([declared] if isinstance(declared, str) else declared):
            return alternative
    return {}


def typed_command_line_values(values, schema: dict):
    """``values`` (from ``snakemake --config``) with each string typed as the schema's node for it expects.

    A string stays a string where the schema allows one (an item id ``'12'`` in ``transplant.select`` stays
    ``'12'``), except a YAML null spelling where null is allowed too. Elsewhere it is read as YAML and kept if it
    then has a type the schema allows: ``'2'`` becomes 2 for an integer, ``'true'`` True for a boolean. Anything
    else is left as it is, for the schema to refuse by name.
    """
    if isinstance(values, dict):
        properties = _subschema(schema, "object").get("properties", {})
        return {key: typed_command_line_values(value, properties.get(key, {})) for key, value in values.items()}
    if isinstance(values, list):
        items = _subschema(schema, "array").get("items", {})
        return [typed_command_line_values(value, items) for value in values]
    if not isinstance(values, str):
        return values
    types = _types(schema)
    if "null" in types and values in _NULLS:
        return None
    if not types or "string" in types:
        return values
    try:
        parsed = yaml.safe_load(values)
    except yaml.YAMLError:
        return values
    return parsed if any(_PYTHON_TYPES[t](parsed) for t in types if t in _PYTHON_TYPES) else values


def check_boundary(boundary: dict | None) -> None:
    """Refuse a boundary given both as a marker string and as a token id, of which only one could apply.

    ``boundary`` is the block as the user gave it (config files and ``--config``), before defaults are filled in.
    """
    boundary = boundary or {}
    if boundary.get("marker") is not None and boundary.get("token_id") is not None:
        raise ValueError(
            f"boundary.marker {boundary['marker']!r} and boundary.token_id {boundary['token_id']} are both set, "
            "but the boundary is one or the other (the token id would win and the marker be ignored): remove one "
            "of them (or set it to null)"
        )


def canonical(value):
    """``value`` with every mapping in it rebuilt in sorted key order (lists keep theirs): Snakemake compares a
    job's params by their ``repr``, so the same config with the keys of ``dataset:`` in another order would rerun
    every job that has it."""
    if isinstance(value, dict):
        return {key: canonical(value[key]) for key in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return type(value)(canonical(v) for v in value)
    return value


def check_boundary_set(boundary: dict) -> None:
    """Refuse a boundary with neither a marker nor a token id (``boundary: {marker: null}``), which no generated text
    could reach: the run would generate, then fail after its jobs had deleted their old outputs.

    ``boundary`` is the validated block, defaults filled in."""
    if boundary.get("marker") is None and boundary.get("token_id") is None:
        raise ValueError(
            "boundary.marker is null and no boundary.token_id is given, so the stage boundary could never be found: "
            "give a marker string (the default is '</think>') or a token_id"
        )


# The constructions the matched experiment builds at every revision it generates (stagereplay.experiments.matched).
MATCHED_CONSTRUCTIONS = ("live", "prefill")


def check_transplant_pair(pair, fixed_prefix_constructions) -> None:
    """Refuse a transplant pair at the primary revision that the experiments do not build there.

    The primary revision's transplant baseline is its ledger: the matched experiment's ``live`` and ``prefill`` and
    the fixed-prefix experiment's ``fixed_prefix.constructions``. (Another revision replays the pair itself.)
    """
    ran = [*MATCHED_CONSTRUCTIONS, *(c for c in fixed_prefix_constructions if c not in MATCHED_CONSTRUCTIONS)]
    missing = [c for c in pair if c not in ran]
    if missing:
        raise ValueError(
            f"transplant.constructions {list(pair)}: {missing} not built at the primary revision, whose transplant "
            f"baseline is its ledger ({ran}: the matched experiment's live and prefill and fixed_prefix.constructions "
            f"{list(fixed_prefix_constructions)}); add {missing} to fixed_prefix.constructions, or transplant a pair "
            "of those"
        )
