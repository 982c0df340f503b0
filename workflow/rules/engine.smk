# Serving engines (beyond the study; docs/ENGINES.md): for each engine of the config's engines (the {engine}
# wildcard, one of the catalogue's), the engine generates each revision's stage itself and rebuilds it, and replays
# the reference precision's stage ids, in its own constructions and precisions; a second job recomputes every row.
# Both split by item shard (<engine>.shards; one model per job, side by side under --resources gpu=K), and a gather
# joins the parts. The report sets them beside the pipeline's own constructions on the same items.
rule replay_on_engine:
    input:
        selection=f"{RESULTS}/selection/items.parquet",
        prefixes=f"{RESULTS}/{{revision}}/prefixes.parquet",
    output:
        ledger=f"{RESULTS}/{{revision}}/parts/engine_{{engine}}_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/replay_on_engine_{{engine}}_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/replay_on_engine_{{engine}}_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: engine_threads
    resources:
        gpu=engine_gpus,
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        kwargs=engine_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/replay_on_engine.py"


rule gather_engine_rows:
    input:
        parts=engine_parts(""),
    output:
        ledger=f"{RESULTS}/{{revision}}/engine_{{engine}}.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_engine_rows_{{engine}}.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_engine_rows.py"


rule audit_engine:
    input:
        selection=f"{RESULTS}/selection/items.parquet",
        prefixes=f"{RESULTS}/{{revision}}/prefixes.parquet",
        ledger=f"{RESULTS}/{{revision}}/engine_{{engine}}.parquet",
    output:
        audit=f"{RESULTS}/{{revision}}/parts/engine_{{engine}}_audit_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/audit_engine_{{engine}}_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/audit_engine_{{engine}}_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: engine_threads
    resources:
        gpu=engine_gpus,
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        kwargs=engine_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/audit_engine.py"


rule gather_engine_audit:
    input:
        parts=engine_parts("_audit"),
    output:
        audit=f"{RESULTS}/{{revision}}/engine_{{engine}}_audit.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_engine_audit_{{engine}}.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_engine_audit.py"
