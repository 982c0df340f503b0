from types import SimpleNamespace

from stagereplay.stages.prepare import prepare_again
from stagereplay.stages.settings import PrepareSettings, from_params


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


def prepare_entries_again():
    """Before the first job (onstart): the store entries of the run's records that are gone or damaged, prepared
    again by the prepare stage and refused unless each is the recorded snapshot. No job is planned for them: a rerun
    of prepare_model would rerun every job that loads the model. A record whose keys are not the planned ones is
    left to prepare_model, which reruns for it (its params changed)."""
    for revision in ALL_REVISIONS:
        record = prepared_folder(revision)
        if not os.path.isfile(record):
            continue
        wildcards = SimpleNamespace(revision=revision)
        recorded = {precision: entry["key"] for precision, entry in read_record(record).get("snapshots", {}).items()}
        if recorded != prepare_keys(wildcards):
            continue
        settings = from_params(PrepareSettings, dict(prepare_kwargs(wildcards), model_store=config.get("model_store")))
        again = prepare_again(record, settings, FILE_HASHES)
        if again:
            logger.info(f"Store entries of {revision} at {', '.join(again)} prepared again, each the recorded snapshot")
