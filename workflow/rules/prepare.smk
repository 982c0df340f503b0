# Each revision's model source, prepared once in the model store at every precision the run loads it at, from one
# read of the source (stagereplay.stages.prepare): safetensors snapshots that every model-loading job memory-maps,
# shared with every other run on the same files. The output is the run's record of the store entries; their keys
# (the source's content, the precision, the converting packages' versions) are in the params, so another source
# or converter prepares again and reruns what loaded it. A key already in the store prepares nothing; an entry
# removed from the store plans nothing: the run prepares it again before its first job (prepare_entries_again), and a
# job prepares nothing. The store's folder (config model_store) is not a param: where the store is changes no result.
rule prepare_model:
    output:
        record=f"{RESULTS}/models/{{revision}}.json",
    log:
        f"{LOGS}/{{revision}}/prepare_model.log",
    benchmark:
        f"{BENCH}/{{revision}}/prepare_model.tsv"
    conda:
        "../../envs/stagereplay.yaml"
    threads: config["threads"]
    resources:
        mem_mb=config["mem_mb_per_job"],
        runtime=config["runtime_per_job"],
    params:
        kwargs=prepare_kwargs,
        snapshots=prepare_keys,
    script:
        "../scripts/prepare_model.py"
