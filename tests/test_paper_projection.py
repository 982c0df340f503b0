"""The projection of a run not made (stagereplay.projection; bench/pipeline_projection.py --config), rule by rule
from its config; measures of the triton attention priced step by step at each step's position, those of the masked
attention at the whole buffer as before; paper.project()'s count split by rule; the floor of the per-rule work; the
suffix schedule; every model rule split into shards and the rule DAG's jobs placed on N GPUs."""

import json
import re
from pathlib import Path

import pytest
import yaml

from bench_scripts import load_bench

from stagereplay.projection.counts import cell
from stagereplay.projection.jobs import model_jobs
from stagereplay.projection.floor import run_floor
from stagereplay.projection.paper import project, project_by_rule
from stagereplay.projection.pricing import price, projected_rules, rates_for
from stagereplay.projection.rates import Overhead, Rates
from stagereplay.projection.report import compare, project_config
from stagereplay.projection.schedule import job_dependencies, list_schedule, on_gpus
from stagereplay.projection.shape import config_run, load_config, run_shape

REPO = Path(__file__).resolve().parents[1]
cli = load_bench("pipeline_projection")  # bench/pipeline_projection.py: the command line

P, S, N = 10, 20, 8  # prompt, stage, suffix (mean = a batch's longest)
STAGE_BUDGET = 24  # max_stage_tokens: the buffer is P + 24 + N, not P + S + N
KV_GB_PER_POSITION = 64e-6 / 64


def _measure(precision, rows, a, b, bucket):
    """A measure of bench/benchmark.py's layout: a step of a + b * span."""
    return {"shape": "tiny", "precision": precision, "rows": rows, "max_len": 64, "kv_GB_per_row": 64e-6,
            "P": P, "S": S, "N": N, "linear_params": 1e6, "gemm_TFLOP_s_large": 1.0,
            "step_fit": {"a_s": a, "b_s_per_position": b, "bucket": bucket}, "step_s": a + b * 64,
            "prefill_tokens_s": 1000.0, "dump_GB": 1e-3, "dump_GB_s": 1.0}


def _measures(bucket):
    return [_measure("bf16", 4, 0.01, 1e-4, bucket), _measure("fp32", 4, 0.03, 3e-4, bucket),
            _measure("bf16", 1, 0.008, 2e-5, bucket), _measure("fp32", 1, 0.02, 5e-5, bucket)]


MASKED, TRITON = _measures(16), _measures(1)
SMALL = {"run": "small", "n_items": 8, "model": "/nonexistent", "revisions": ["local"], "precisions": ["bf16", "fp32"],
         "max_stage_tokens": STAGE_BUDGET, "max_new_tokens": N, "batch_size": 4, "decode_regime": "static",
         "gpus_per_job": 1, "bridge": {"n_rows": 8, "seed": 0}, "batch_invariance": {"sample": 2, "seed": 0},
         "cache_differences": {"n_items": 8, "precisions": ["bf16", "fp32"]}, "transplant": {"minimal": {"budget": 4}},
         "fidelity": {"constructions": []}}  # the fidelity stage off here (tests/test_pipeline_bench.py prices it)
DIVERGENT = {"bf16": 1.0, "fp32": 0.0}
# what bench/pipeline_run.py records of a run of SMALL where every bf16 item diverged and every search used its budget
RECORDED = {"batches": 2, "decode": {"decode_max_len": P + STAGE_BUDGET + N}, "num_layers": 28,
            "bridge": {p: {"items": 8, "batches": 2} for p in ("bf16", "fp32")},
            "batch_invariance": {p: {"live": 2, "prefill": 2} for p in ("bf16", "fp32")},
            "cache_differences": {p: {"items": 8, "batches": 2} for p in ("bf16", "fp32")},
            "dump": {"bf16": {"items": 8, "batches": 2, "bytes": 2 * 8 * (P + S - 1) * KV_GB_PER_POSITION * 1e9}},
            "transplant": {"items": 8, "batches": 2, "directions": ["live->prefill", "prefill->live"],
                           "specs_per_direction": 11, "arms": 2, "shams": 1, "packed": True},
            "minimal": {"items": 8, "batches": 2, "rounds_per_direction": {"live->prefill": 8, "prefill->live": 8},
                        "arms": 2, "shams": 1},
            "onset": {"bf16": {"items": 8, "batches": 2}}}


def _config_run(tmp_path, config=SMALL, overrides=()):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return config_run(load_config(str(path), list(overrides)), P, S, N, DIVERGENT, 28)


def _recorded_run():
    ledger = {"mean_prompt": P, "mean_stage": S, "mean_suffix": N, "batch_width": P, "batch_stage": S,
              "batch_stage_shortest": S, "batch_suffix": N, "divergent_share": DIVERGENT}
    return {"status": "complete", "wall_s": 100.0, "gpu_slots": 1, "config": SMALL, "ledger": ledger,
            "counts": RECORDED, "rules": {}}


def test_a_built_construction_skips_the_steps_before_the_batch_s_first_boundary(tmp_path):
    """In lockstep, prefill, chunked and prefix_cached start at the batch's shortest stage (the greedy loop's
    ``advance``); live and incremental decode the whole schedule. A run that did not record its shortest stages was
    made before the skip and is counted without it."""
    config = _config_run(tmp_path)["config"]
    shape = run_shape(config_run(config, P, S, N, DIVERGENT, 28, shortest_stage=12,
                                                       schedule="lockstep"))
    assert shape.skip == 11
    assert cell(shape, "incremental").segments == {(4, P, S - 1 + N): 1.0}
    for name in ("prefill", "chunked", "prefix_cached"):
        assert (4, P + 11, S - 1 + N - 11) in cell(shape, name).segments
    assert cell(shape, "prefill", suffix=False).segments == {(4, P + 11, S - 1 - 11): 1.0}
    old = {**_recorded_run(), "schedule": "lockstep"}
    del old["ledger"]["batch_stage_shortest"]
    before = run_shape(old)
    assert before.skip == 0 and before.sources["batch_stage_shortest"] == "derived"
    assert cell(before, "prefill").segments == {(4, P, S - 1 + N): 1.0}


def test_a_catalogue_construction_is_priced_by_its_segment_rule_with_no_edit_of_the_projection(tmp_path,
                                                                                              monkeypatch):
    """A construction the catalogue declares with an existing segment rule is priced as that rule is; a name the
    catalogue lacks, and a rule the projection does not price, are refused by name."""
    from stagereplay import catalogue

    shape = run_shape(config_run(_config_run(tmp_path)["config"], P, S, N, DIVERGENT, 28, shortest_stage=12,
                                 schedule="lockstep"))
    twin = catalogue.Construction("prefill_twin", "prefill again", "every id in one forward", "prefill")
    halves = catalogue.Construction("halves", "two halves", "two forwards", "halves")
    monkeypatch.setattr(catalogue, "CONSTRUCTIONS", (*catalogue.CONSTRUCTIONS, twin, halves))
    for suffix in (True, False):
        assert vars(cell(shape, "prefill_twin", suffix=suffix)) == vars(cell(shape, "prefill", suffix=suffix))
    assert cell(shape, "prefill_twin").segments != cell(shape, "incremental").segments  # the control
    with pytest.raises(ValueError, match="unknown construction 'paged'"):
        cell(shape, "paged")
    with pytest.raises(ValueError, match="prices no segment rule 'halves'"):
        cell(shape, "halves")


def test_the_lookahead_hides_host_work_behind_the_device_s_in_the_cuda_graph_regime(tmp_path):
    """The greedy loop's lookahead (cuda_graph) checks a step on the host while the device runs the next: only the
    host work beyond the device's is counted. The static regime, and a run made before the lookahead, count it all."""
    overhead = Overhead(0.0, {}, greedy_step_s={4: 0.004, 1: 0.004})  # below a 4-row step's 10 ms
    graph = _config_run(tmp_path, overrides=["decode_regime=cuda_graph"])
    static = _config_run(tmp_path)
    old = {**graph}
    del old["greedy_loop"]
    parts = {}
    for name, run in (("graph", graph), ("static", static), ("old", old)):
        shape = run_shape(run)
        work = cell(shape, "incremental")
        parts[name] = price(work, "bf16", shape, rates_for(shape, MASKED, overhead, None))
    assert parts["graph"]["decode_s"] == parts["static"]["decode_s"] == parts["old"]["decode_s"] > 0
    assert parts["static"]["host_s"] == parts["old"]["host_s"] == (S - 1 + N) * 0.004
    assert parts["graph"]["host_s"] == 0.0



def test_pending_fingerprints_cost_their_copy_and_only_the_hashing_beyond_the_decode(tmp_path):
    """With the snapshot's copy rate (a GPU job's pending fingerprints) a job pays the copy on the decode's stream and
    only the hashing beyond its decode; without it, the whole hashing in turn (a run made before them)."""
    from stagereplay.projection.pricing import fingerprint_seconds

    run = _config_run(tmp_path, overrides=["decode_regime=cuda_graph"])
    shape = run_shape(run)
    work = cell(shape, "incremental")
    serial, pending = Overhead(0.0, {}, fingerprint_GB_s=2.0), Overhead(0.0, {}, fingerprint_GB_s=2.0,
                                                                         fingerprint_copy_GB_s=20.0)
    parts = {name: price(work, "bf16", shape, rates_for(shape, MASKED, o, None))
             for name, o in (("serial", serial), ("pending", pending))}
    GB = work.boundary_rows * shape.boundary_positions * KV_GB_PER_POSITION
    assert GB > 0 and parts["serial"]["fingerprint_s"] == pytest.approx(GB / 2.0)
    assert parts["pending"]["decode_s"] == parts["serial"]["decode_s"] > GB / 2.0  # the hashing hides in the decode
    assert parts["pending"]["fingerprint_s"] == pytest.approx(GB / 20.0)
    # the control: hashing longer than the decode is paid beyond it
    assert fingerprint_seconds(10.0, 1.0, pending) == pytest.approx(10.0 / 20.0 + 10.0 / 2.0 - 1.0)
    assert fingerprint_seconds(10.0, 1.0, serial) == pytest.approx(5.0)


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.12g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def _jobs(shape):
    jobs = model_jobs(shape, {"bf16": KV_GB_PER_POSITION, "fp32": 2 * KV_GB_PER_POSITION})
    return [(j.rule, j.name, j.loads, {p: _rounded(vars(w)) for p, w in j.work.items()}) for j in jobs]


def test_the_config_mode_derives_the_counts_a_run_records(tmp_path):
    made = run_shape(_config_run(tmp_path))
    recorded = run_shape(_recorded_run())
    assert made.config == recorded.config  # the schema's defaults filled alike (snakemake's validate, the schema walk)
    assert made.span == recorded.span == P + STAGE_BUDGET + N  # the buffer: longest prompt + both budgets
    made_jobs, recorded_jobs = _jobs(made), _jobs(recorded)
    counted = {name for name, source in recorded.sources.items()}
    assert all(source == "read" for source in recorded.sources.values())
    # --layers, --prompt, --stage (--stage-shortest defaults to it), --suffix
    given = {"num_layers", "batch_width", "batch_stage", "batch_stage_shortest", "batch_suffix"}
    assert {name for name, s in made.sources.items() if s == "derived"} == counted - given
    assert made_jobs == recorded_jobs and len(made_jobs) == 12
    # and priced alike: the config mode's total is the run mode's projection
    overhead = Overhead.from_seconds(5.0, 1.0)
    report = project_config(_config_run(tmp_path), MASKED, overhead, non_model_s=7.0)
    compared = compare(_recorded_run(), MASKED, overhead)
    for rule, r in report["rules"].items():
        assert abs(r["projected_s"] - compared["rules"][rule]["projected_s"]) < 1e-9, rule
    assert abs(report["wall"]["predicted_s"] - report["model_jobs"]["projected_s"] - 7.0) < 1e-9
    # a derived count follows the config: a larger bridge sample of fewer items, no search at budget 0
    no_search = run_shape(_config_run(tmp_path, overrides=["transplant.minimal.budget=0"]))
    minimal = [j for j in model_jobs(no_search, {"bf16": 1e-6, "fp32": 2e-6})
               if j.rule == "find_minimal_transplants"]
    assert minimal[0].loads == [] and minimal[0].work == {}


def test_a_partial_last_batch_is_its_own_kind_and_its_steps_are_priced_between_the_measured_rows():
    shape = run_shape(config_run(
        load_config(str(REPO / "config/paper-scale-14b.yaml")), 256, 2048, 1024, {"bf16": 0.83}, 48))
    assert shape.kinds() == {62: 3, 14: 1} and shape.span == 256 + 2048 + 1024
    held = shape.holding(166)  # 166 divergent items of 200: every batch holds one
    assert abs(held[62] - 3) < 1e-12 and abs(held[14] - 1) < 1e-9
    rates = Rates(TRITON, Overhead.from_seconds(0.0), [])
    m = rates.step_measure("bf16", 2)  # between the 1- and 4-row measures
    assert m["rows"] == 2 and abs(m["step_fit"]["a_s"] - (0.008 + (0.01 - 0.008) / 3)) < 1e-15


def test_a_triton_measure_prices_each_step_at_its_position_and_a_masked_one_at_the_whole_buffer(tmp_path):
    shape = run_shape(_recorded_run())
    live = cell(shape, "live")  # 4 rows in lockstep: S - 1 + N steps from the batch's prompt width P
    overhead = Overhead.from_seconds(0.0)
    by_position = price(live, "bf16", shape, Rates(TRITON, overhead, []))["decode_s"]
    whole = price(live, "bf16", shape, Rates(MASKED, overhead, []))["decode_s"]
    a, b, buffer = 0.01, 1e-4, P + STAGE_BUDGET + N
    assert abs(by_position - sum(a + b * (p + 1) for p in range(P, P + S - 1 + N))) < 1e-12
    assert abs(whole - (S - 1 + N) * (a + b * buffer)) < 1e-12  # every step over the whole buffer, as before
    assert by_position < whole
    # a prefill cell alone (batch 1) decodes its suffix from the boundary: positions P + S - 1 on
    alone = cell(shape, "prefill", alone=True)
    priced = price(alone, "fp32", shape, Rates(TRITON, overhead, []))["decode_s"]
    assert abs(priced - sum(0.02 + 5e-5 * (p + 1) for p in range(P + S - 1, P + S - 1 + N))) < 1e-12


def _measures_from_log(path):
    """The 1.5B run's measures (its results.json was not kept) from the benchmark's log, rounded as logged."""
    out = {}
    for line in Path(path).read_text().splitlines():
        step = re.search(r"projection 1.5B (\w+): (\d+) rows x max_len (\d+): step ms by span \{(.*)\}", line)
        if step:
            precision, rows, max_len = step.group(1), int(step.group(2)), int(step.group(3))
            spans = {int(k): float(v) / 1e3 for k, v in (kv.split(":") for kv in step.group(4).split(","))}
            xs, ys = list(spans), list(spans.values())
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            out[precision] = {"precision": precision, "rows": rows, "max_len": max_len, "step_s": spans[max(spans)],
                              "kv_GB_per_row": 2 * 28 * 2 * 128 * {"bf16": 2, "fp32": 4}[precision] * max_len / 1e9,
                              "step_fit": {"a_s": my - slope * mx, "b_s_per_position": slope, "bucket": 64}}
        rate = re.search(r"projection 1.5B (\w+): prefill .* \((\d+) tok/s\)", line)
        if rate:
            out[rate.group(1)]["prefill_tokens_s"] = float(rate.group(2))
        dump = re.search(r"projection 1.5B (\w+): cache dump .* at ([\d.]+) GB/s", line)
        if dump:
            out[dump.group(1)]["dump_GB_s"] = float(dump.group(2))
    return list(out.values())


def test_the_measured_1_5b_run_is_priced_as_before():
    """The masked-attention measures of the 1.5B run (bench/RESULTS.md, "The workflow against its projection, rule
    by rule"), rebuilt from their logs: every rule's projection is the one the module gave before the triton pricing
    and the partial batches (the numbers below, computed by it on the same rebuilt measures)."""
    folder = REPO / "bench/runs/pipeline_h200/run32"
    before = {"reconstruct_prefixes": 63.998143056325894, "generate_fixed_prefix": 57.73417114772738,
              "audit_ledger": 58.379198091730274, "check_batch_invariance": 36.758757269664585,
              "measure_cache_differences": 30.38921276764396, "transplant_caches": 50.31544609311683,
              "find_minimal_transplants": 29.775843969680597, "measure_divergence_onset": 18.038928470574177,
              "dump_caches": 18.303169622574178}
    run = {**json.loads((folder / "run32.json").read_text()), "schedule": "lockstep"}  # made before the suffix one
    report = compare(run,
                                _measures_from_log(folder / "meas16.log"),
                                Overhead.from_json(json.loads((folder / "overhead.json").read_text())),
                                _measures_from_log(folder / "meas1.log"))
    for rule, seconds in before.items():
        assert abs(report["rules"][rule]["projected_s"] - seconds) < 1e-9 * seconds, rule


def test_project_by_rule_splits_project_without_losing_any_of_it():
    measures = json.loads((REPO / "bench/runs/h200_run7_projection_shared_rows.json").read_text())["projection"]
    for specs, budget in ((1, 0), (11, 0), (11, 24)):
        kwargs = {"transplant_specs": specs, "minimal_budget": budget, "model_jobs": 12, "job_overhead_s": 15.0}
        split = project_by_rule(measures, 200, 166 / 200, **kwargs)
        whole = project(measures, 200, 166 / 200, bucketed=True, **kwargs)["total_s"]
        assert abs(sum(split.values()) - whole) < 1e-9 * whole
        assert ("find_minimal_transplants" in split) == bool(budget)
    # the numbers bench/RESULTS_ARCHIVE.md quotes: 1.81 h, 2.58 h, 4.49 h
    assert round(sum(project_by_rule(measures, 200, 166 / 200, 11, 24, 12, 15.0).values()) / 3600, 2) == 4.49


def test_the_cli_projects_a_config_and_writes_its_json(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump({**SMALL, "decode_attention": "triton", "decode_regime": "cuda_graph"}))
    measures, batch1, out = tmp_path / "m.json", tmp_path / "m1.json", tmp_path / "out.json"
    measures.write_text(json.dumps({"projection": TRITON[:2], "meta": {"copy_TB_s": 4.0}}))
    batch1.write_text(json.dumps({"projection": TRITON[2:]}))
    argv = ["--config", str(config), "--prompt", str(P), "--stage", str(S), "--suffix", str(N), "--divergent",
            "bf16=1,fp32=0", "--layers", "28", "--measures", str(measures), "--measures-batch1", str(batch1),
            "--overhead-s", "5", "--non-model-s", "30", "--compare-project", "--json", str(out)]
    assert cli.main(argv + ["--set", "transplant.sweeps=[all]"]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["transplant"]["sweeps"] == ["all"] and report["config"]["decode_attention"] == "triton"
    assert report["model_jobs"]["jobs"] == 12 and report["wall"]["non_model_s"] == 30.0
    assert abs(report["wall"]["predicted_s"] - sum(r["projected_s"] for r in report["rules"].values()) - 30) < 1e-9
    assert report["floor"]["floor_s"] <= report["floor"]["projected_gpu_s"]
    assert set(report["project_by_rule"]) == {"arguments", "m"}
    assert report["project_by_rule"]["arguments"]["transplant_specs"] == 1
    study = report["rules"]["transplant_caches"]["projected_s"]
    assert cli.main(argv) == 0  # the default sweeps: 11 transplants a direction, not 1
    assert json.loads(out.read_text())["rules"]["transplant_caches"]["projected_s"] > study


def test_the_per_rule_work_of_the_paper_config_has_a_higher_floor_than_project_s_count():
    """The floor of the same study-transplants run, counted rule by rule (the matched experiment at both
    precisions and in the audit, lockstep prefill cells decoding the whole schedule, the controls) against
    run_floor of project()'s count, on the same 14B measures."""
    folder = REPO / "bench/runs/h200_run8_paper_rates"
    saved = json.loads((folder / "m14_rows62.json").read_text())
    run = config_run(load_config(str(REPO / "config/paper-scale-14b.yaml"),
                                                       ["transplant.sweeps=[all]", "transplant.minimal.budget=0"]),
                                256, 2048, 1024, {"bf16": 0.83, "fp32": 0.0}, 48)
    batch1 = json.loads((folder / "m14_rows1.json").read_text())["projection"]
    report = project_config(run, saved["projection"], Overhead.from_seconds(15.0), batch1,
                                       copy_TB_s=saved["meta"]["copy_TB_s"])
    old = run_floor(saved["projection"], 200, 0.83, saved["meta"]["copy_TB_s"])
    assert report["floor"]["floor_s"] > old["floor_s"]
    for precision in ("bf16", "fp32"):
        assert report["arms"][precision]["row_steps"] > 200 * project(
            saved["projection"], 200, 0.83, bucketed=True)["parts"][precision]["decode_steps_per_item"]


def test_each_rule_s_floor_is_under_its_projected_gpu_work_and_packing_lowers_the_transplant_stages_floors():
    """Each rule's own floor (its decode and prefill at the datasheet rates, no start-up or host work): never above
    its projected decode and prefill; the rules' floors together at least the run's (one rule's counts left out
    would break it); and packing, which removes decodes, lowers both transplant stages' floors (a floor blind to
    the packed counts would not move)."""
    folder = REPO / "bench/runs/h200_run8_paper_rates"
    saved = json.loads((folder / "m14_rows62.json").read_text())
    batch1 = json.loads((folder / "m14_rows1.json").read_text())["projection"]
    reports = {}
    for pack in (True, False):
        run = config_run(load_config(str(REPO / "config/paper-scale-14b.yaml"), [f"transplant.pack={pack}"]),
                         256, 2048, 1024, {"bf16": 0.83, "fp32": 0.0}, 48)
        reports[pack] = report = project_config(run, saved["projection"], Overhead.from_seconds(15.0), batch1,
                                                copy_TB_s=saved["meta"]["copy_TB_s"])
        for name, rule in report["rules"].items():
            gpu = rule["parts"].get("decode_s", 0.0) + rule["parts"].get("prefill_s", 0.0)
            assert 0.0 <= rule["floor_s"] <= gpu, name
        assert sum(r["floor_s"] for r in report["rules"].values()) >= report["floor"]["floor_s"]
    for name in ("transplant_caches", "find_minimal_transplants"):
        assert reports[True]["rules"][name]["floor_s"] < reports[False]["rules"][name]["floor_s"]
    unchanged = reports[True]["rules"]["audit_ledger"]["floor_s"]
    assert unchanged == reports[False]["rules"]["audit_ledger"]["floor_s"]  # packing is the transplants' alone


def test_the_suffix_schedule_decodes_only_a_built_construction_s_suffix_in_a_batch(tmp_path):
    """--schedule suffix: in a batch of 4 a built construction builds its caches as in lockstep, then decodes the
    batch's N suffix steps from the rows' boundary (W + S - 1), without the prompt forward; live and incremental
    keep the live schedule's S + N - 1 steps; a row alone is the same in both schedules."""
    config = _config_run(tmp_path)["config"]
    lockstep = run_shape(config_run(config, P, S, N, DIVERGENT, 28, shortest_stage=12,
                                                          schedule="lockstep"))
    suffix = run_shape(config_run(config, P, S, N, DIVERGENT, 28, shortest_stage=12,
                                                        schedule="suffix"))
    assert suffix.schedule == "suffix" and lockstep.schedule == "lockstep"
    prefill = cell(suffix, "prefill")
    assert prefill.segments == {(4, P + S - 1, N): 1.0} and prefill.steps == {4: N}
    assert prefill.prefill_tokens == 4 * (P + S - 1)  # the build only: no prompt forward
    assert cell(lockstep, "prefill").steps == {4: S - 1 + N - 11}  # the skip leaves 11 stage steps
    assert cell(lockstep, "prefill").prefill_tokens == 4 * P + 4 * (P + S - 1)
    assert cell(suffix, "prefill", suffix=False).steps == {4: 0.0}  # no suffix, no step
    for name in ("chunked", "prefix_cached"):  # their per-row forwards (batch-1 steps) as before, then N at 4 rows
        built, before = cell(suffix, name), cell(lockstep, name)
        assert built.steps[4] == N and built.steps[1] == before.steps[1]
    for name in ("live", "incremental"):
        assert vars(cell(suffix, name)) == vars(cell(lockstep, name))
        assert cell(suffix, name).steps == {4: S - 1 + N}
    alone = cell(suffix, "prefill", alone=True)
    assert vars(alone) == vars(cell(lockstep, "prefill", alone=True)) and alone.steps == {1: N}
    # with every stage of one length the lockstep skip leaves the same steps: only the prompt forward differs
    equal = run_shape(config_run(config, P, S, N, DIVERGENT, 28))
    assert cell(equal, "prefill").segments == prefill.segments
    # the whole run: fewer steps, the live cells' as before
    rates = Rates(TRITON, Overhead.from_seconds(0.0), [])
    priced = {name: sum(j.seconds for j in projected_rules(shape, rates)[1])
              for name, shape in (("lockstep", lockstep), ("suffix", suffix))}
    assert priced["suffix"] < priced["lockstep"]
    try:
        run_shape({**_config_run(tmp_path), "schedule": "sideways"})
    except ValueError as exc:
        assert "lockstep, suffix" in str(exc)
    else:
        raise AssertionError("an unknown schedule was accepted")


def test_the_list_scheduler_places_a_hand_made_dag_on_n_devices():
    """a (3 s) -> c (2 s); b (2 s) -> d (1 s): on one device the sum; on two a and b first (the longest paths to the
    end), d on b's device when b ends, c when a ends."""
    seconds = {"a": 3.0, "b": 2.0, "c": 2.0, "d": 1.0}
    after = {"a": set(), "b": set(), "c": {"a"}, "d": {"b"}}
    one = list_schedule(seconds, after, 1)
    assert one["makespan_s"] == 8.0 and one["work_s"] == 8.0 and one["critical_path_s"] == 5.0
    ends = sorted(end for _, end, _ in one["jobs"].values())
    assert ends == [3.0, 5.0, 7.0, 8.0]  # back to back: a, then c (path 5) before b (path 3)
    two = list_schedule(seconds, after, 2)
    assert two["jobs"] == {"a": (0.0, 3.0, 0), "b": (0.0, 2.0, 1), "d": (2.0, 3.0, 1), "c": (3.0, 5.0, 0)}
    assert two["makespan_s"] == 5.0 == two["critical_path_s"]
    assert list_schedule(seconds, after, 8)["makespan_s"] == 5.0  # no device helps past the chain
    # a job waits for every job it needs, whatever the devices free: c after a and b
    joined = list_schedule(seconds, {**after, "c": {"a", "b"}}, 4)
    assert joined["jobs"]["c"][0] == 3.0
    for bad, match in (({**after, "a": {"c"}}, "cycle"), ({**after, "d": {"e"}}, "not in the DAG")):
        try:
            list_schedule(seconds, bad, 2)
        except ValueError as exc:
            assert match in str(exc)
        else:
            raise AssertionError(f"a DAG with {match} was accepted")


def _shape_at(tmp_path, shards, **overrides):
    return run_shape(_config_run(tmp_path, config={**SMALL, "shards": shards, **overrides}))


def test_every_model_rule_splits_into_shards_of_whole_batches(tmp_path):
    """With shards: 2 (8 items, 2 batches of 4) every model rule runs 2 jobs, each loading what the one job loads
    and decoding its half of the batches: the shards' work adds up to the one job's."""
    one, two = _shape_at(tmp_path, 1), _shape_at(tmp_path, 2)
    jobs1, jobs2 = model_jobs(one, {"bf16": 1e-6, "fp32": 2e-6}), model_jobs(
        two, {"bf16": 1e-6, "fp32": 2e-6})
    rules = {j.rule for j in jobs1}
    assert len(rules) == 9 and len(jobs2) == 2 * len(jobs1) == 24
    for rule in rules:
        mine1 = [j for j in jobs1 if j.rule == rule]
        mine2 = [j for j in jobs2 if j.rule == rule]
        assert sorted(j.shard for j in mine2) == sorted([0, 1] * len(mine1)), rule
        assert {tuple(j.loads) for j in mine2} == {tuple(j.loads) for j in mine1}, rule
        for p in {p for j in mine1 for p in j.work}:
            for field in ("prefill_tokens", "boundary_rows", "dump_GB"):
                whole = sum(getattr(j.work[p], field) for j in mine1 if p in j.work)
                halves = [sum(getattr(j.work[p], field) for j in mine2 if p in j.work and j.shard == k)
                          for k in (0, 1)]
                assert abs(sum(halves) - whole) < 1e-9 * max(1.0, whole), (rule, p, field)
                assert abs(halves[0] - halves[1]) < 1e-9 * max(1.0, whole), (rule, p, field)  # equal batches
            whole = sum(j.work[p].steps.get(4, 0.0) for j in mine1 if p in j.work)
            assert abs(sum(j.work[p].steps.get(4, 0.0) for j in mine2 if p in j.work) - whole) < 1e-9 * max(1, whole)
    # 3 shards of 2 batches: the third has none and pays its overhead and loads only
    three = model_jobs(_shape_at(tmp_path, 3), {"bf16": 1e-6, "fp32": 2e-6})
    empty = [j for j in three if j.shard == 2]
    assert empty and all(not any(w.steps.get(4) for w in j.work.values()) for j in empty)
    assert {j.rule: j.loads for j in empty if j.rule == "transplant_caches"} == {"transplant_caches": ["bf16"]}


def test_the_jobs_wait_for_what_their_inputs_need():
    shape = run_shape(config_run(
        load_config(str(REPO / "config/paper-scale-14b.yaml"), ["shards=2"]), 256, 2048, 1024,
        {"bf16": 0.83}, 48))
    jobs = model_jobs(shape, {"bf16": 1e-6, "fp32": 2e-6})
    after = job_dependencies(jobs)
    ledger = {f"{rule}_{p}_{k}" for rule in ("reconstruct_prefixes", "generate_fixed_prefix") for p in ("bf16", "fp32")
              for k in (0, 1)}
    assert after["reconstruct_prefixes_fp32_1"] == set()
    # the 2x2 of a shard reads that shard's prefixes of the reference precision (bf16)
    assert after["generate_fixed_prefix_fp32_1"] == {"reconstruct_prefixes_bf16_1"}
    for name in ("audit_ledger_fp32_0", "check_batch_invariance_1", "measure_cache_differences_0",
                 "measure_divergence_onset_1", "dump_caches_0"):
        assert after[name] == ledger, name
    # the transplants and the minimal search read the ledger's rows at the transplant precision (bf16) alone
    at_bf16 = {name for name in ledger if "_bf16_" in name}
    for name in ("transplant_caches_1", "find_minimal_transplants_0"):
        assert after[name] == at_bf16, name
    fp32 = run_shape(config_run(
        load_config(str(REPO / "config/paper-scale-14b.yaml"), ["shards=2", "transplant.precision=fp32"]),
        256, 2048, 1024, {"bf16": 0.83}, 48))
    after = job_dependencies(model_jobs(fp32, {"bf16": 1e-6, "fp32": 2e-6}))
    # at fp32 the 2x2 waits for the bf16 generation (the reference's prefixes) in its turn
    assert after["transplant_caches_0"] == {name for name in ledger if "_fp32_" in name}


def test_on_n_gpus_one_gpu_is_the_sum_and_more_gpus_shorten_the_wall(tmp_path):
    run = _config_run(tmp_path)
    overhead = Overhead.from_seconds(5.0, 1.0)
    one = project_config(run, TRITON[:2], overhead, TRITON[2:], non_model_s=7.0)
    rows = on_gpus(run, TRITON[:2], overhead, [1, 2, 4], TRITON[2:], non_model_s=7.0)
    assert [r["shards"] for r in rows] == [1, 2, 4] and [r["jobs_at_once"] for r in rows] == [1, 2, 4]
    assert abs(rows[0]["wall_s"] - one["wall"]["predicted_s"]) < 1e-9  # one GPU: the jobs one after another
    for r in rows:
        assert r["model_jobs_s"] >= max(r["critical_path_s"], r["work_s"] / r["jobs_at_once"]) - 1e-9
        assert abs(r["wall_s"] - r["model_jobs_s"] - 7.0) < 1e-9
    assert rows[1]["wall_s"] < rows[0]["wall_s"]
    # 4 shards of 2 batches: two of them empty, their jobs pay overhead; --shards 2 on 4 GPUs does not
    fixed = on_gpus(run, TRITON[:2], overhead, [4], TRITON[2:], shards=2, non_model_s=7.0)[0]
    assert fixed["shards"] == 2 and fixed["work_s"] < rows[2]["work_s"]
    try:
        on_gpus({**run, "config": {**run["config"], "gpus_per_job": 0}}, TRITON[:2], overhead, [2])
    except ValueError as exc:
        assert "gpus_per_job" in str(exc)
    else:
        raise AssertionError("gpus_per_job 0 was priced on N GPUs")


def _rulegraph(workdir) -> dict:
    """{rule: the rules whose outputs it reads}, from Snakemake's rule graph of the workflow in ``workdir``."""
    from workflow_runner import snakemake

    dot = snakemake(workdir, "--rulegraph", "--forceall").stdout
    names = dict(re.findall(r'^\s*(\d+)\[label = "([^"]+)"', dot, re.M))
    needs = {name: set() for name in names.values()}
    for source, target in re.findall(r"^\s*(\d+) -> (\d+)", dot, re.M):
        needs[names[target]].add(names[source])
    return needs


@pytest.mark.slow
def test_the_dag_of_the_model_jobs_is_the_workflow_s(tmp_path):
    """Each model rule waits for the model rules the workflow's rule graph puts before it (through the rules that
    load no model: the gathers, the selection): the projection's job_dependencies, by rule."""
    from workflow_runner import tiny_config

    config = tiny_config(tmp_path, shards=2, batch_size=2, decode_regime="static", precisions=["bf16", "fp32"],
                         reference_precision="bf16", gpus_per_job=1, transplant={"minimal": {"budget": 2}})
    needs = _rulegraph(tmp_path)
    shape = run_shape(config_run(config, P, S, N, DIVERGENT, 28))
    jobs = model_jobs(shape, {"bf16": 1e-6, "fp32": 2e-6})
    model = {j.rule for j in jobs}
    assert model <= set(needs), sorted(model - set(needs))

    def upstream(rule, seen):
        out = set()
        for before in needs[rule] - seen:
            seen.add(before)
            out |= {before} if before in model else upstream(before, seen)
        return out

    by_job = {j.name: j.rule for j in jobs}
    after = job_dependencies(jobs)
    for rule in model:
        projected = {by_job[d] for j in jobs if j.rule == rule for d in after[j.name]}
        assert projected == upstream(rule, set()), rule


def test_a_partial_last_batch_holds_a_share_of_the_selected_items_by_its_rows():
    """Packed transplant decodes keep a batch's row count, so how many selected items a batch holds sets how many
    decodes of its size run: in proportion to its rows, never more items than rows. The control: an equal share per
    batch (the projection before) puts 41.5 items in a batch of 14 rows."""
    from stagereplay.projection.jobs import by_rows_share

    held, items = {62: 3, 14: 1}, 166.0  # the paper config: 200 items in batches of 62, 83% selected
    shares = {rows: by_rows_share(items, held, rows) for rows in held}
    assert sum(shares[r] * b for r, b in held.items()) == pytest.approx(items)
    assert all(shares[r] <= r for r in held) and shares[14] == pytest.approx(166 * 14 / 200)
    equal = items / sum(held.values())
    assert equal > 14
