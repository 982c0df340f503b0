# Serving engines (beyond the study; docs/ENGINES.md): with engines: [llama_cpp], llama.cpp generates each GGUF
# revision's stage itself and rebuilds it, and replays the reference precision's stage ids, in its own constructions
# and KV types; a second job recomputes every row. Both split by item shard (llama_cpp.shards; one model per job, side
# by side under --resources gpu=K), and a gather joins the parts. The report sets them beside the pipeline's own
# constructions on the same items.
rule replay_on_llama_cpp:
    input:
        selection=f"{RESULTS}/selection/items.parquet",
        prefixes=f"{RESULTS}/{{revision}}/prefixes.parquet",
    output:
        ledger=f"{RESULTS}/{{revision}}/parts/engine_llama_cpp_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/replay_on_llama_cpp_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/replay_on_llama_cpp_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["llama_cpp"].get("threads") or config["threads"]
    resources:
        gpu=1 if config["llama_cpp"]["n_gpu_layers"] else 0,
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        kwargs=llama_cpp_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/replay_on_llama_cpp.py"


rule gather_engine_llama_cpp:
    input:
        parts=engine_parts("engine_llama_cpp"),
    output:
        ledger=f"{RESULTS}/{{revision}}/engine_llama_cpp.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_engine_llama_cpp.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_engine_llama_cpp.py"


rule audit_llama_cpp:
    input:
        selection=f"{RESULTS}/selection/items.parquet",
        prefixes=f"{RESULTS}/{{revision}}/prefixes.parquet",
        ledger=f"{RESULTS}/{{revision}}/engine_llama_cpp.parquet",
    output:
        audit=f"{RESULTS}/{{revision}}/parts/engine_llama_cpp_audit_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/audit_llama_cpp_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/audit_llama_cpp_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["llama_cpp"].get("threads") or config["threads"]
    resources:
        gpu=1 if config["llama_cpp"]["n_gpu_layers"] else 0,
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        kwargs=llama_cpp_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/audit_llama_cpp.py"


rule gather_engine_llama_cpp_audit:
    input:
        parts=engine_parts("engine_llama_cpp_audit"),
    output:
        audit=f"{RESULTS}/{{revision}}/engine_llama_cpp_audit.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_engine_llama_cpp_audit.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_engine_llama_cpp_audit.py"
