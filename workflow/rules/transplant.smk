# Stages 4 and 5: boundary-cache dumps and bidirectional K/V transplants, at every revision of transplant.revisions,
# on the primary revision's prefix ids. Transplant settings live only in the params of the rules that use them, so
# changing them reruns selection or transplants, never generation. Every rule here that loads a model runs one job
# per shard over whole batches of the recorded plan; a gather joins the parts.


rule replay_fixed_prefixes:
    input:
        models=prepared_at_transplant_precision,
        prefixes=f"{RESULTS}/{PRIMARY}/prefixes.parquet",
        selection=f"{RESULTS}/selection/items.parquet",
    output:
        baseline=f"{RESULTS}/{{revision}}/parts/replay_baseline_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/replay_fixed_prefixes_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/replay_fixed_prefixes_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        gpu=config["gpus_per_job"],
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        snapshots=snapshots_of(transplant_precision),
        kwargs=baseline_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/replay_fixed_prefixes.py"


rule gather_replay_baseline:
    input:
        baseline=shard_files("replay_baseline", ".parquet"),
    output:
        baseline=f"{RESULTS}/{{revision}}/replay_baseline.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_replay_baseline.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_replay_baseline.py"


# The primary revision's ledger rows at one precision (the transplant precision's: transplant_baseline_at_precision),
# joined as gather_ledger joins the whole ledger, by the same adapter as a replayed baseline (ledger rows too).
# TRANSPLANT_PRIORITY: the transplants and the minimal search are the longest later model jobs, so the scheduler
# starts them (and the two jobs before them) first among the jobs ready at once; a priority changes no result.
rule gather_transplant_baseline:
    input:
        baseline=ledger_parts_at_precision,
    output:
        baseline=f"{RESULTS}/{{revision}}/parts/ledger_{{precision}}.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_transplant_baseline_{{precision}}.log",
    priority: TRANSPLANT_PRIORITY
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_replay_baseline.py"


rule select_transplant_items:
    input:
        baseline=transplant_baseline_at_precision,
    output:
        selection=f"{RESULTS}/{{revision}}/transplant_selection.parquet",
    log:
        f"{LOGS}/{{revision}}/select_transplant_items.log",
    priority: TRANSPLANT_PRIORITY
    conda:
        "../../envs/stagereplay.yaml"
    params:
        revision=revision_name,
        precision=TRANSPLANT_PRECISION,
        select=config["transplant"]["select"],
        seed=config["transplant"]["seed"],
        constructions=config["transplant"]["constructions"],
        version=CODE_VERSION,
    script:
        "../scripts/select_transplant_items.py"


rule dump_caches:
    input:
        models=prepared_for_dumps,
        baseline=transplant_baseline,
    output:
        caches=directory(f"{RESULTS}/{{revision}}/parts/caches_{{shard}}"),
        manifest=f"{RESULTS}/{{revision}}/parts/caches_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/dump_caches_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/dump_caches_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        gpu=config["gpus_per_job"],
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        snapshots=snapshots_of(dump_precisions),
        kwargs=dump_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/dump_caches.py"


rule gather_caches:
    input:
        manifests=shard_files("caches", ".parquet"),
        folders=shard_files("caches", ""),
    output:
        caches=directory(f"{RESULTS}/{{revision}}/caches"),
        manifest=f"{RESULTS}/{{revision}}/caches.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_caches.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_caches.py"


rule transplant_caches:
    input:
        models=prepared_at_transplant_precision,
        selection=f"{RESULTS}/{{revision}}/transplant_selection.parquet",
        baseline=transplant_baseline_at_precision,
    output:
        transplant=f"{RESULTS}/{{revision}}/parts/transplant_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/transplant_caches_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/transplant_caches_{{shard}}.tsv"
    priority: TRANSPLANT_PRIORITY
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        gpu=config["gpus_per_job"],
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        snapshots=snapshots_of(transplant_precision),
        kwargs=transplant_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/transplant_caches.py"


rule gather_transplants:
    input:
        transplant=shard_files("transplant", ".parquet"),
    output:
        transplant=f"{RESULTS}/{{revision}}/transplant.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_transplants.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_transplants.py"
