# The run's model source, prepared once per revision and precision: a local safetensors snapshot (weights in the
# precision's dtype, config, tokenizer, a manifest with the source's and the snapshot's fingerprints) that every
# model-loading job memory-maps instead of loading the source again. A local safetensors folder already in that
# dtype is linked, not copied. The params hold the source's fingerprint and the converting packages' versions: a
# change of either prepares it again (and reruns what loaded it). See stagereplay.models.snapshot.
rule prepare_model:
    output:
        model=directory(f"{RESULTS}/models/{{revision}}/{{precision}}"),
    log:
        f"{LOGS}/{{revision}}/prepare_model_{{precision}}.log",
    benchmark:
        f"{BENCH}/{{revision}}/prepare_model_{{precision}}.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        kwargs=prepare_kwargs,
        software=PREPARE_SOFTWARE,
        version=CODE_VERSION,
    script:
        "../scripts/prepare_model.py"
