# stagereplay: audits stage replay in reasoning language models (see README.md and the design notes).
from snakemake.utils import min_version

min_version("8.0")


# `snakemake --report`: this text opens it; the report itself (findings first) is under Results -> Report.
report: "workflow/report/workflow.rst"


# The embedded default experiment, only when no --configfile is given: a user's config is complete by itself, every
# key it leaves out taking the schema's default, never the toy's value.
if not workflow.overwrite_configfiles:

    configfile: "config.yaml"


# The helpers first (workflow/rules/common.smk says what each file of common/ holds), then the rule files, each
# using only the helpers (tests/test_rule_files.py).
include: "workflow/rules/common.smk"
include: "workflow/rules/select.smk"
include: "workflow/rules/prepare.smk"
include: "workflow/rules/reconstruct.smk"
include: "workflow/rules/transplant.smk"
include: "workflow/rules/divergence_location.smk"
include: "workflow/rules/controls.smk"
include: "workflow/rules/cache_differences.smk"
include: "workflow/rules/fidelity.smk"
include: "workflow/rules/engine.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/toy.smk"
include: "workflow/rules/compare.smk"


rule all:
    default_target: True
    input:
        all_outputs(),
        engine_outputs(),


# Where the run's report is, on the console at the end of a run.
onsuccess:
    location = report_location()
    if location:
        print(location)
