"""How every rule script starts: ``start_job(snakemake)`` is its first statement (tests/test_rule_scripts.py checks
each one). It sends the job's standard error to the rule's log, logs to it at INFO, and for the rules that import
the model or analysis stack (``warm=True``) hands the job over to a warm job server
(:mod:`stagereplay.runtime.hand_over`, :mod:`stagereplay.runtime.job_server`) that has imported :data:`PRELOAD`.

Imports nothing heavy itself: a table job that starts with it imports no torch (tests/test_job_imports.py).
"""

from __future__ import annotations

import logging
import os
import sys

from stagereplay.runtime.hand_over import hand_over
from stagereplay.runtime.server_protocol import CHILD_ENV

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
    and this process exits with the child's status; else the job runs on in this process, its log saying why.

    The job's process empties the log and both it and a child forked for it append to it, so neither writes over
    the other's lines."""
    log_file = snakemake.log[0]
    if not os.environ.get(CHILD_ENV):
        open(log_file, "w").close()
    sys.stderr = open(log_file, "a")  # noqa: SIM115 (the job's standard error until its process exits)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    if warm:
        hand_over(snakemake.config, PRELOAD)
