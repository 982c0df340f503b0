# The config: typed, validated against workflow/schemas/config.schema.yaml with the catalogue's names as the enums
# SCHEMA_ENUMS names (its defaults filled in), checked across keys, and the constants the rules derive from it
# (folders, revisions, shards, the transplant's revisions and precision). Every other helper file and rule file
# reads these; none of them reads the config before this one.
import copy
import os
from pathlib import Path

from snakemake.utils import update_config, validate

import stagereplay
from stagereplay.config import (
    canonical,
    check_boundary,
    check_boundary_set,
    check_transplant_pair,
    schema,
    schema_file,
    typed_command_line_values,
)
from stagereplay.data.prompts import check_template
from stagereplay.models.sources import revision_slug
from stagereplay.stages.preflight import check_decode_settings, check_prefix_precision

# Snakemake leaves the scalars of a nested --config value strings (bridge={n_rows: 2}): typed by the schema first.
_command_line = typed_command_line_values(dict(workflow.config_settings.config), schema())
update_config(config, _command_line)
# The values the user gave (--configfile, --config): once defaults are filled in, a key set cannot be told apart.
_given = copy.deepcopy(dict(workflow.config_settings.overwrite_config))
update_config(_given, _command_line)
check_boundary(_given.get("boundary"))
validate(config, schema=schema_file(), set_default=True)  # the YAML with the catalogue's enums (stagereplay.config)
check_template(config["prompt"].get("template"))
# Params are compared by their repr: every mapping in sorted key order, whatever order the config files give.
for _key in list(config):
    config[_key] = canonical(config[_key])

RUN = config["run"]
RESULTS = f"results/{RUN}"
LOGS = f"logs/{RUN}"
BENCH = f"benchmarks/{RUN}"
REPO = Path(workflow.basedir)
# Results depend on the package as much as on the adapter scripts; its version in params reruns jobs on upgrade.
CODE_VERSION = stagereplay.__version__

REVISIONS = {revision_slug(r): r for r in config["revisions"]}
if len(REVISIONS) != len(config["revisions"]):
    raise ValueError(f"revisions: {config['revisions']} map to clashing folder names {sorted(REVISIONS)}; rename them")
SHARDS = list(range(config["shards"]))
check_decode_settings(
    config["batch_size"],
    config["decode_regime"],
    config["decode_attention"],
    config["decode_prefill_group"],
    config["decode_kernels"],
)
if config["boundary"].get("token_id") is not None:
    # The user gave no marker with it (check_boundary): the default's marker does not apply.
    config["boundary"]["marker"] = None
check_boundary_set(config["boundary"])
if config["reference_precision"] not in config["precisions"]:
    raise ValueError(
        f"reference_precision: {config['reference_precision']!r} is not one of precisions "
        f"{config['precisions']}; the fixed-prefix 2x2 takes its prefixes from that precision's generation"
    )
check_prefix_precision(config["cache_differences"].get("prefix_precision"), config["precisions"])

# Transplants run at each of transplant.revisions on the primary revision's prefix ids: the primary's constructions
# and continuations come from its ledger, any other revision's from its own replay_baseline.parquet.
PRIMARY = revision_slug(config["revisions"][0])
# .get: a transplant block given on the command line lacks the keys whose default is null.
TRANSPLANT_PRECISION = config["transplant"].get("precision") or config["precisions"][0]
if TRANSPLANT_PRECISION not in config["precisions"]:
    raise ValueError(
        f"transplant.precision: {TRANSPLANT_PRECISION!r} is not among precisions {config['precisions']}; "
        "the fixed prefixes exist only at those precisions"
    )
TRANSPLANT_REVISIONS = {revision_slug(r): r for r in (config["transplant"].get("revisions") or config["revisions"][:1])}
if PRIMARY in TRANSPLANT_REVISIONS:  # its transplant baseline is its ledger: the pair must be among what ran
    check_transplant_pair(config["transplant"]["constructions"], config["fixed_prefix"]["constructions"])
# Fidelity along the suffix runs at every generated revision, unless fidelity.constructions is empty.
FIDELITY_REVISIONS = dict(REVISIONS) if config["fidelity"]["constructions"] else {}
# Every revision some stage runs at: the generated ones, then transplant-only ones.
ALL_REVISIONS = dict(REVISIONS)
for _slug, _name in TRANSPLANT_REVISIONS.items():
    if ALL_REVISIONS.setdefault(_slug, _name) != _name:
        raise ValueError(
            f"transplant.revisions: {_name!r} and {ALL_REVISIONS[_slug]!r} share the folder name {_slug!r}; rename one"
        )

# Snakemake's priority of the transplant rules (transplant.smk says why); the others have 0.
TRANSPLANT_PRIORITY = 1


wildcard_constraints:
    revision="[A-Za-z0-9._-]+",
    precision="bf16|fp32|fp16",
    shard=r"\d+",


def resolve_path(path):
    """A config path, relative to the working directory, else to the repository (where data/ ships)."""
    if path is None or os.path.isabs(path) or os.path.exists(path):
        return path
    shipped = REPO / path
    return str(shipped) if shipped.exists() else path


def dataset_config():
    dataset = dict(config["dataset"])
    if dataset.get("path"):
        dataset["path"] = resolve_path(dataset["path"])
    return dataset
