# The engines' config check, params and targets (their rules: engine.smk; docs/ENGINES.md), apart from the config,
# settings, inputs and targets files so that an engine is one pair of files.
ENGINES = list(config["engines"])
if ENGINES:
    from stagereplay.engines.llama_cpp import require_binding

    require_binding()  # not installed: the error names the pip command, before any job
    for _slug, _name in REVISIONS.items():
        if source_kind(_name) not in ("gguf", None):  # None: the preflight names why the source does not resolve
            raise ValueError(
                f"engines: {ENGINES} replay GGUF files, and revision {_name!r} of model {config['model']!r} is a "
                f"{source_kind(_name)} model; give model a .gguf file (or a folder and revisions naming .gguf files), "
                "or leave engines empty"
            )


ENGINE_SHARDS = list(range(config["llama_cpp"].get("shards") or config["shards"]))


def llama_cpp_kwargs(wildcards):
    """The revision's GGUF file, the reference precision's prefixes, the stage rule and budgets (llama.cpp's own
    stage ends where the pipeline's would) and the engine's context."""
    settings = config["llama_cpp"]
    return canonical(
        dict(
            model=resolve_path(config["model"]),
            revision=REVISIONS[wildcards.revision],
            model_fingerprint=model_files(REVISIONS[wildcards.revision]),
            precision=config["reference_precision"],
            boundary=config["boundary"],
            max_stage_tokens=config["max_stage_tokens"],
            max_new_tokens=config["max_new_tokens"],
            answer_format=config["answer_format"],
            stage_end=config["stage_end"],
            stage_sources=list(settings["stage_sources"]),
            kv_types=list(settings["kv_types"]),
            constructions=list(settings["constructions"]),
            n_ctx=settings.get("n_ctx"),
            n_batch=settings.get("n_batch"),
            n_ubatch=settings.get("n_ubatch"),
            threads=settings.get("threads") or config["threads"],
            n_gpu_layers=settings["n_gpu_layers"],
            flash_attn=settings["flash_attn"],
            chunk_size=settings.get("chunk_size") or config["chunk_size"],
            shard=int(wildcards.shard),
            n_shards=len(ENGINE_SHARDS),
        )
    )


def engine_parts(kind):
    """An input function: a revision's parts/<kind>_<shard>.parquet, one per engine shard."""

    def parts(wildcards):
        return expand(f"{RESULTS}/{wildcards.revision}/parts/{kind}_{{shard}}.parquet", shard=ENGINE_SHARDS)

    return parts


def engine_files(names):
    return expand(f"{RESULTS}/{{revision}}/{{name}}", revision=REVISIONS, name=names) if ENGINES else []


def engine_outputs():
    """The engines' targets: each revision's engine rows and their audit."""
    return engine_files(["engine_llama_cpp.parquet", "engine_llama_cpp_audit.parquet"])


def engine_report_inputs(wildcards):
    """The report's engine inputs, by kind (analysis.inputs.FILES)."""
    if not ENGINES:
        return {}
    return {
        "engine_llama_cpp": engine_files(["engine_llama_cpp.parquet"]),
        "engine_llama_cpp_audit": engine_files(["engine_llama_cpp_audit.parquet"]),
    }
