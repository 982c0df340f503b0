# Helpers of the controls (controls.smk): config checks, ledger parts, targets and input functions.
if config["reference_precision"] not in config["precisions"]:
    raise ValueError(
        f"reference_precision: {config['reference_precision']!r} is not one of precisions "
        f"{config['precisions']}; the fixed-prefix 2x2 takes its prefixes from that precision's generation"
    )

LEDGER_PARTS.append(
    f"{RESULTS}/{{revision}}/parts/fixed_prefix_{{precision}}_{{shard}}.parquet"
)
REPORT_INPUTS["bridge"] = f"{RESULTS}/{{revision}}/bridge.parquet"
REPORT_INPUTS["audit"] = f"{RESULTS}/{{revision}}/audit.parquet"
REPORT_INPUTS["batch_invariance"] = f"{RESULTS}/{{revision}}/batch_invariance.parquet"
TARGETS.extend(
    expand(
        f"{RESULTS}/{{revision}}/{{name}}",
        revision=REVISIONS,
        name=[
            "bridge.parquet",
            "audit.parquet",
            "audit_check.json",
            "batch_invariance.parquet",
        ],
    )
)


def fixed_prefix_kwargs(wildcards):
    return dict(
        model_kwargs(wildcards), reference_precision=config["reference_precision"]
    )


def bridge_parts(wildcards):
    return expand(
        f"{RESULTS}/{wildcards.revision}/parts/bridge_{{precision}}_{{shard}}.parquet",
        precision=config["precisions"],
        shard=SHARDS,
    )


def audit_parts(wildcards):
    return expand(
        f"{RESULTS}/{wildcards.revision}/parts/audit_{{precision}}_{{shard}}.parquet",
        precision=config["precisions"],
        shard=SHARDS,
    )


def batch_invariance_kwargs(wildcards):
    """Model settings of the generation (every precision in one job), and the control's sample."""
    return dict(
        generation_kwargs(wildcards.revision),
        precisions=config["precisions"],
        sample=config["batch_invariance"]["sample"],
        sample_seed=config["batch_invariance"]["seed"],
    )
