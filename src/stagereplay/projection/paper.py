"""The paper-scale run's per-item count (``project``: the projection ``bench/benchmark.py`` prints from the rates it
measures), and that count split by the rule whose work each part stands for (``project_by_rule``).

Where the rule-by-rule count (:mod:`.jobs`) counts otherwise than ``project()`` (left as it is): in a batch of
several rows, in the lockstep schedule, every construction runs the live schedule, so a prefill cell decodes
S + N - 1 steps less the skip as the others do, besides its one-shot prefill (project() gives it N steps, which holds
at batch 1 and in the suffix schedule only); a step attends over the whole buffer for a masked-attention measure,
over its own position for a triton one (project(bucketed=True) prices bucketed spans, a bucket of one position for
the triton attention); the items fill whole batches, the last one partial (project() prices 200 rows as 200/62
batches at the 62-row rate); the matched experiment runs at every precision, in reconstruct_prefixes and again in
the audit (project() counts it at bf16 only); the bridge's incremental cell, the batch-invariance control, cache
differences, dumps' rebuilds and the divergence onset are counted; and jobs are counted one by one, each with its
overhead and loads.
"""

from __future__ import annotations

from stagereplay.projection.rates import decode_seconds


def project(measures: list[dict], items: int, divergent: float, bucketed: bool = False,
            dumps: str = "none", audit: bool = True, model_jobs: int = 0, job_overhead_s: float = 0.0,
            transplant_specs: int = 1, minimal_budget: int = 0) -> dict:
    """Wall time of the paper-scale experiment from the measured rates, counting the work the pipeline does.

    Per item (P prompt, S stage, N suffix tokens), at every precision: the fixed-prefix 2x2 arm, incremental
    x2 (a P prefill, S teacher-forced steps and N steps each) and prefill x2 (a P+S prefill and N steps each).
    At the primary precision (bf16) besides: the matched experiment's live x2 (a P prefill and S+N steps each;
    its prefill rows are the 2x2's), the bridge (live vs the 2x2's incremental caches: no extra work) and the
    bidirectional all-layer transplants of the divergent items. The transplant stage rebuilds both boundary
    caches in its own process (the incremental one: a P prefill and S steps; the prefill one: a P+S prefill) and
    continues each transplanted cache N steps, in both directions; fp32 had 0 divergences in the study, so none
    there. Dumps are not needed by the transplants: ``dumps="divergent"`` adds writing both caches of every
    divergent item (the pipeline's ``dump: {items: divergent}``; at paper scale about 150 GB), ``"none"`` does not.
    ``audit`` counts the saved-ledger audit, which recomputes one replica of every ledger row: the 2x2 at every
    precision and the matched experiment at bf16 (first counted 2026-12-01: left out, it made the projection
    short by about a third of the ledger work). ``model_jobs`` x ``job_overhead_s`` counts each model job's start,
    imports and model load (measured on the workflow by bench/pipeline_run.py: about 15 s a job at the 0.5B shape).

    Transplants (counted in full from 2026-12-01; before, one all-layer run without the stage's rebuild):
    ``transplant_specs`` is the transplant runs per direction the sweeps ask for (1: the all-layer one alone, as
    the study ran; the default config's sweeps are 11) and ``minimal_budget`` the minimal-transplant search's runs
    per direction (0: off; the default is 24; the searches of a batch's rows run in lockstep, so a batch takes
    at most the budget's rounds, counted in full). Each stage first rebuilds both constructions of a batch with
    their suffixes (one 2x2 cell); each run, both directions, is one more cell (the recipient rebuilt, edited and
    continued N steps), decoded once for all the batch's transplanted rows, in every batch that holds a
    divergent row (a share ``1 - (1 - divergent) ** rows`` of the batches).
    """
    if dumps not in ("none", "divergent"):
        raise ValueError(f"dumps {dumps!r}: none or divergent")
    total = 0.0
    parts = {}
    for m in measures:
        P, S, N = m["P"], m["S"], m["N"]
        steps = 2 * (S + N) + 2 * N
        # one incremental row (S teacher-forced steps then N) and one prefill row (N steps after a P+S prefill)
        cell = decode_seconds(m, P, S + N, bucketed) + decode_seconds(m, P + S - 1, N, bucketed)
        per_item = 2 * cell
        prefill_tokens = items * (2 * (P + S) + 2 * P)
        dumped = 0.0
        if m["precision"] == "bf16":
            batches_with_divergent = 1 - (1 - divergent) ** m["rows"]  # a batch is decoded if one row is divergent
            # the transplant stages: each rebuilds both constructions of its batches (one 2x2 cell, suffixes
            # included), then every run is one more cell: the incremental recipient, the prefill recipient
            moved = batches_with_divergent * (1 + transplant_specs + (1 + minimal_budget if minimal_budget else 0))
            steps += 2 * (S + N) + moved * ((S + N) + N)
            per_item += 2 * decode_seconds(m, P, S + N, bucketed) + moved * cell  # matched live x2, transplants
            prefill_tokens += items * (2 * P + moved * (P + (P + S)))
            dumped = 2 * divergent if dumps == "divergent" else 0.0
        if audit:  # one replica of each construction the ledger holds at this precision
            cells = 2 if m["precision"] == "bf16" else 1  # the 2x2's two, plus the matched experiment's at bf16
            steps += cells * ((S + N) + N)
            per_item += cells * cell
            prefill_tokens += items * cells * (P + (P + S))
        decode_s = items * per_item
        prefill_s = prefill_tokens / m["prefill_tokens_s"]
        dump_s = items * dumped * m["dump_GB"] / m["dump_GB_s"]
        parts[m["precision"]] = {"decode_s": decode_s, "prefill_s": prefill_s, "dump_s": dump_s,
                                 "decode_steps_per_item": steps, "prefill_tokens": prefill_tokens}
        if "linear_params" in m:  # the linear maps alone, every row-step and prefill token at the best GEMM rate
            flops = 2 * m["linear_params"] * (items * steps + prefill_tokens)
            parts[m["precision"]]["linear_floor_s"] = flops / (m["gemm_TFLOP_s_large"] * 1e12)
        total += decode_s + prefill_s + dump_s
    overhead = model_jobs * job_overhead_s
    total += overhead
    fit = measures[0]["step_fit"]
    described = (("exact span (triton attention)" if fit["bucket"] == 1 else
                  f"span bucketed by {fit['bucket']} positions") if bucketed else "whole buffer")
    return {"items": items, "divergent_fraction": divergent, "total_s": total, "parts": parts,
            "attention": described, "dumps": dumps, "audit": audit, "job_overhead_s": overhead,
            "transplant_specs": transplant_specs, "minimal_budget": minimal_budget}


def project_by_rule(measures: list[dict], items: int, divergent: float, transplant_specs: int = 1,
                    minimal_budget: int = 0, model_jobs: int = 0, job_overhead_s: float = 0.0) -> dict:
    """``project(bucketed=True)``'s count and pricing, split by the rule whose work each part stands for
    (its total is project()'s ``total_s``): {rule: seconds}, the job overhead under "job overhead". project() counts
    per item at the measure's P, S, N: the 2x2 at every precision (generate_fixed_prefix), the matched experiment's
    live x2 at bf16 only (reconstruct_prefixes; its prefill rows taken to be the 2x2's), the audit (2 cells at
    bf16, 1 at fp32), and at bf16 the transplants in a share 1 - (1 - divergent) ** rows of the items' batches
    (transplant_caches: the rebuild and a cell per spec; find_minimal_transplants: the rebuild and a cell per run
    of the budget). A cell: incremental (S + N steps from P, a P prefill) and prefill (N steps from P + S - 1, a
    P + S prefill)."""
    rules = {}
    for m in measures:
        P, S, N, precision = m["P"], m["S"], m["N"], m["precision"]

        def put(rule, decode_s, tokens):
            rules[rule] = rules.get(rule, 0.0) + items * decode_s + items * tokens / m["prefill_tokens_s"]

        cell = decode_seconds(m, P, S + N, True) + decode_seconds(m, P + S - 1, N, True)
        cell_tokens = P + (P + S)
        put("generate_fixed_prefix", 2 * cell, 2 * (P + S) + 2 * P)
        if precision == "bf16":
            share = 1 - (1 - divergent) ** m["rows"]
            put("reconstruct_prefixes", 2 * decode_seconds(m, P, S + N, True), 2 * P)
            put("transplant_caches", share * (1 + transplant_specs) * cell,
                share * (1 + transplant_specs) * cell_tokens)
            if minimal_budget:
                put("find_minimal_transplants", share * (1 + minimal_budget) * cell,
                    share * (1 + minimal_budget) * cell_tokens)
        cells = 2 if precision == "bf16" else 1
        put("audit_ledger", cells * cell, cells * cell_tokens)
    rules["job overhead"] = model_jobs * job_overhead_s
    return rules
