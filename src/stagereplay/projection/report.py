"""A measured run against its projection (``compare``), a run not made projected (``project_config``), and their
tables.

A measured run: per rule its jobs, measured and projected seconds and their ratio. The run's wall, with
``--resources gpu=1`` and every model job claiming the GPU (``gpus_per_job: 1``): the model jobs run one after
another, so the wall is the sum of their projected times plus the time the run spends with no model job running,
taken as measured (not projected): from the Snakemake log where the run recorded its jobs' start and end
(``log_jobs``: Snakemake's start, select_items and prepare_model before the first model job, gather_ledger between
the 2x2 and the audit, the reports after the last, and whatever else ran alone), else the benchmarked non-model jobs
before the first model job and after the last. Where model jobs could share the device (another ``--gpu-slots``,
``gpus_per_job: 0``), the wall is not compared.

A run not made: each model job priced alike; the wall for one GPU is the model jobs one after another plus
``non_model_s``, a stated constant for the jobs that load no model (0: not counted). Where the measures carry the
shape's linear parameters and the copy rate is given, the report gives the floor of the same work
(``floor.work_floor``: ``floor.run_floor``'s pricing of these counts).

Not projected (reported with their measured times): the rules that load no model, select_items, gather_ledger,
gather_bridge, gather_audit, check_audit, gather_transplant_baseline, select_transplant_items, plot_figures,
build_report, build_item_browser, and prepare_model (it loads the model source once per precision, but claims no GPU and runs before every model job).
"""

from __future__ import annotations

import math

from stagereplay.projection.floor import work_floor
from stagereplay.projection.pricing import arm_counts, projected_rules, rates_for
from stagereplay.projection.rates import Overhead
from stagereplay.projection.shape import RunShape, run_shape

BEFORE_MODEL_JOBS = ("select_items", "prepare_model")  # run side by side before the first model job
# after the last model job: the longer of plot_figures and build_item_browser, then build_report
AFTER_MODEL_JOBS = (("plot_figures", "build_item_browser"), ("build_report",))


def job_rule_times(run: dict) -> dict:
    """{rule: [job seconds]} (each job's own where the run recorded them, else the rule's mean per job)."""
    if run.get("job_times"):
        out = {}
        for job in run["job_times"]:
            out.setdefault(job["rule"], []).append(job["s"])
        return out
    return {rule: [r["s"] / r["jobs"]] * r["jobs"] for rule, r in run["rules"].items()}


def time_without_model_jobs(run: dict, model_rules: set) -> dict:
    """Measured seconds of the run's wall with no model job running: from the Snakemake log where the run recorded
    its jobs' times (Snakemake's start, the gathers, checks and reports between and after the model jobs; stamps to
    the second), else the benchmarked non-model jobs before the first model job and after the last."""
    intervals = sorted((j["start_s"], j["end_s"]) for j in run.get("log_jobs") or [] if j["rule"] in model_rules)
    if intervals and run.get("wall_s"):
        covered, end = 0.0, -math.inf
        for start, stop in intervals:
            covered += max(0.0, stop - max(start, end))
            end = max(end, stop)
        return {"non_model_s": run["wall_s"] - covered, "from": "the Snakemake log"}
    jobs = job_rule_times(run)
    before = max((s for rule in BEFORE_MODEL_JOBS for s in jobs.get(rule, [])), default=0.0)
    after = sum(max((sum(jobs.get(rule, [])) for rule in group), default=0.0) for group in AFTER_MODEL_JOBS)
    return {"non_model_s": before + after, "from": "benchmark files (the longest of select_items and prepare_model "
            "before, plot_figures or build_item_browser and build_report after; the gathers and checks left out)"}


def compare(run: dict, measures: list[dict], overhead: Overhead, measures_batch1: list[dict] | None = None) -> dict:
    """Per rule: jobs, measured and projected seconds, their ratio; the model jobs' total and the run's wall."""
    shape = run_shape(run)
    rates = rates_for(shape, measures, overhead, measures_batch1)
    rules, _ = projected_rules(shape, rates)
    measured = run.get("rules", {})
    for name, rule in rules.items():
        got = measured.get(name)
        rule["status"] = "compared" if got else "absent from the run"
        rule["jobs_measured"] = got["jobs"] if got else 0
        rule["measured_s"] = got["s"] if got else None
        rule["ratio"] = rule["projected_s"] / got["s"] if got and got["s"] else None
    for name, got in measured.items():
        if name not in rules:
            rules[name] = {"status": "not projected", "jobs_measured": got["jobs"], "measured_s": got["s"],
                           "jobs_projected": None, "projected_s": None, "ratio": None}
    compared = [r for r in rules.values() if r["status"] == "compared"]
    model = {"measured_s": sum(r["measured_s"] for r in compared),
             "projected_s": sum(r["projected_s"] for r in compared)}
    model["relative_error"] = model["projected_s"] / model["measured_s"] - 1 if model["measured_s"] else None
    absent = sorted(name for name, r in rules.items() if r["status"] == "absent from the run")
    return {"rules": rules, "model_jobs": model, "absent_rules": absent, "wall": wall(run, shape, rules),
            "sources": shape.sources, "warnings": shape.warnings,
            "shape": {k: getattr(shape, k) for k in ("n", "rows", "batches", "P", "S", "N", "W", "S_b", "N_b", "span",
                                                     "schedule")},
            "overhead": {"start_s": overhead.start_s, "load_s": overhead.load_s,
                         "first_load_extra_s": overhead.first_load_extra_s}}


def wall(run: dict, shape: RunShape, rules: dict) -> dict:
    """The run's wall against the projected model jobs one after another plus its measured time without them."""
    one_at_a_time = run.get("gpu_slots") == 1 and shape.config.get("gpus_per_job", 0) >= 1
    model_rules = {name for name, r in rules.items() if r.get("projected_s") is not None}
    outside = time_without_model_jobs(run, model_rules)
    projected = sum(rules[name]["projected_s"] for name in model_rules)
    measured_model = sum(rules[name]["measured_s"] or 0.0 for name in model_rules)
    out = {"measured_s": run.get("wall_s"), "predicted_s": projected + outside["non_model_s"], **outside,
           "status": run.get("status"), "model_jobs_one_at_a_time": one_at_a_time,
           # about 0 when the model jobs ran one at a time (up to the log's one-second stamps)
           "residual_s": (run["wall_s"] - measured_model - outside["non_model_s"]) if run.get("wall_s") else None}
    out["relative_error"] = None
    if not one_at_a_time:
        out["why_not_compared"] = "model jobs could share the device (gpu_slots != 1 or gpus_per_job 0)"
    elif run.get("status") != "complete" or not run.get("wall_s"):
        out["why_not_compared"] = f"the run did not complete ({run.get('status')})"
    else:
        out["relative_error"] = out["predicted_s"] / run["wall_s"] - 1
    return out


def render(report: dict) -> str:
    def s(x):
        return "-" if x is None else f"{x:.1f}"

    lines = [f"{'rule':<28} {'jobs':>9} {'measured s':>11} {'projected s':>12} {'ratio':>6} {'overhead s':>11} "
             f"{'work s':>8}  status"]
    order = sorted(report["rules"].items(), key=lambda kv: -(kv[1]["measured_s"] or kv[1]["projected_s"] or 0))
    for name, r in order:
        jobs = f"{r['jobs_measured']}/{'-' if r['jobs_projected'] is None else r['jobs_projected']}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        overhead = r.get("parts", {}).get("overhead_s")
        work = None if overhead is None else r["projected_s"] - overhead
        lines.append(f"{name:<28} {jobs:>9} {s(r['measured_s']):>11} {s(r['projected_s']):>12} {ratio:>6} "
                     f"{s(overhead):>11} {s(work):>8}  {r['status']}")
    m = report["model_jobs"]
    err = "-" if m["relative_error"] is None else f"{m['relative_error']:+.1%}"
    lines += ["", f"model jobs (rules in both): measured {s(m['measured_s'])} s, projected {s(m['projected_s'])} s, "
              f"relative error {err}"]
    w = report["wall"]
    werr = "-" if w["relative_error"] is None else f"{w['relative_error']:+.1%}"
    lines.append(f"wall: measured {s(w['measured_s'])} s, predicted {s(w['predicted_s'])} s (model jobs one after "
                 f"another + {s(w['non_model_s'])} s measured without a model job running, from {w['from']}), "
                 f"relative error {werr}" + (f" ({w['why_not_compared']})" if w.get("why_not_compared") else "")
                 + (f"; residual {s(w['residual_s'])} s" if w["residual_s"] is not None else ""))
    lines.append(f"schedule: {report['shape']['schedule']}")
    if report["absent_rules"]:
        lines.append(f"absent from the run: {', '.join(report['absent_rules'])}")
    derived = sorted(k for k, v in report["sources"].items() if v == "derived")
    read = sorted(k for k, v in report["sources"].items() if v == "read")
    lines.append(f"counts read from the run: {', '.join(read) or 'none'}")
    lines.append(f"counts derived: {', '.join(derived) or 'none'}")
    lines += [f"note: {w}" for w in report["warnings"]]
    lines.append("jobs: measured/projected; not projected: rules that load no model (and prepare_model), measured "
                 "only")
    return "\n".join(lines)


def project_config(run: dict, measures: list[dict], overhead: Overhead, measures_batch1: list[dict] | None = None,
                   non_model_s: float = 0.0, copy_TB_s: float | None = None) -> dict:
    """Each rule of a run not made (``config_run``), projected: jobs, seconds and their parts; the model jobs one
    after another plus ``non_model_s`` (a stated constant for the jobs that load no model: 0 leaves them out); the
    floor of the same work at the datasheet rates (``floor.work_floor``) where ``copy_TB_s`` is given, and each
    rule's own (``floor_s``: its decode and prefill alone, its precisions' arms in turn; no start-up, host work or
    dumps), the least any schedule of that rule's work could take on this GPU."""
    shape = run_shape(run)
    if shape.S > shape.config["max_stage_tokens"] or shape.N > shape.config["max_new_tokens"]:
        shape.warnings.append(f"the lengths (stage {shape.S}, suffix {shape.N}) exceed the config's budgets "
                              f"(max_stage_tokens {shape.config['max_stage_tokens']}, max_new_tokens "
                              f"{shape.config['max_new_tokens']})")
    rates = rates_for(shape, measures, overhead, measures_batch1)
    rules, jobs = projected_rules(shape, rates)
    shape.sources.update({name: "given" for name in ("num_layers", "batch_width", "batch_stage",
                                                     "batch_stage_shortest", "batch_suffix")})
    model_s = sum(r["projected_s"] for r in rules.values())
    report = {"rules": rules, "model_jobs": {"jobs": len(jobs), "projected_s": model_s},
              "wall": {"model_jobs_s": model_s, "non_model_s": non_model_s, "predicted_s": model_s + non_model_s,
                       "counted": "the model jobs one after another (one GPU, every model job claiming it) plus "
                                  "non_model_s for the rules that load no model (prepare_model, the gathers, checks "
                                  "and reports)"},
              "arms": arm_counts(jobs, shape, rates), "sources": shape.sources, "warnings": shape.warnings,
              "shape": {k: getattr(shape, k) for k in ("n", "rows", "batches", "P", "S", "N", "W", "S_b", "N_b",
                                                       "span", "schedule")},
              "batches_by_rows": shape.kinds(),
              "overhead": {"start_s": overhead.start_s, "load_s": overhead.load_s,
                           "first_load_extra_s": overhead.first_load_extra_s,
                           "fingerprint_GB_s": overhead.fingerprint_GB_s,
                           "fingerprint_copy_GB_s": overhead.fingerprint_copy_GB_s}}
    if copy_TB_s and all("linear_params" in m for m in measures):
        report["floor"] = work_floor(report["arms"], measures, copy_TB_s)
        for name, rule_jobs in _by_rule(jobs).items():  # each rule's own work, its arms in turn
            rules[name]["floor_s"] = work_floor(arm_counts(rule_jobs, shape, rates), measures,
                                                copy_TB_s)["floor_arms_in_turn_s"]
    return report


def _by_rule(jobs: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for job in jobs:
        out.setdefault(job.rule, []).append(job)
    return out


def render_projection(report: dict, old: dict | None = None) -> str:
    """The rule-by-rule projection of a run not made (minutes), with project()'s split of the same run where given."""
    def mins(x):
        return "-" if x is None else f"{x / 60:.1f}"

    floors = any("floor_s" in r for r in report["rules"].values())
    head = (f"{'rule':<28} {'jobs':>4} {'overhead':>9} {'decode':>8} {'prefill':>8} {'host+fp':>8} {'dump':>6} "
            f"{'total':>8}" + (f" {'floor':>7}" if floors else ""))
    names = list(report["rules"])
    if old:
        head += "".join(f" {label[:14]:>14}" for label in old)
        for table in old.values():
            names += [n for n in table if n not in names]
    lines = [head + "   (minutes)"]
    if old:
        lines.insert(0, "last columns: benchmark.project(bucketed=True) of the same variant, split by rule, on "
                     + ", ".join(old))
    for name in names:
        r = report["rules"].get(name)
        parts = r["parts"] if r else {}
        row = (f"{name:<28} {r['jobs_projected'] if r else '-':>4} {mins(parts.get('overhead_s')):>9} "
               f"{mins(parts.get('decode_s')):>8} {mins(parts.get('prefill_s')):>8} "
               f"{mins((parts.get('host_s', 0) + parts.get('fingerprint_s', 0)) if r else None):>8} "
               f"{mins(parts.get('dump_s')):>6} {mins(r['projected_s'] if r else None):>8}")
        if floors:
            row += f" {mins(r.get('floor_s') if r else None):>7}"
        if old:
            row += "".join(f" {mins(table.get(name)):>14}" for table in old.values())
        lines.append(row)
    m = report["model_jobs"]
    total = f"{'model jobs':<28} {m['jobs']:>4} {'':>9} {'':>8} {'':>8} {'':>8} {'':>6} {mins(m['projected_s']):>8}"
    if floors:
        total += f" {'':>7}"
    if old:
        total += "".join(f" {mins(sum(table.values())):>14}" for table in old.values())
    lines.append(total)
    w = report["wall"]
    lines.append(f"wall, one GPU: {w['predicted_s'] / 3600:.2f} h = model jobs one after another "
                 f"{w['model_jobs_s'] / 3600:.2f} h + {w['non_model_s']:.0f} s stated for the jobs that load no model")
    for precision, arm in report["arms"].items():
        lines.append(f"{precision}: {arm['row_steps'] / 1e6:.2f} M decode row-steps in "
                     f"{arm['batch_steps'] / 1e3:.1f} k "
                     f"batched steps, {arm['prefill_tokens'] / 1e6:.2f} M prefill tokens; GPU work projected "
                     f"{mins(arm['projected_s'])} min")
    if report.get("floor"):
        f = report["floor"]
        lines.append(f"floor of this work (datasheet rates): {mins(f['floor_s'])} min with the arms overlapped "
                     f"(arithmetic {mins(f['arithmetic_s'])}, traffic {mins(f['traffic_s'])} at "
                     f"{f['memory_TB_s']} TB/s), {mins(f['floor_arms_in_turn_s'])} min with the arms in turn; "
                     f"projected GPU work {mins(f['projected_gpu_s'])} min")
    derived = sorted(k for k, v in report["sources"].items() if v == "derived")
    lines.append(f"counts derived from the config: {', '.join(derived) or 'none'}")
    lines += [f"note: {w}" for w in report["warnings"]]
    return "\n".join(lines)


def render_gpus(rows: list[dict], schedule: str) -> str:
    lines = [f"on N GPUs ({schedule} schedule; shards = N unless --shards; the jobs placed by a list scheduler):",
             f"{'GPUs':>5} {'shards':>6} {'jobs':>5} {'at once':>7} {'model jobs h':>12} {'wall h':>7} "
             f"{'critical path h':>15} {'work / GPUs h':>13} {'busy':>5}"]
    for r in rows:
        lines.append(f"{r['gpus']:>5} {r['shards']:>6} {r['jobs']:>5} {r['jobs_at_once']:>7} "
                     f"{r['model_jobs_s'] / 3600:>12.2f} {r['wall_s'] / 3600:>7.2f} {r['critical_path_s'] / 3600:>15.2f} "
                     f"{r['work_s'] / r['jobs_at_once'] / 3600:>13.2f} "
                     f"{'-' if r['busy'] is None else format(r['busy'], '.0%'):>5}")
    return "\n".join(lines)
