rule reconstruct_prefixes:
    input:
        models=prepared_at_precision,
        selection=f"{RESULTS}/selection/items.parquet",
    output:
        ledger=f"{RESULTS}/{{revision}}/parts/matched_{{precision}}_{{shard}}.parquet",
        prefixes=f"{RESULTS}/{{revision}}/parts/prefixes_{{precision}}_{{shard}}.parquet",
        bridge=f"{RESULTS}/{{revision}}/parts/bridge_{{precision}}_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/reconstruct_prefixes_{{precision}}_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/reconstruct_prefixes_{{precision}}_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        gpu=config["gpus_per_job"],
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        snapshots=snapshots_of(job_precision),
        kwargs=model_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/reconstruct_prefixes.py"


rule gather_ledger:
    input:
        ledger=ledger_parts,
        prefixes=prefix_parts,
    output:
        ledger=f"{RESULTS}/{{revision}}/ledger.parquet",
        prefixes=f"{RESULTS}/{{revision}}/prefixes.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_ledger.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_ledger.py"
