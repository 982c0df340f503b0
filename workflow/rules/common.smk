# The workflow's helpers, under one roof: every global a rule file may use is defined in one file of common/, and
# this file includes them all, before any rule file (the Snakefile includes it first). A rule file declares rules
# only and uses nothing of another rule file (tests/test_rule_files.py). In the order each needs the ones above it:
#   config.smk     the config, typed, validated against the schema and checked across keys; the constants derived
#                  from it (RUN, RESULTS, LOGS, BENCH, the revisions, shards, the transplant's revisions and precision)
#   settings.smk   the jobs' params: params.kwargs from the stages' settings dataclasses, the fingerprints of the
#                  dataset and model files, the model-store snapshot keys, the store entries prepared again at start
#   inputs.smk     the input functions: the model-store records, the per-shard parts a gather joins, the transplant
#                  baselines, the report's per-revision inputs
#   targets.smk    what `rule all` asks for, the report's figures, the controls not run, where the report is at the
#                  end of a run, and the comparisons of runs
#   engines.smk    the engines': config check, params, shards and targets (their rules: engine.smk)
#   integrity.smk  before the first job: the results files are this run's and intact
#   preflight.smk  before the first job (and in a dry run): every check of the inputs that needs no weights, and
#                  the job server's start (the onstart hook)
include: "common/config.smk"
include: "common/settings.smk"
include: "common/inputs.smk"
include: "common/targets.smk"
include: "common/engines.smk"
include: "common/integrity.smk"
include: "common/preflight.smk"
