"""A job's work in seconds at the measured rates: every model job's wall time is its overhead plus the work it
decodes (:mod:`.jobs`), priced as

- batched decode steps at a row count, at the measure's a + b * span for that precision and row count
  (``rates.decode_seconds``): for a measure of the masked attention every step at the decoder's whole buffer L
  (``decode_max_len``: the masked attention reads every buffer position at every step); for a measure of the
  triton attention (its ``step_fit`` bucket is 1: each row's keys up to its position) each step at its own
  position, summed over a cell's steps from the cache length it starts at (a row count measured at neither: the
  fit interpolated linearly in the rows between the two measured row counts around it);
- one-shot prefill tokens, at the measure's ``prefill_tokens_s``;
- cache-dump GB, at the measure's ``dump_GB_s``;
- and, where the overhead gives their rates (``rates.Overhead.from_json``), the greedy loop's host work per decode
  step (the greedy choice and its device sync), the boundary matcher's text decode per live row and stage step,
  and the sha256 fingerprints of every row's boundary cache (P + S - 1 positions; with the snapshot's copy rate,
  the copy on the decode's stream and only the hashing beyond the decode: :func:`fingerprint_seconds`). In the
  ``cuda_graph`` regime the loop's lookahead runs the host's checks of a step while the device runs the next, so
  of the greedy and matcher work only what exceeds the device's decode time is counted (for a run that records
  ``greedy_loop``, the loop it ran; a run not made, the package's loop now, ``shape.GREEDY_LOOP``).
"""

from __future__ import annotations

from stagereplay.projection.counts import Work
from stagereplay.projection.jobs import JobWork, model_jobs
from stagereplay.projection.rates import Overhead, Rates, by_position, step_seconds, steps_seconds
from stagereplay.projection.shape import RunShape


def price(work: Work, precision: str, shape: RunShape, rates: Rates, lookahead: bool = True) -> dict:
    """Seconds of one precision's work, by part. A decode step is priced at the measure for its rows: at the whole
    buffer (``shape.span``) for a measure of the masked attention, at its own position for one of the triton
    attention (``by_position``)."""
    steps = {rows: count for rows, count in work.steps.items() if count}
    decode = 0.0
    for rows, count in steps.items():
        m = rates.step_measure(precision, rows)
        if by_position(m):
            decode += sum(times * steps_seconds(m, start, n, shape.span)
                          for (r, start, n), times in work.segments.items() if r == rows and n and times)
        else:
            decode += count * step_seconds(m, shape.span)
    host = sum(count * rates.overhead.greedy(rows) for rows, count in steps.items())
    host += work.matcher_row_steps * rates.overhead.matcher_s_per_row_step
    if shape.lookahead and lookahead:
        # the greedy loop's lookahead: the host checks a step while the device runs the next one, so only host work
        # beyond the device's is left (counted in aggregate, a lower bound of the step-by-step excess)
        host = max(0.0, host - decode)
    measure = rates.nearest(precision, shape.rows)  # its prefill and dump rates
    fingerprint_GB = work.boundary_rows * shape.boundary_positions * rates.kv_GB_per_position(precision)
    fingerprint = fingerprint_seconds(fingerprint_GB, decode, rates.overhead)
    out = {"decode_s": decode, "prefill_s": work.prefill_tokens / measure["prefill_tokens_s"],
           "dump_s": work.dump_GB / measure["dump_GB_s"], "host_s": host, "fingerprint_s": fingerprint}
    if work.observed_row_steps or work.compared_row_steps:  # measure_fidelity's logits kept and compared
        out["fidelity_s"] = (work.observed_row_steps * rates.overhead.observe_s_per_row_step
                             + work.compared_row_steps * rates.overhead.compare_s_per_row_step)
    return out


def fingerprint_seconds(GB: float, decode_s: float, overhead: Overhead) -> float:
    """The boundary caches' fingerprints of a job's ``GB``: hashed in turn at ``fingerprint_GB_s``; or, where the
    overhead gives the snapshot's copy rate (a GPU job's pending fingerprints), that copy on the decode's stream
    plus only the hashing beyond the job's ``decode_s`` (the hashing runs beside the decode; counted in aggregate,
    as the lookahead's host work is)."""
    if not overhead.fingerprint_GB_s:
        return 0.0
    hashing = GB / overhead.fingerprint_GB_s
    if not overhead.fingerprint_copy_GB_s:
        return hashing
    return GB / overhead.fingerprint_copy_GB_s + max(0.0, hashing - decode_s)


def job_seconds(job: JobWork, shape: RunShape, rates: Rates) -> dict:
    parts = {"overhead_s": rates.overhead.of_job(job.loads)}
    for precision, work in job.work.items():
        for part, seconds in price(work, precision, shape, rates, job.lookahead).items():
            parts[part] = parts.get(part, 0.0) + seconds
    return {"s": sum(parts.values()), **parts}


def rates_for(shape: RunShape, measures: list[dict], overhead: Overhead, measures_batch1: list[dict] | None) -> Rates:
    """The rates, with a note where a measure's attention is not the config's."""
    rates = Rates(measures + (measures_batch1 or []), overhead, shape.warnings)
    if shape.lockstep and not measures_batch1:
        shape.warnings.append("no --measures-batch1: the batch-invariance control's batch-1 steps are priced at "
                              "the batch measure's step")
    attention, kernels = shape.config["decode_attention"], shape.config["decode_kernels"]
    for (precision, rows), m in sorted(rates.by.items()):
        if m.get("decode_kernels", "library") != kernels:
            shape.warnings.append(f"the {precision} {rows}-row measure is of decode_kernels "
                                  f"{m.get('decode_kernels', 'library')}, the config's is {kernels}")
        if by_position(m) != (attention == "triton"):
            shape.warnings.append(
                f"the {precision} {rows}-row measure is of the {'triton' if by_position(m) else 'masked'} attention, "
                f"the config's is {attention}: its steps priced " + ("each at its position" if by_position(m) else
                                                                     "at the whole buffer"))
    return rates


def projected_rules(shape: RunShape, rates: Rates) -> tuple[dict, list[JobWork]]:
    """{rule: jobs, projected seconds and their parts} and the jobs."""
    jobs = model_jobs(shape, {p: rates.kv_GB_per_position(p) for p in shape.precisions}, rates.vocab)
    rules = {}
    for job in jobs:
        priced = job_seconds(job, shape, rates)
        job.seconds = priced["s"]
        rule = rules.setdefault(job.rule, {"jobs_projected": 0, "projected_s": 0.0, "parts": {}})
        rule["jobs_projected"] += 1
        rule["projected_s"] += priced["s"]
        if job.logits_GB:
            rule["peak_logits_GB"] = max(rule.get("peak_logits_GB", 0.0), job.logits_GB)
        for part, seconds in priced.items():
            if part != "s":
                rule["parts"][part] = rule["parts"].get(part, 0.0) + seconds
    if "measure_fidelity" in rules:
        o, r = rates.overhead, rules["measure_fidelity"]
        note = (f"measure_fidelity: its loop observes every step (lookahead off: the greedy host work counted whole); "
                f"the logits kept priced at {o.observe_s_per_row_step * 1e6:.1f} us a row-step, the comparison at "
                f"{o.compare_s_per_row_step * 1e6:.1f} us a compared row-step ({r['parts'].get('fidelity_s', 0):.1f} s "
                f"in all; rates assumed, not measured on the device, unless --overhead-json gives them); its peak "
                f"fp32 logits on the device {r.get('peak_logits_GB', 0):.1f} GB a job (vocabulary {rates.vocab}), "
                "beside the weights and the cache: not checked against the device's memory")
        shape.warnings.append(note)
    return rules, jobs


def arm_counts(jobs: list[JobWork], shape: RunShape, rates: Rates) -> dict:
    """Per precision, the work the jobs decode as ``floor.work_floor`` counts it (row-steps, batched steps, K/V
    positions read by each row up to its position, prefill tokens) and its projected GPU seconds (decode and
    prefill)."""
    out = {}
    for job in jobs:
        for precision, work in job.work.items():
            arm = out.setdefault(precision, {"row_steps": 0.0, "batch_steps": 0.0, "kv_row_positions": 0.0,
                                             "prefill_tokens": 0.0, "projected_s": 0.0})
            for (rows, start, count), times in work.segments.items():
                arm["row_steps"] += times * rows * count
                arm["batch_steps"] += times * count
                arm["kv_row_positions"] += times * rows * (count * start + count * (count + 1) / 2)
            arm["prefill_tokens"] += work.prefill_tokens
            priced = price(work, precision, shape, rates)
            arm["projected_s"] += priced["decode_s"] + priced["prefill_s"]
    return out
