# Several finished runs side by side (config `compare`): results/compare/<name>/ from the runs' results files alone,
# each run refused unless it passes its own results check and audit check. See stagereplay.stages.compare.
# Helpers in common/targets.smk ("Comparisons of runs").


rule compare:
    input:
        comparison_outputs,


rule compare_runs:
    output:
        **{f"{name}_{fmt}": f"{COMPARED}/figures/{name}.{fmt}" for name in COMPARE_FIGURES for fmt in COMPARE_FORMATS},
        report=f"{COMPARED}/report.md",
        stats=f"{COMPARED}/stats.json",
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
