# The engines' config check, params and targets (their rules: engine.smk; docs/ENGINES.md), apart from the config,
# settings, inputs and targets files. Nothing here names an engine: each is the catalogue's (its class) and its
# config block (config[<engine>]), whose keys beyond stage_sources, constructions, shards and contexts are its config
# class's fields (docs/EXTENDING.md).
import dataclasses

from stagereplay.engines.protocol import engine_class

ENGINES = list(config["engines"])
ENGINE_CLASSES = {name: engine_class(name) for name in ENGINES}
for _engine, _cls in ENGINE_CLASSES.items():
    _cls.require()  # not installed: the error names the pip command, before any job
    for _slug, _name in REVISIONS.items():
        try:
            _cls.model_file(resolve_path(config["model"]), _name, ".")  # a model it cannot open: its error, now
        except ModelLoadError:
            pass  # the preflight names why the source does not resolve


wildcard_constraints:
    engine="|".join(catalogue.engine_names()),  # the catalogue's engines: engine_<name>_audit is no engine's rows


def engine_shards(engine):
    return list(range(config[engine].get("shards") or config["shards"]))


def engine_config(engine):
    """The engine's config block as its config class's fields: a null key it inherits takes the config's own."""
    block = config[engine]
    cls = ENGINE_CLASSES[engine].config_class
    values = {f.name: block[f.name] for f in dataclasses.fields(cls)}
    values.update({key: config[key] for key in cls.inherited if values[key] is None})
    return values


def engine_kwargs(wildcards):
    """The engine, the revision's model file, the reference precision's prefixes, the stage rule and budgets (the
    engine's own stage ends where the pipeline's would), the stage ids and constructions, and the engine's config."""
    block = config[wildcards.engine]
    return canonical(
        dict(
            engine=wildcards.engine,
            model=resolve_path(config["model"]),
            revision=REVISIONS[wildcards.revision],
            model_fingerprint=model_files(REVISIONS[wildcards.revision]),
            precision=config["reference_precision"],
            boundary=config["boundary"],
            max_stage_tokens=config["max_stage_tokens"],
            max_new_tokens=config["max_new_tokens"],
            answer_format=config["answer_format"],
            stage_end=config["stage_end"],
            stage_sources=list(block["stage_sources"]),
            constructions=list(block["constructions"]),
            settings=engine_config(wildcards.engine),
            shard=int(wildcards.shard),
            n_shards=len(engine_shards(wildcards.engine)),
            contexts=block.get("contexts") or 1,
        )
    )


def engine_threads(wildcards):
    """Each of the job's contexts runs on its own threads: the block's threads (else the config's) per context."""
    block = config[wildcards.engine]
    return (block.get("threads") or config["threads"]) * (block.get("contexts") or 1)


def engine_gpus(wildcards):
    """1 where the engine's config offloads (the job claims a GPU), else 0."""
    return ENGINE_CLASSES[wildcards.engine].config_class(**engine_config(wildcards.engine)).gpus()


def engine_parts(kind):
    """An input function: a revision's parts/engine_<engine><kind>_<shard>.parquet, one per shard of the engine."""

    def parts(wildcards):
        return expand(
            f"{RESULTS}/{wildcards.revision}/parts/engine_{wildcards.engine}{kind}_{{shard}}.parquet",
            shard=engine_shards(wildcards.engine),
        )

    return parts


def engine_result_names():
    """The configured engines' results files (the catalogue's Engine.outputs): engine_<name>, engine_<name>_audit."""
    return [output for name in ENGINES for output in catalogue.engine(name).outputs]


def engine_outputs():
    """The engines' targets: each revision's engine rows and their audit."""
    return expand(f"{RESULTS}/{{revision}}/{{name}}.parquet", revision=REVISIONS, name=engine_result_names())


def engine_report_inputs(wildcards):
    """The report's engine inputs, by kind (analysis.inputs.FILES)."""
    return {
        name: expand(f"{RESULTS}/{{revision}}/{name}.parquet", revision=REVISIONS) for name in engine_result_names()
    }
