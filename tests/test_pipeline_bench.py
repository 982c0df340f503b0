"""bench/pipeline_run.py: the config it writes is one the workflow accepts, and it reads the rules' benchmark
files into per-rule times (the whole run it measures is a GPU benchmark, recorded in bench/RESULTS.md)."""

import argparse
import importlib.util
import json
from pathlib import Path

import yaml
from snakemake.utils import validate

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("pipeline_run", REPO / "bench/pipeline_run.py")
pipeline_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pipeline_run)


def test_the_written_config_is_valid_and_has_the_asked_scale(tmp_path):
    args = argparse.Namespace(items=48, stage=256, suffix=128, precisions=["bf16", "fp32"], shards=1,
                              numerics="default", batch_size=16, regime="cuda_graph", transplant_select="sample:8",
                              minimal_budget=8, device="cuda")
    cfg = yaml.safe_load(pipeline_run.write_config(tmp_path, args).read_text())
    validate(cfg, str(REPO / "workflow/schemas/config.schema.yaml"), set_default=True)
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


def _benchmark():
    spec = importlib.util.spec_from_file_location("benchmark", REPO / "bench/benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_projection_counts_every_transplant_run_as_a_cell_of_the_batch():
    """Each transplant run (both directions) decodes the recipient's batch once: one more 2x2 cell per item, in
    every batch holding a divergent row; fp32 runs no transplants."""
    bench = _benchmark()
    measures = json.loads((REPO / "bench/runs/h200_run7_projection_shared_rows.json").read_text())["projection"]
    bf16 = next(m for m in measures if m["precision"] == "bf16")
    cell = bench.decode_seconds(bf16, bf16["P"], bf16["S"] + bf16["N"], True) + bench.decode_seconds(
        bf16, bf16["P"] + bf16["S"] - 1, bf16["N"], True)
    one = bench.project(measures, 200, 0.5, bucketed=True)
    sweeps = bench.project(measures, 200, 0.5, bucketed=True, transplant_specs=11)
    searched = bench.project(measures, 200, 0.5, bucketed=True, transplant_specs=11, minimal_budget=24)
    share = 1 - 0.5 ** bf16["rows"]
    assert abs(sweeps["parts"]["bf16"]["decode_s"] - one["parts"]["bf16"]["decode_s"] - 200 * share * 10 * cell) < 1e-6
    # the minimal search's stage rebuilds its batches too: its budget plus one cell
    assert abs(searched["parts"]["bf16"]["decode_s"] - sweeps["parts"]["bf16"]["decode_s"]
               - 200 * share * 25 * cell) < 1e-6
    assert searched["parts"]["fp32"] == one["parts"]["fp32"]


def test_the_fp32_floor_counts_the_projected_work_at_the_datasheet_rate():
    bench = _benchmark()
    saved = json.loads((REPO / "bench/runs/h200_run7_projection_shared_rows.json").read_text())
    floor = bench.fp32_floor(saved["projection"], 200, 166 / 200, saved["meta"]["copy_TB_s"])
    assert set(floor) == {"fp32"}
    arm = floor["fp32"]
    assert arm["floor_s"] == arm["linear_at_peak_s"] + arm["attention_at_copy_rate_s"]
    # the datasheet's 67 TFLOP/s is above the best GEMM rate measured (47.6), so its linear floor is lower
    assert arm["linear_at_peak_s"] < arm["linear_at_best_measured_s"]
    assert 0 < arm["share_of_floor"] < 1 and arm["projected_s"] > arm["floor_s"]
