"""How every rule script starts: ``start_job(snakemake)`` is its first statement (tests/test_rule_scripts.py checks
each one). It sends the job's standard error to the rule's log, logs to it at INFO, for the rules that import
the model or analysis stack (``warm=True``) hands the job over to a warm job server
(:mod:`stagereplay.runtime.hand_over`, :mod:`stagereplay.runtime.job_server`) that has imported :data:`PRELOAD`,
and binds the files the job writes to it (:func:`bind_job`).

Imports nothing heavy itself: a table job that starts with it imports no torch (tests/test_job_imports.py).
"""

from __future__ import annotations

import functools
import logging
import os
import sys

from stagereplay.runtime.hand_over import hand_over
from stagereplay.runtime.server_protocol import CHILD_ENV

PROBE_TIMEOUT_S = 3.0  # the run's start waits at most this long (or job_server_timeout_s) for its server's answer
# What a warm server imports before it serves: Snakemake's script support (the preamble unpickles with it), the
# model stages, the loader and the transformers code the supported model types run (their modeling and tokenizer
# modules), the report's and item browser's stacks, and scipy's and statsmodels' statistics. Not the figures'
# module: it imports matplotlib, which reads ./matplotlibrc as it is imported (the server refuses to preload it);
# a figures job imports it in its own folder (0.3 s).
PRELOAD = ("snakemake.script", "stagereplay.stages.reconstruct", "stagereplay.stages.controls",
           "stagereplay.stages.transplant", "stagereplay.stages.minimal_transplant",
           "stagereplay.stages.divergence_onset", "stagereplay.stages.cache_differences", "stagereplay.stages.fidelity",
           "torch._inductor.config",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama",
           "transformers.models.mistral.modeling_mistral", "transformers.tokenization_utils_tokenizers",
           "stagereplay.stages.token_texts", "stagereplay.analysis.report", "scipy.stats",
           "statsmodels.stats.proportion")


def start_job(snakemake, warm: bool = False) -> None:
    """Standard error to the rule's log (``snakemake.log[0]``), logging at INFO to it, then with ``warm`` the
    hand-over: where a server forks the job, its child runs the script from its top (this call, then the rest)
    and this process exits with the child's status; else the job runs on in this process, its log saying why (and
    the run's console, the stderr this process was started with, once per run).

    The job's process empties the log and both it and a child forked for it append to it, so neither writes over
    the other's lines."""
    log_file = snakemake.log[0]
    if not os.environ.get(CHILD_ENV):
        open(log_file, "w").close()
    sys.stderr = open(log_file, "a")  # noqa: SIM115 (the job's standard error until its process exits)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    if warm:
        hand_over(snakemake.config, PRELOAD)
    bind_job(snakemake)


def bind_job(snakemake) -> None:
    """Record the job's binding (rule, params, its inputs' sha256) beside every file it writes, so that the results
    check can tell a file of this run from one copied in from another (:mod:`stagereplay.io.bindings`)."""
    from stagereplay.io.bindings import bind_written_files, job_binding, results_root

    run = (snakemake.config or {}).get("run")
    if run:
        bind_written_files(job_binding(snakemake.rule, dict(snakemake.params.items()), list(snakemake.input),
                                       results_root(run)))


@functools.cache
def starts_warm(script: str | os.PathLike) -> bool:
    """Whether the rule script ``script`` starts its job with ``start_job(snakemake, warm=True)`` (its second
    statement, tests/test_rule_scripts.py checks): whether its job runs in the job server. Read once per script: a
    run asks it of each of its jobs."""
    import ast

    try:
        body = ast.parse(open(script).read()).body
    except (OSError, SyntaxError):
        return False
    call = body[1].value if len(body) > 1 and isinstance(body[1], ast.Expr) else None
    return isinstance(call, ast.Call) and getattr(call.func, "id", None) == "start_job" and any(
        k.arg == "warm" and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def start_job_server(config: dict) -> tuple[int, str] | None:
    """Before a run's first job (its ``onstart``, where the jobs run on this machine): start the warm job server of
    :data:`PRELOAD` in the background unless one answers already, so that it imports while the run's first jobs
    (selecting items, preparing the model) run and its model jobs fork from it instead of importing on their own.
    Makes the run's folder of markers (:mod:`stagereplay.runtime.run_markers`) for its jobs. Returns what it did
    and the logging level to say it at, for the run's console: a warning where no server can serve the run's jobs
    (its folder or socket path cannot, its server refused to serve, or the server there does not answer a probe as a job would find it: the
    jobs then run in their own processes at once, none waiting for it); None where the config turns it off."""
    from stagereplay.runtime.hand_over import probe, server_place, start_server
    from stagereplay.runtime.run_markers import first_to_say, note_unanswered, start_run
    from stagereplay.runtime.server_protocol import DEFAULT_IDLE_S, HAND_OVER_TIMEOUT_S

    place = server_place(config, PRELOAD)
    if place is None:
        return None
    start_run()
    key, path, problem = place
    if not problem:
        timeout_s = min(PROBE_TIMEOUT_S, float(config.get("job_server_timeout_s", HAND_OVER_TIMEOUT_S)))
        problem = probe(path, timeout_s)
        if problem is None:
            return logging.INFO, f"job server {key} answers already"
        if problem == "absent":
            problem = start_server(key, float(config.get("job_server_idle_s", DEFAULT_IDLE_S)), PRELOAD)
            if problem is None:
                return logging.INFO, f"job server {key} starting in the background for the model jobs"
        else:
            note_unanswered(key, problem)
    first_to_say(problem)  # said here: the jobs that meet it say it in their logs alone
    return logging.WARNING, f"job server not used, this run's model jobs run in their own processes: {problem}"
