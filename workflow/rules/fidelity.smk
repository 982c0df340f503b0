# Fidelity along the suffix (beyond the study): per precision and shard, the live generation regenerated from the
# ledger's prompts (its rows checked against the ledger's) and each of fidelity.constructions teacher-forced through
# its suffix in the same batches and layout; per step the KL divergences, logit differences and margins.
rule measure_fidelity:
    input:
        models=prepared_at_precision,
        selection=f"{RESULTS}/selection/items.parquet",
        ledger=f"{RESULTS}/{{revision}}/ledger.parquet",
    output:
        fidelity=f"{RESULTS}/{{revision}}/parts/fidelity_{{precision}}_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/measure_fidelity_{{precision}}_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/measure_fidelity_{{precision}}_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        gpu=config["gpus_per_job"],
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        snapshots=snapshots_of(job_precision),
        kwargs=fidelity_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/measure_fidelity.py"


rule gather_fidelity:
    input:
        fidelity=fidelity_parts,
    output:
        fidelity=f"{RESULTS}/{{revision}}/fidelity.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_fidelity.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_fidelity.py"
