"""The stages' settings spell each config key once, beside the schema: every field names its config key (its default
the schema's) or is the job's own, and the workflow's params are built from those fields."""

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from stagereplay.config import schema, schema_default, schema_node
from stagereplay.stages import settings as settings_module
from stagereplay.stages.settings import ControlSettings, PrepareSettings, TransplantSettings, config_kwargs

REPO = Path(__file__).resolve().parents[1]
CLASSES = [c for _, c in inspect.getmembers(settings_module, inspect.isclass)
           if dataclasses.is_dataclass(c) and c.__module__ == settings_module.__name__]


def test_there_are_the_stages_settings():
    assert len(CLASSES) >= 12 and PrepareSettings in CLASSES


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_is_a_schema_key_or_the_jobs_own(cls):
    for f in dataclasses.fields(cls):
        assert ("config" in f.metadata) != ("job" in f.metadata), (
            f"{cls.__name__}.{f.name}: declare it with config_field('<schema key>') or job_field()")
        if "config" in f.metadata:
            schema_node(f.metadata["config"])  # raises naming a key the schema lacks


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_config_fields_default_is_the_schemas(cls):
    for f in dataclasses.fields(cls):
        if "config" not in f.metadata:
            continue
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            continue  # required: the workflow gives a value it derives from the key (the model's resolved path)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        expected = schema_default(f.metadata["config"])
        assert default == (tuple(expected) if isinstance(expected, list) else expected), f"{cls.__name__}.{f.name}"


def test_no_config_field_spells_a_default_of_its_own():
    """A default written beside config_field (``threads: int = 1``, or ``config_field(..., default=1)``) would be a
    second spelling of the schema's."""
    tree = ast.parse(Path(settings_module.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "config_field":
            assert len(node.args) == 1 and {k.arg for k in node.keywords} <= {"required", "param", "only_with"}
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and item.value is not None and isinstance(item.value, ast.Call):
                    assert getattr(item.value.func, "id", None) in ("config_field", "job_field"), (
                        f"{node.name}.{item.target.id}")
                elif isinstance(item, ast.AnnAssign):
                    pytest.fail(f"{node.name}.{item.target.id}: a plain default; use config_field or job_field")


def test_a_job_field_is_no_schema_key_by_another_spelling():
    """A job field whose name is a top-level config key is a different thing, said so here (a revision's precisions
    to prepare, figure 4's fixed pair), not a copy of the key."""
    top_level = set(schema()["properties"])
    clashing = sorted({f"{c.__name__}.{f.name}" for c in CLASSES for f in dataclasses.fields(c)
                       if "job" in f.metadata and f.name in top_level})
    assert clashing == ["PrepareSettings.precisions"]


def test_params_come_from_the_config_by_the_fields_keys():
    config = {"threads": 3, "device": "cpu", "attn_implementation": "eager", "trust_remote_code": False,
              "allow_pickle": False, "offline": True, "model_store": "/store", "max_new_tokens": 7, "shards": 2,
              "chunk_size": 4, "transplant": {"sweeps": ["all"], "constructions": ["live", "prefill"]}}
    kwargs = config_kwargs(TransplantSettings, config, model="m", revision="r", precision="bf16", shard=1)
    assert kwargs == {"model": "m", "revision": "r", "precision": "bf16", "shard": 1, "threads": 3, "device": "cpu",
                      "attn_implementation": "eager", "trust_remote_code": False, "allow_pickle": False,
                      "offline": True, "max_new_tokens": 7, "n_shards": 2, "sweeps": ["all"],
                      "constructions": ["live", "prefill"], "pack": True}  # the schema's default; no model_store
    # (no param), no chunk_size (no chunked)
    config["transplant"]["constructions"] = ["live", "chunked"]
    assert config_kwargs(TransplantSettings, config, model="m", revision="r", precision="bf16")["chunk_size"] == 4
    prepare = config_kwargs(PrepareSettings, config, omit=("device", "attn_implementation"), model="m",
                            revision="r", precisions=["bf16"])
    assert "device" not in prepare and prepare["threads"] == 3
    with pytest.raises(TypeError, match="does not take"):
        config_kwargs(ControlSettings, config, precisoin="bf16")


def test_the_workflow_reads_no_settings_key_by_hand():
    """settings.smk builds every params.kwargs from the fields: the config keys it reads itself are those whose value
    it derives (the model's path resolved, the cache differences' prefix precision, the revision's precisions)."""
    read = set(re.findall(r'config\["(\w+)"\]', (REPO / "workflow/rules/common/settings.smk").read_text()))
    assert read <= {"model", "cache_differences", "precisions"}, read
