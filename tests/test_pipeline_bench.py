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
    assert cfg["device"] == "auto"
    args.device = "cpu"
    assert yaml.safe_load(pipeline_run.write_config(tmp_path, args).read_text())["device"] == "cpu"


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
