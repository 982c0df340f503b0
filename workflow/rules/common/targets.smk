# The workflow's targets: everything `rule all` asks for, the report's figures and the revisions each kind of its
# inputs exists at, the controls left out where they have nothing to compare, where the report is at the end of a
# run, and the comparisons of runs (compare.smk).
import time

from stagereplay import catalogue
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
                "cache_differences.parquet",
            ],
        ),
        *expand(f"{RESULTS}/{{revision}}/batch_invariance.parquet", revision=BATCH_INVARIANCE_REVISIONS),
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


# ---- The end of a run: where its report is ----------------------------------------------------------------------
STARTED = time.time()  # when this invocation read the workflow: a report written since is this invocation's


def report_location():
    """A line naming the run's report.md (None where there is none), and whether this invocation wrote it."""
    markdown = Path(f"{RESULTS}/report/report.md")
    if not markdown.is_file():
        return None
    written = "written by this invocation" if markdown.stat().st_mtime >= STARTED else "not rebuilt by this invocation"
    return (
        f"Report of run {RUN} ({written}): {markdown.resolve()}; report.html and stats.json beside it; "
        "`snakemake --report report.html` makes one self-contained page of it with the figures and item browser."
    )


# ---- Controls that have nothing to compare under this config: not scheduled; the report says why -------------------
def controls_not_run():
    """{report section: why its control is not scheduled} (build_report's not_run)."""
    if config["batch_size"] == 1:
        reason = (
            "batch_size is 1, so every item was decoded alone and no batched row exists to compare with a row "
            "decoded alone; set batch_size above 1 (with decode_regime static or cuda_graph) to run this control"
        )
    elif config["batch_invariance"]["sample"] == 0:
        reason = "batch_invariance.sample is 0: no item is sampled to rerun alone"
    else:
        return {}
    return {"batch_invariance": reason}


BATCH_INVARIANCE_REVISIONS = [] if "batch_invariance" in controls_not_run() else list(REVISIONS)


# ---- Report: its figures, and the revisions of its per-revision inputs (report_inputs: inputs.smk) ----------------
FIGURE_NAMES = catalogue.figure_names()  # the catalogue's figures, in the order that numbers them


def figure_title(name):
    """A figure's name in the Snakemake report: its number and title, as the report's captions give them. The number
    has two digits: the report lists its entries in string order, where 10 comes before 2."""
    title = CAPTIONS[name][0]
    return f"{FIGURE_NAMES.index(name) + 1:02d}. {title}"


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
        "batch_invariance": BATCH_INVARIANCE_REVISIONS,
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
