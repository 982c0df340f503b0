"""Stage replay on serving engines outside this package's own decoder: the engine protocol (:mod:`.protocol`), the
rows, replicas and their check of any engine (:mod:`.rows`), and one module per engine, each importing its binding
(an optional extra) only when a function is first used. The engines rebuild the boundary state of the same prefix ids
as the pipeline's constructions and write rows of the same ledger schema; they know nothing of Snakemake or of the
report."""
