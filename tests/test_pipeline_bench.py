"""bench/pipeline_run.py: the config it writes is one the workflow accepts, and it reads the rules' benchmark
files into per-rule times (the whole run it measures is a GPU benchmark, recorded in bench/RESULTS.md)."""

import argparse
import json
from pathlib import Path

import yaml
from snakemake.utils import validate

from bench_scripts import load_bench

from stagereplay.config import schema_file
from stagereplay.projection.floor import fp32_floor
from stagereplay.projection.jobs import model_jobs
from stagereplay.projection.paper import project
from stagereplay.projection.rates import Overhead, decode_seconds
from stagereplay.projection.report import compare
from stagereplay.projection.shape import batches_holding, run_shape

REPO = Path(__file__).resolve().parents[1]
pipeline_run = load_bench("pipeline_run")


def test_the_written_config_is_valid_and_has_the_asked_scale(tmp_path):
    args = argparse.Namespace(items=48, stage=256, suffix=128, precisions=["bf16", "fp32"], shards=1,
                              numerics="default", batch_size=16, regime="cuda_graph", transplant_select="sample:8",
                              minimal_budget=8, device="cuda")
    cfg = yaml.safe_load(pipeline_run.write_config(tmp_path, args).read_text())
    validate(cfg, schema_file(), set_default=True)
    assert cfg["n_items"] == 48 and cfg["max_new_tokens"] == 128 and cfg["boundary"]["occurrence"] == 256
    assert cfg["max_stage_tokens"] > 256  # room to reach the 256th filler
    assert cfg["transplant"]["select"] == "sample:8" and cfg["transplant"]["minimal"]["budget"] == 8
    assert cfg["decode_regime"] == "cuda_graph" and cfg["batch_size"] == 16
    assert cfg["device"] == "auto" and cfg["gpus_per_job"] == 1  # so that --resources gpu=K lets K jobs share it
    args.device = "cpu"
    on_cpu = yaml.safe_load(pipeline_run.write_config(tmp_path, args).read_text())
    assert on_cpu["device"] == "cpu" and on_cpu["gpus_per_job"] == 0


def test_benchmark_files_are_summed_by_rule(tmp_path):
    header = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
    files = {"run/primary/reconstruct_prefixes_bf16_0.tsv": (10.0, 9.0),
             "run/primary/reconstruct_prefixes_fp32_1.tsv": (12.0, 11.0),
             "run/primary/transplant_caches.tsv": (5.0, 4.0), "run/select_items.tsv": (1.5, 1.0)}
    for name, (s, cpu) in files.items():
        path = tmp_path / "benchmarks" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(header + f"{s}\t0:00:{int(s):02d}\t1\t1\t1\t1\t0\t0\t1\t{cpu}\n")
    jobs = pipeline_run.rule_times(tmp_path)
    by_rule = jobs.groupby("rule")["s"].sum().to_dict()
    assert by_rule == {"reconstruct_prefixes": 22.0, "transplant_caches": 5.0, "select_items": 1.5}
    assert jobs["cpu_s"].sum() == 25.0
    assert pipeline_run.rule_times(tmp_path / "nothing").empty
    assert json.dumps(pipeline_run.ledger_lengths(tmp_path)) == "{}"  # no ledger yet


def test_the_projection_counts_every_transplant_run_as_a_cell_of_the_batch():
    """Each transplant run (both directions) decodes the recipient's batch once: one more 2x2 cell per item, in
    every batch holding a divergent row; fp32 runs no transplants."""
    measures = json.loads((REPO / "bench/runs/h200_run7_projection_shared_rows.json").read_text())["projection"]
    bf16 = next(m for m in measures if m["precision"] == "bf16")
    cell = decode_seconds(bf16, bf16["P"], bf16["S"] + bf16["N"], True) + decode_seconds(
        bf16, bf16["P"] + bf16["S"] - 1, bf16["N"], True)
    one = project(measures, 200, 0.5, bucketed=True)
    sweeps = project(measures, 200, 0.5, bucketed=True, transplant_specs=11)
    searched = project(measures, 200, 0.5, bucketed=True, transplant_specs=11, minimal_budget=24)
    share = 1 - 0.5 ** bf16["rows"]
    assert abs(sweeps["parts"]["bf16"]["decode_s"] - one["parts"]["bf16"]["decode_s"] - 200 * share * 10 * cell) < 1e-6
    # the minimal search's stage rebuilds its batches too: its budget plus one cell
    assert abs(searched["parts"]["bf16"]["decode_s"] - sweeps["parts"]["bf16"]["decode_s"]
               - 200 * share * 25 * cell) < 1e-6
    assert searched["parts"]["fp32"] == one["parts"]["fp32"]


def test_the_fp32_floor_counts_the_projected_work_at_the_datasheet_rate():
    saved = json.loads((REPO / "bench/runs/h200_run7_projection_shared_rows.json").read_text())
    floor = fp32_floor(saved["projection"], 200, 166 / 200, saved["meta"]["copy_TB_s"])
    assert set(floor) == {"fp32"}
    arm = floor["fp32"]
    assert arm["floor_s"] == arm["linear_at_peak_s"] + arm["attention_at_copy_rate_s"]
    # the datasheet's 67 TFLOP/s is above the best GEMM rate measured (47.6), so its linear floor is lower
    assert arm["linear_at_peak_s"] < arm["linear_at_best_measured_s"]
    assert 0 < arm["share_of_floor"] < 1 and arm["projected_s"] > arm["floor_s"]


# ---- stagereplay.projection: each rule of a workflow run projected from measured rates -----------------------------
cli = load_bench("pipeline_projection")  # bench/pipeline_projection.py: the command line
P, S, N = 10, 20, 8  # the ledger's mean prompt, stage and suffix


def _measure(precision, rows, step_s):
    """A measure of bench/benchmark.py's layout: a step of ``step_s`` at every span (b = 0)."""
    return {"precision": precision, "rows": rows, "max_len": 64, "kv_GB_per_row": 64e-6,
            "step_fit": {"a_s": step_s, "b_s_per_position": 0.0, "bucket": 16}, "step_s": step_s,
            "prefill_tokens_s": 1000.0, "dump_GB": 1e-3, "dump_GB_s": 1.0}


MEASURES = [_measure("bf16", 4, 0.01), _measure("fp32", 4, 0.03)]
MEASURES_BATCH1 = [_measure("bf16", 1, 0.008), _measure("fp32", 1, 0.02)]


def _run(n_items=8, batch_size=4, sample=2, bridge_rows=0, counts=None, rules=None, schedule="lockstep", **config):
    return {**({"schedule": schedule} if schedule else {}), "status": "complete", "wall_s": 100.0, "gpu_slots": 1,
            "config": {"run": "bench", "n_items": n_items, "model": "/nonexistent", "revisions": ["local"],
                       "precisions": ["bf16", "fp32"], "max_new_tokens": N, "max_stage_tokens": S + 4,
                       "batch_size": batch_size, "decode_regime": "static", "gpus_per_job": 1,
                       "bridge": {"n_rows": bridge_rows, "seed": 0}, "batch_invariance": {"sample": sample, "seed": 0},
                       "cache_differences": {"n_items": 0, "precisions": ["bf16", "fp32"]}, **config},
            "ledger": {"mean_prompt": P, "mean_stage": S, "mean_suffix": N,
                       "divergent_share": {"bf16": 0.5, "fp32": 0.0}},
            "counts": {"num_layers": 28, "decode": {"decode_max_len": 40}, **(counts or {})},
            "rules": rules if rules is not None else {"reconstruct_prefixes": {"jobs": 2, "s": 40.0},
                                                      "select_items": {"jobs": 1, "s": 2.0}},
            "job_times": [{"job": "select_items.tsv", "rule": "select_items", "s": 2.0}]}


def _jobs(run, rule):
    shape = run_shape(run)
    return [j for j in model_jobs(shape, {"bf16": 1e-6, "fp32": 2e-6}) if j.rule == rule]


def _steps(jobs, rows):
    return sum(w.steps.get(rows, 0.0) for j in jobs for w in j.work.values())


def test_ledger_rules_count_their_cells_and_double_with_the_items():
    """At batch 4 every construction of a batch runs the live schedule: S + N - 1 steps at 4 rows; the matched
    experiment is live x2 + prefill x2, the 2x2 two constructions x2, the audit every one of them once."""
    cells_per_batch = {"reconstruct_prefixes": 4, "generate_fixed_prefix": 4, "audit_ledger": 4}
    for rule, cells in cells_per_batch.items():
        jobs = _jobs(_run(n_items=8), rule)
        assert [j.loads for j in jobs] == [["bf16"], ["fp32"]]  # one job per precision, each at every precision
        assert _steps(jobs, 4) == 2 * 2 * cells * (S + N - 1)  # 2 precisions x 2 batches
        assert _steps(_jobs(_run(n_items=16), rule), 4) == 2 * _steps(jobs, 4)
        prefill = sum(w.prefill_tokens for j in jobs for w in j.work.values())
        assert prefill == 2 * 2 * (cells * 4 * P + 2 * 4 * (P + S - 1))  # every cell's prompts; two prefill builds
    # a partial last batch decodes a full batch's steps at its own rows (9 items in batches of 4: the last has 1)
    partial = _jobs(_run(n_items=9), "generate_fixed_prefix")
    assert _steps(partial, 4) == 2 * 2 * 4 * (S + N - 1) and _steps(partial, 1) == 2 * 1 * 4 * (S + N - 1)
    # the bridge: one incremental cell with its suffix in each batch holding a bridge row (read where recorded)
    bridged = _run(n_items=8, bridge_rows=3, counts={"bridge": {"bf16": {"batches": 2}, "fp32": {"batches": 1}}})
    assert _steps(_jobs(bridged, "reconstruct_prefixes"), 4) - _steps(_jobs(_run(), "reconstruct_prefixes"), 4) == (
        3 * (S + N - 1))


def test_the_batch_invariance_control_decodes_its_sample_alone_at_every_precision():
    jobs = _jobs(_run(sample=2), "check_batch_invariance")
    assert len(jobs) == 1 and jobs[0].loads == ["bf16", "fp32"]
    # per item and precision: live alone (S + N - 1 steps) and prefill alone (N steps after a P + S - 1 prefill)
    assert _steps(jobs, 1) == 2 * 2 * ((S + N - 1) + N) and _steps(jobs, 4) == 0
    assert _steps(_jobs(_run(sample=4), "check_batch_invariance"), 1) == 2 * _steps(jobs, 1)
    assert _steps(_jobs(_run(sample=50), "check_batch_invariance"), 1) == 8 / 2 * _steps(jobs, 1)  # at most n items
    assert _jobs(_run(batch_size=1), "check_batch_invariance") == []  # nothing to compare: the DAG has no job


def test_transplants_count_a_rebuild_and_their_controls_per_spec_and_direction():
    """The default sweeps are 11 transplants per direction at 28 layers; each batch holding a selected item
    rebuilds both constructions, then decodes the recipient twice per spec and direction (the donor's bytes and
    their placebo) and once per direction for the sham; a run recorded before the controls ran one arm, no sham."""
    cell = S + N - 1
    divergent = _jobs(_run(n_items=8), "transplant_caches")  # divergent share 0.5: 4 items, derived
    assert divergent[0].loads == ["bf16"]
    held = batches_holding(4, 8, 4)
    assert 1 < held < 2
    assert abs(_steps(divergent, 4) - held * (1 + 2 * 11 + 1) * 2 * cell) < 1e-9
    recorded = _run(counts={"transplant": {"items": 3, "batches": 2, "specs_per_direction": 7}})  # before controls
    assert _steps(_jobs(recorded, "transplant_caches"), 4) == 2 * (1 + 7) * 2 * cell
    controlled = _run(counts={"transplant": {"items": 3, "batches": 2, "specs_per_direction": 7, "arms": 2,
                                             "shams": 1}})
    assert _steps(_jobs(controlled, "transplant_caches"), 4) == 2 * (1 + 2 * 7 + 1) * 2 * cell
    searched = _run(counts={"minimal": {"items": 3, "batches": 2,
                                        "rounds_per_direction": {"live->prefill": 5, "prefill->live": 3}}})
    assert _steps(_jobs(searched, "find_minimal_transplants"), 4) == (2 * 2 + 5 + 3) * cell
    searched = _run(counts={"minimal": {"items": 3, "batches": 2, "arms": 2, "shams": 1,
                                        "rounds_per_direction": {"live->prefill": 5, "prefill->live": 3}}})
    assert _steps(_jobs(searched, "find_minimal_transplants"), 4) == (2 * 2 + 2 * (5 + 3) + 2 * 2) * cell


def test_packed_transplants_are_priced_by_the_decodes_their_tasks_fill():
    """Packed (transplant.pack, the suffix schedule): per batch the rebuild, then ceil(tasks / rows) decodes of
    the suffix alone; tasks = the batch's items x directions x (arms x specs + shams). Unpacked, or recorded
    before packing, or in the lockstep schedule (where rows cannot continue from their own boundaries): as before."""
    counts = {"transplant": {"items": 3, "batches": 2, "specs_per_direction": 7, "arms": 2, "shams": 1,
                             "packed": True}}
    shape = run_shape(_run(counts=counts, schedule="suffix"))
    rebuild = (S - 1 + N) + N  # incremental by the live schedule, prefill from its boundaries
    tasks = 3 / 2 * 2 * (2 * 7 + 1)  # a batch: 1.5 items x 2 directions x 15
    assert tasks == 45  # 12 decodes of 4 rows
    packed = _steps(_jobs(_run(counts=counts, schedule="suffix"), "transplant_caches"), 4)
    assert shape.schedule == "suffix" and packed == 2 * (rebuild + 12 * N)
    unpacked = {"transplant": dict(counts["transplant"], packed=False)}
    assert _steps(_jobs(_run(counts=unpacked, schedule="suffix"), "transplant_caches"), 4) == 2 * (
        rebuild + 2 * (2 * 7 + 1) * N + (2 * 7 + 1) * (S - 1 + N) - (2 * 7 + 1) * N)
    assert _steps(_jobs(_run(counts=counts), "transplant_caches"), 4) == 2 * (1 + 2 * 7 + 1) * 2 * (S + N - 1)


def test_a_rule_absent_from_the_run_is_reported_absent_and_the_cli_writes_its_json(tmp_path):
    paths = {name: tmp_path / f"{name}.json" for name in ("run", "measures", "batch1", "out")}
    paths["run"].write_text(json.dumps(_run()))
    paths["measures"].write_text(json.dumps({"projection": MEASURES}))
    paths["batch1"].write_text(json.dumps({"projection": MEASURES_BATCH1}))
    assert cli.main(["--run", str(paths["run"]), "--measures", str(paths["measures"]), "--measures-batch1",
                            str(paths["batch1"]), "--overhead-s", "5", "--json", str(paths["out"])]) == 0
    report = json.loads(paths["out"].read_text())
    rules = report["rules"]
    assert rules["transplant_caches"]["status"] == "absent from the run"
    assert rules["transplant_caches"]["measured_s"] is None
    assert "transplant_caches" in report["absent_rules"]
    assert rules["select_items"]["status"] == "not projected" and rules["select_items"]["projected_s"] is None
    reconstruct = rules["reconstruct_prefixes"]
    # two jobs of 5 s overhead, each 2 batches of 4 cells of S + N - 1 steps at 10 or 30 ms, and its prefills
    decode = 2 * 4 * (S + N - 1) * (0.01 + 0.03)
    prefill = 2 * 2 * (4 * 4 * P + 2 * 4 * (P + S - 1)) / 1000.0
    assert abs(reconstruct["projected_s"] - (2 * 5 + decode + prefill)) < 1e-9
    assert abs(reconstruct["ratio"] - reconstruct["projected_s"] / 40.0) < 1e-12
    assert report["model_jobs"]["measured_s"] == 40.0  # only rules in both are compared
    assert report["wall"]["relative_error"] is not None  # one model job at a time, a complete run
    assert report["sources"]["batches"] == "derived" and report["sources"]["decode_max_len"] == "read"


def test_the_overhead_counts_the_start_once_and_each_model_loaded():
    overhead = Overhead.from_json({"start_s": 10.0, "load_s": {"bf16": 1.0, "fp32": 2.0},
                                              "first_load_extra_s": 3.0})
    assert overhead.of_job([]) == 10.0 and overhead.of_job(["fp32"]) == 15.0
    assert overhead.of_job(["bf16", "fp32"]) == 16.0
    assert Overhead.from_seconds(12.0, 2.0).of_job(["bf16", "fp32"]) == 14.0


def test_recorded_minimal_rounds_are_each_batchs_longest_search(tmp_path):
    import pandas as pd

    pd.DataFrame({"item_index": [0, 1, 2, 0, 1, 2], "direction": ["a->b"] * 3 + ["b->a"] * 3,
                  "runs": [4, 2, 3, 1, 5, 2]}).to_parquet(tmp_path / "minimal_transplant.parquet")
    counts = pipeline_run.minimal_counts(tmp_path, {0: 0, 1: 0, 2: 1})  # items 0 and 1 share batch 0
    # a table from before the controls: one arm, no sham; with them, the placebo beside each trial and a sham
    assert counts == {"items": 3, "batches": 2, "rounds_per_direction": {"a->b": 4 + 3, "b->a": 5 + 2},
                      "arms": 1, "shams": 0}
    table = pd.read_parquet(tmp_path / "minimal_transplant.parquet")
    table.assign(trial_placebo_outcomes=[["recipient"]] * 6, sham_cache_fingerprint="s").to_parquet(
        tmp_path / "minimal_transplant.parquet")
    assert pipeline_run.minimal_counts(tmp_path, {0: 0, 1: 0, 2: 1})["arms"] == 2


def test_the_wall_adds_the_time_the_log_shows_without_a_model_job():
    run = _run(rules={"reconstruct_prefixes": {"jobs": 2, "s": 16.0}})
    run["wall_s"] = 30.0
    run["log_jobs"] = [{"rule": "select_items", "start_s": 0.0, "end_s": 2.0},
                       {"rule": "reconstruct_prefixes", "start_s": 2.0, "end_s": 10.0},
                       {"rule": "reconstruct_prefixes", "start_s": 9.0, "end_s": 12.0},  # overlaps: counted once
                       {"rule": "gather_ledger", "start_s": 12.0, "end_s": 14.0},
                       {"rule": "audit_ledger", "start_s": 14.0, "end_s": 20.0}]
    report = compare(run, MEASURES, Overhead.from_seconds(5.0), MEASURES_BATCH1)
    wall = report["wall"]
    assert wall["non_model_s"] == 30.0 - 16.0 and wall["from"] == "the Snakemake log"
    projected = sum(r["projected_s"] for r in report["rules"].values() if r["projected_s"] is not None)
    assert abs(wall["predicted_s"] - (projected + 14.0)) < 1e-9
    assert abs(wall["relative_error"] - (wall["predicted_s"] / 30.0 - 1)) < 1e-12
    run["gpu_slots"] = 2  # model jobs may share the device: no sum of them is the wall
    assert compare(run, MEASURES, Overhead.from_seconds(5.0))["wall"]["relative_error"] is None


def test_the_snakemake_log_gives_every_jobs_start_and_end(tmp_path):
    log = tmp_path / "snakemake.log"
    log.write_text("Building DAG of jobs...\n\n[Tue Dec  1 10:44:54 2026]\nlocalrule select_items:\n    output: x\n"
                   "    jobid: 1\n    resources: tmpdir=/tmp\n\n[Tue Dec  1 10:44:58 2026]\nrule gather_ledger:\n"
                   "    jobid: 7\n[Tue Dec  1 10:45:00 2026]\nFinished jobid: 1 (Rule: select_items)\n"
                   "1 of 2 steps (50%) done\n[Tue Dec  1 10:45:09 2026]\nFinished jobid: 7 (Rule: gather_ledger)\n")
    assert pipeline_run.log_job_times(log) == [{"rule": "select_items", "start_s": 0.0, "end_s": 6.0},
                                               {"rule": "gather_ledger", "start_s": 4.0, "end_s": 15.0}]


def test_fidelity_counts_live_and_each_construction_per_batch_and_defaults_to_suffix():
    """8 items at batch 4, fidelity of prefill and chunked: per precision one job, 2 batches each decoding live
    (S + N - 1 steps) and both constructions from their boundaries (N steps each, the suffix schedule by default);
    every row's logits kept at N steps on 3 sides, every row compared on 2; none with no constructions."""
    run = _run(n_items=8, schedule=None, fidelity={"constructions": ["prefill", "chunked"], "items": "all", "seed": 0})
    shape = run_shape(run)
    assert shape.schedule == "suffix"
    jobs = _jobs(run, "measure_fidelity")
    assert [j.name for j in jobs] == ["measure_fidelity_bf16_0", "measure_fidelity_fp32_0"]
    for job in jobs:
        work = job.work[job.precision]
        assert not job.lookahead
        assert work.steps[4] == 2 * ((S - 1 + N) + N + N)
        assert work.observed_row_steps == 2 * 4 * N * 3
        assert work.compared_row_steps == 2 * 4 * N * 2
    assert _jobs(_run(n_items=8, fidelity={"constructions": [], "items": "all", "seed": 0}), "measure_fidelity") == []
    lockstep = run_shape({**run, "schedule": "lockstep"})
    assert lockstep.schedule == "lockstep"
