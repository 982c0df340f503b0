"""Stage replay on serving engines outside this package's own decoder: one module per engine, each importing its
binding (an optional extra) only when a function is first used. The engines rebuild the boundary state of the same
prefix ids as the pipeline's constructions and write rows of the same ledger schema; they know nothing of Snakemake
or of the report."""
