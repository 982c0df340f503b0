# Per-layer differences between the incremental and prefill boundary caches over identical prefix ids (figure 4).
rule measure_cache_differences:
    input:
        models=prepared_for_cache_differences,
        prefixes=f"{RESULTS}/{{revision}}/prefixes.parquet",
    output:
        differences=f"{RESULTS}/{{revision}}/parts/cache_differences_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/measure_cache_differences_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/measure_cache_differences_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        gpu=config["gpus_per_job"],
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        snapshots=snapshots_of(cache_difference_precisions),
        kwargs=cache_difference_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/measure_cache_differences.py"


rule gather_cache_differences:
    input:
        differences=shard_files("cache_differences", ".parquet"),
    output:
        differences=f"{RESULTS}/{{revision}}/cache_differences.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_cache_differences.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_cache_differences.py"
