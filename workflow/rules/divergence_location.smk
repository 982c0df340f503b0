# Where the divergence lives, at every revision of transplant.revisions on the primary revision's prefix ids: the
# minimal sufficient transplant of each divergent selected item (a budgeted bisection over K/V, layers and
# positions) and the onset of the difference between the two constructions' boundary caches. Their settings live
# only in these rules' params, so changing them reruns these rules (and the report), never generation or transplants.


rule find_minimal_transplants:
    input:
        models=prepared_for_minimal_transplants,
        selection=f"{RESULTS}/{{revision}}/transplant_selection.parquet",
        baseline=transplant_baseline_at_precision,
    output:
        minimal=f"{RESULTS}/{{revision}}/parts/minimal_transplant_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/find_minimal_transplants_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/find_minimal_transplants_{{shard}}.tsv"
    priority: TRANSPLANT_PRIORITY  # started first among the jobs ready at once (transplant.smk)
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        gpu=config["gpus_per_job"],
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        snapshots=snapshots_of(minimal_transplant_precisions),
        kwargs=minimal_transplant_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/find_minimal_transplants.py"


rule measure_divergence_onset:
    input:
        models=prepared_at_baseline_precisions,
        baseline=transplant_baseline,
    output:
        onset=f"{RESULTS}/{{revision}}/parts/divergence_onset_{{shard}}.parquet",
    log:
        f"{LOGS}/{{revision}}/measure_divergence_onset_{{shard}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/measure_divergence_onset_{{shard}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        gpu=config["gpus_per_job"],
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        snapshots=snapshots_of(baseline_precisions),
        kwargs=onset_kwargs,
        version=CODE_VERSION,
    script:
        "../scripts/measure_divergence_onset.py"


rule gather_minimal_transplants:
    input:
        minimal=shard_files("minimal_transplant", ".parquet"),
    output:
        minimal=f"{RESULTS}/{{revision}}/minimal_transplant.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_minimal_transplants.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_minimal_transplants.py"


rule gather_divergence_onset:
    input:
        onset=shard_files("divergence_onset", ".parquet"),
    output:
        onset=f"{RESULTS}/{{revision}}/divergence_onset.parquet",
    log:
        f"{LOGS}/{{revision}}/gather_divergence_onset.log",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        version=CODE_VERSION,
    script:
        "../scripts/gather_divergence_onset.py"
