"""The config schema refuses bad keys and values before any work, naming the key."""

import copy
from pathlib import Path

import pytest
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

REPO = Path(__file__).resolve().parents[1]
SCHEMA = str(REPO / "workflow/schemas/config.schema.yaml")


def default_config():
    return yaml.safe_load((REPO / "config.yaml").read_text())


def test_default_config_is_valid_and_gets_defaults():
    cfg = default_config()
    validate(cfg, SCHEMA, set_default=True)
    assert cfg["offline"] is True and cfg["trust_remote_code"] is False and cfg["allow_pickle"] is False
    assert cfg["job_server"] is True  # the schema's default: every config's jobs start warm unless it says otherwise


@pytest.mark.parametrize("change,key", [
    ({"n_itmes": 5}, "n_itmes"),
    ({"n_items": 0}, "n_items"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"precisions": ["bf16", "int8"]}, "int8"),
    ({"run": "../escape"}, "../escape"),
    ({"run": "/abs"}, "/abs"),
    ({"revisions": ["../../etc"]}, "../../etc"),
    ({"device": "tpu"}, "tpu"),
    ({"dataset": {"source": "synthetic", "sise": 3}}, "sise"),
    ({"boundary": {"marker": ";", "occurrence": 0}}, "occurrence"),
    ({"attn_implementation": "fast"}, "fast"),
    ({"shards": "two"}, "two"),
])
def test_bad_values_fail_naming_the_key(change, key):
    cfg = copy.deepcopy(default_config())
    cfg.update(change)
    with pytest.raises(WorkflowError) as err:
        validate(cfg, SCHEMA, set_default=True)
    assert key in str(err.value)


def test_every_schema_key_is_described_with_a_default():
    schema = yaml.safe_load(Path(SCHEMA).read_text())

    def walk(props, where):
        for name, spec in props.items():
            assert spec.get("description"), f"{where}{name} has no description"
            if name not in schema.get("required", []) or where:
                assert "default" in spec or name in ("path", "fields"), f"{where}{name} has no default"
            if "properties" in spec:
                walk(spec["properties"], f"{where}{name}.")

    walk(schema["properties"], "")
