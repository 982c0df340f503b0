# The workflow's targets: everything `rule all` asks for, the report's figures and the revisions each kind of its
# inputs exists at, and the comparisons of runs (compare.smk).
from stagereplay.analysis.captions import CAPTIONS
from stagereplay.analysis.compare import FIGURES as COMPARE_FIGURES
from stagereplay.stages.compare import COMPARE_FOLDER, FORMATS as COMPARE_FORMATS, run_folders, run_state


def all_outputs():
    return [
        f"{RESULTS}/selection/items.parquet",
        *expand(
            f"{RESULTS}/{{revision}}/{{name}}",
            revision=REVISIONS,
            name=[
                "prefixes.parquet",
                "ledger.parquet",
                "bridge.parquet",
                "audit.parquet",
                "audit_check.json",
                "batch_invariance.parquet",
                "cache_differences.parquet",
            ],
        ),
        *expand(f"{RESULTS}/{{revision}}/fidelity.parquet", revision=FIDELITY_REVISIONS),
        *expand(
            f"{RESULTS}/{{revision}}/{{name}}",
            revision=TRANSPLANT_REVISIONS,
            name=[
                "transplant.parquet",
                "caches.parquet",
                "minimal_transplant.parquet",
                "divergence_onset.parquet",
            ],
        ),
        f"{RESULTS}/report/report.md",
        f"{RESULTS}/report/stats.json",
        f"{RESULTS}/report/items.html",
        *figure_files("pdf"),
        *figure_files("png"),
    ]


# ---- Report: its figures, and the revisions of its per-revision inputs (report_inputs: inputs.smk) ----------------
FIGURE_NAMES = [
    "fig1_disagreement",
    "fig2_first_divergence",
    "fig3_margins",
    "fig4_cache_differences",
    "fig5_transplant",
    "fig6_accuracy",
    "fig7_minimal_transplant",
    "fig8_divergence_onset",
    "fig9_fidelity",
    "fig10_split_predictors",
]


def figure_title(name):
    """A figure's name in the Snakemake report: its number and title, as the report's captions give them."""
    title = CAPTIONS[name][0]
    return f"{FIGURE_NAMES.index(name) + 1}. {title}"


def report_revisions():
    """Revisions each kind of the report's inputs exists at: every generated revision, the transplant at its own."""
    generated = list(REVISIONS)
    return {
        "ledger": generated,
        "transplant": list(TRANSPLANT_REVISIONS),
        "minimal_transplant": list(TRANSPLANT_REVISIONS),
        "divergence_onset": list(TRANSPLANT_REVISIONS),
        "bridge": generated,
        "audit": generated,
        "batch_invariance": generated,
        "cache_differences": generated,
        "fidelity": list(FIDELITY_REVISIONS),
    }


def figure_files(fmt):
    return [f"{RESULTS}/report/figures/{name}.{fmt}" for name in FIGURE_NAMES]


# ---- Comparisons of runs (compare.smk): the target, and the runs it reads --------------------------------------------
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
        raise ValueError(
            f"results/{COMPARE_FOLDER}/{wildcards.name}/ is not the comparison the config names "
            f"({settings['name']}); set compare.name to build it"
        )
    return run_folders(settings["runs"])


def compared_run_names(wildcards):
    return list(compared_runs(wildcards))


def compared_states(wildcards):
    """Per run, a digest of the files the comparison reads: a run whose files change is compared again. They are no
    inputs of the rule: a compared run named as the config's own run would then be rebuilt with this config."""
    return {label: run_state(folder) for label, folder in compared_runs(wildcards).items()}
