"""The workflow's time, projected rule by rule from measured rates: every model job's work counted as the stage code
does it, priced at rates measured apart from the run, and the jobs placed on one GPU or N.

- :mod:`.shape`: a run's shape (its config, items, batches, lengths and the counts its results recorded), from a
  run's JSON or, for a run not made, from a workflow config;
- :mod:`.dag`: the model jobs, read from Snakemake's own DAG of the config (rule, wildcards, resources, what each
  may load, what each waits for);
- :mod:`.counts`: what a cell decodes (the units of work);
- :mod:`.jobs`: what each of those jobs decodes, counted by its rule (in cells);
- :mod:`.rates`: the measured rates (a decode step's fit, the prefill and dump rates) and a model job's overhead;
- :mod:`.pricing`: a job's work in seconds at those rates;
- :mod:`.schedule`: the jobs' dependencies, and a list scheduler placing them on N GPUs;
- :mod:`.report`: a measured run against its projection, a run not made projected, and their tables;
- :mod:`.paper`: the per-item count of the paper-scale run (``project``), and its split by rule;
- :mod:`.floor`: the floor of a count of work at the datasheet rates.

Knows nothing of devices or models: it reads what the benchmarks measured (``bench/benchmark.py``'s rates,
``bench/pipeline_run.py``'s run, ``bench/pipeline_projection.py --measure-overhead``'s job overhead) as plain values,
the workflow's config schema, and its jobs off the workflow itself (Snakemake's API plans this checkout's
``Snakefile`` on the config; no job runs). ``bench/pipeline_projection.py`` is its command line.
"""
