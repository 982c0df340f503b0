# Several finished runs side by side (config `compare`): results/compare/<name>/ from the runs' results files alone,
# each run refused unless it passes its own results check and audit check. See stagereplay.stages.compare.
from stagereplay.analysis.compare import FIGURES as COMPARE_FIGURES
from stagereplay.stages.compare import COMPARE_FOLDER, FORMATS as COMPARE_FORMATS, run_folders, run_state

COMPARED = f"results/{COMPARE_FOLDER}/{{name}}"


def compare_settings():
    settings = config["compare"]
    if not settings["runs"]:
        raise ValueError(
            "compare.runs is empty: give the comparison's name and the finished runs to compare, e.g. "
            "--config 'compare={name: numerics, runs: [default, invariant]}' (README, \"Several runs side by side\")"
        )
    return settings


def comparison_outputs(wildcards):
    name = compare_settings()["name"]
    return [f"results/{COMPARE_FOLDER}/{name}/report.md", f"results/{COMPARE_FOLDER}/{name}/stats.json"]


def compared_runs(wildcards):
    """The runs, refused before any job when fewer than two, one listed twice or one without a results folder."""
    settings = compare_settings()
    if wildcards.name != settings["name"]:
        raise ValueError(f"results/{COMPARE_FOLDER}/{wildcards.name}/ is not the comparison the config names "
                         f"({settings['name']}); set compare.name to build it")
    return run_folders(settings["runs"])


def compared_run_names(wildcards):
    return list(compared_runs(wildcards))


def compared_states(wildcards):
    """Per run, a digest of the files the comparison reads: a run whose files change is compared again. They are no
    inputs of the rule: a compared run named as the config's own run would then be rebuilt with this config."""
    return {label: run_state(folder) for label, folder in compared_runs(wildcards).items()}


rule compare:
    input:
        comparison_outputs,


rule compare_runs:
    output:
        report=f"{COMPARED}/report.md",
        stats=f"{COMPARED}/stats.json",
        **{
            f"{name}_{fmt}": f"{COMPARED}/figures/{name}.{fmt}"
            for name in COMPARE_FIGURES
            for fmt in COMPARE_FORMATS
        },
    log:
        f"logs/{COMPARE_FOLDER}/{{name}}.log",
    wildcard_constraints:
        name="[A-Za-z0-9][A-Za-z0-9._-]*",
    conda:
        "../../envs/stagereplay.yaml"
    params:
        runs=compared_run_names,
        states=compared_states,
        version=CODE_VERSION,
    script:
        "../scripts/compare_runs.py"
