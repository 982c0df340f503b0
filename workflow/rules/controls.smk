# The controls: fixed-prefix 2x2 (construction x precision over the reference prefixes), the bridge (gathered
# from the matched experiment's parts, where the live cache exists), the saved-ledger audit and batch invariance.
rule generate_fixed_prefix:
    input:
        models=prepared_at_precision,
        selection=f"{RESULTS}/selection/items.parquet",
        prefixes=f"{RESULTS}/{{revision}}/parts/prefixes_{config['reference_precision']}_{{shard}}.parquet",
    output:
        ledger=f"{RESULTS}/{{revision}}/parts/fixed_prefix_{{precision}}_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/generate_fixed_prefix_{{precision}}_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/generate_fixed_prefix_{{precision}}_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        gpu=config["gpus_per_job"],
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        snapshots=snapshots_of(job_precision),
        kwargs=fixed_prefix_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/generate_fixed_prefix.py"


rule gather_bridge:
    input:
        bridge=bridge_parts,
    output:
        bridge=f"{RESULTS}/{{revision}}/bridge.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_bridge.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_bridge.py"


# Always succeeds when the recomputation ran: its findings are its output (check_audit is what fails).
rule audit_ledger:
    input:
        models=prepared_at_precision,
        selection=f"{RESULTS}/selection/items.parquet",
        ledger=f"{RESULTS}/{{revision}}/ledger.parquet",
    output:
        audit=f"{RESULTS}/{{revision}}/parts/audit_{{precision}}_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/audit_ledger_{{precision}}_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/audit_ledger_{{precision}}_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        gpu=config["gpus_per_job"],
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        snapshots=snapshots_of(job_precision),
        kwargs=fixed_prefix_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/audit_ledger.py"


rule gather_audit:
    input:
        audit=audit_parts,
    output:
        audit=f"{RESULTS}/{{revision}}/audit.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_audit.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_audit.py"


# Fails, naming the rows, when any ledger row did not reproduce; audit.parquet stays on disk either way.
rule check_audit:
    input:
        audit=f"{RESULTS}/{{revision}}/audit.parquet",
        ledger=f"{RESULTS}/{{revision}}/ledger.parquet",
    output:
        check=f"{RESULTS}/{{revision}}/audit_check.json",
    log:
        f"{LOGS}/{{revision}}/check_audit.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/check_audit.py"


# Batch invariance: a seeded sample of items rerun alone and compared with their batched rows (batch_size > 1);
# at batch_size 1 there is nothing to compare and no target asks for it (controls_not_run: common/targets.smk).
rule check_batch_invariance:
    input:
        models=prepared_at_all_precisions,
        selection=f"{RESULTS}/selection/items.parquet",
        ledger=f"{RESULTS}/{{revision}}/ledger.parquet",
    output:
        table=f"{RESULTS}/{{revision}}/parts/batch_invariance_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/check_batch_invariance_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/check_batch_invariance_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        gpu=config["gpus_per_job"],
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        snapshots=snapshots_of(generated_precisions),
        kwargs=batch_invariance_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/check_batch_invariance.py"


rule gather_batch_invariance:
    input:
        table=shard_files("batch_invariance", ".parquet"),
    output:
        table=f"{RESULTS}/{{revision}}/batch_invariance.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_batch_invariance.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_batch_invariance.py"
