"""Decode speed on one GPU: the naive loops against the project's regimes, a projection of the paper-scale run,
and the bridge checked on the device. One command, one process:

    PYTHONPATH=src python bench/benchmark.py --out OUTDIR

Models are random-weight Qwen2.5 shapes built from Qwen2Config (no weights are downloaded): every number here is
a speed or an exactness check, never model quality. Writes OUTDIR/results.json (every measurement) and
OUTDIR/results.md (the tables), printing each table as it is measured. On a CPU, ``--tiny`` runs every code path
on a toy shape in seconds (that is how the script is tested; its numbers mean nothing).

The sections: the decode rates (``bench/decode_rates.py``), the rates of every stage the projection prices
(``bench/stage_rates.py``, priced by ``stagereplay.projection.paper.project``), and the bridge (here), on the
models of ``bench/random_models.py``. ``--floor-from`` prints a saved run's floor (``stagereplay.projection.floor``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import traceback
from pathlib import Path

import torch

from stagereplay.decode.eager import EagerDecoder
from stagereplay.decode.greedy import BoundaryMatcher, decode_rows
from stagereplay.decode.regimes import make_decoder
from stagereplay.decode.options import ATTENTIONS, KERNELS
from stagereplay.experiments.recipe import run
from stagereplay.experiments.rows import RunSettings
from stagereplay.io.ids import first_divergence
from stagereplay.models.loading import set_determinism
from stagereplay.projection.floor import fp32_floor, run_floor
from stagereplay.projection.paper import project

from decode_rates import decode_rates
from random_models import build_model, copy_rate, log, prompts_for, timed
from stage_rates import projection_measure

RESULTS: dict = {"decode": [], "projection": [], "bridge": [], "errors": []}


# -- the bridge on the device -------------------------------------------------------------------------------------

def bridge_study(model, precision, args, decoder, regime) -> list[dict]:
    """live vs incremental vs prefill through the package's recipe (one row each), on random prompts of
    ``bridge_prompt`` tokens."""
    rows = []
    vocab = model.config.vocab_size
    stage_len = args.bridge_stage
    settings = RunSettings(revision="random", precision=precision, max_stage_tokens=stage_len + 4,
                           max_new_tokens=args.bridge_suffix, decode_regime=regime)
    for p, prompt in enumerate(prompts_for(args.bridge_prompts, args.bridge_prompt, vocab, 11)):
        # stage_len free greedy tokens (a marker that never comes), then the boundary at the last of them
        free = decode_rows(decoder, [prompt], matcher=BoundaryMatcher(1, token_ids=[vocab + 1]),
                           max_stage_tokens=stage_len, max_new_tokens=0)[0].suffix_ids
        marker = free[stage_len - 1]
        matcher = BoundaryMatcher(free[:stage_len].count(marker), token_ids=[marker])
        live = run(decoder, "live", [prompt], settings, matcher=matcher)[0]
        assert live.stop_reason != "boundary_missing" and live.stage_ids == free[:stage_len]
        inc = run(decoder, "incremental", [prompt], settings, stages=[live.stage_ids])[0]
        pre1 = run(decoder, "prefill", [prompt], settings, stages=[live.stage_ids])[0]
        pre2 = run(decoder, "prefill", [prompt], settings, stages=[live.stage_ids], max_new_tokens=0)[0]
        f_live, f_inc, f_pre1, f_pre2 = live.fingerprints, inc.fingerprints, pre1.fingerprints, pre2.fingerprints
        first_layer = next((i for i, (a, b) in enumerate(zip(f_live[1], f_pre1[1])) if a != b), None)
        s_live, s_inc, s_pre = live.suffix_ids, inc.suffix_ids, pre1.suffix_ids
        row = {"regime": regime, "precision": precision, "prompt": p, "prompt_len": len(prompt),
               "stage_len": stage_len, "live_equals_incremental": f_live == f_inc,
               "prefill_replicas_equal": f_pre1 == f_pre2, "prefill_equals_live": f_pre1[0] == f_live[0],
               "first_K_layer_differing": first_layer,
               "suffix_live_equals_incremental": s_live == s_inc,
               "suffix_live_vs_prefill_first_divergence": first_divergence(s_live, s_pre),
               "suffix_len": args.bridge_suffix}
        log(f"  bridge {regime} {precision} prompt {p}: {row}")
        rows.append(row)
    return rows


# -- report ----------------------------------------------------------------------------------------------------

def render(meta: dict) -> str:
    L = [f"- date: {meta['date']}", f"- device: {meta['device']}", f"- torch {meta['torch']}, transformers "
         f"{meta['transformers']}, python {meta['python']}", f"- numerics: {meta['numerics']}",
         f"- measured device copy rate (read + write): {meta['copy_TB_s']:.2f} TB/s",
         "- models: **random weights** built from Qwen2Config with the real shapes; the floor is weight bytes / copy rate",
         "", "### Decode, batch 1 (tok/s)", "",
         "| shape | prec | weights GB | floor | generate | eager loop | cuda_graph (engine) | cuda_graph (device loop) | "
         "% floor | x generate |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in RESULTS["decode"]:
        L.append(f"| {r['shape']} | {r['precision']} | {r['weights_GB']:.1f} | {r['floor_tok_s']:.0f} | "
                 f"{r['generate_tok_s']:.1f} | {r['eager_loop_tok_s']:.1f} | {r['graph_engine_tok_s']:.1f} | "
                 f"{r['graph_device_loop_tok_s']:.1f} | {r['graph_engine_tok_s'] / r['floor_tok_s']:.0%} "
                 f"(device loop {r['graph_device_loop_tok_s'] / r['floor_tok_s']:.0%}) | "
                 f"{r['graph_engine_tok_s'] / r['generate_tok_s']:.1f}x |")
    L += ["", "### Decode, batched, cuda_graph (aggregate tok/s; ratio to batch-1 model.generate)", "",
          "| shape | prec | batch | continue_batch | x generate | device loop |", "| --- | --- | --- | --- | --- | --- |"]
    for r in RESULTS["decode"]:
        for b, v in r["batched"].items():
            L.append(f"| {r['shape']} | {r['precision']} | {b} | {v['continue_batch_tok_s']:.0f} | "
                     f"{v['continue_batch_tok_s'] / r['generate_tok_s']:.0f}x | {v['device_loop_tok_s']:.0f} |")
    controls = [r for r in RESULTS["decode"] if r.get("batch_control")]
    if controls:
        L += ["", "### Batch control (cuda_graph; batched live run of prompts of different lengths, left-padded)", "",
              "| shape | prec | rows | plan seed | replicas of the plan equal | rows sampled vs batch 1 | suffix disagreements | "
              "cache disagreements |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in controls:
            c = r["batch_control"]
            L.append(f"| {r['shape']} | {r['precision']} | {c['rows']} | {c['plan_seed']} | {c['replicas_equal']} | "
                     f"{c['sampled']} | {c['suffix_disagreements']} | {c['cache_disagreements']} |")
    if RESULTS["projection"]:
        L += ["", "### Reduced run of every stage, paper-scale lengths", "",
              "| shape | prec | P/S/N | rows | step ms (whole buffer) | step ms by attended span | decode tok/s | "
              "prefill tok/s | dump GB | dump GB/s | disk alone GB/s | load GB/s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for m in RESULTS["projection"]:
            by_span = ", ".join(f"{k}: {1e3 * v:.1f}" for k, v in m["span_step_s"].items())
            L.append(f"| {m['shape']} | {m['precision']} | {m['P']}/{m['S']}/{m['N']} | {m['rows']} | "
                     f"{1e3 * m['step_s']:.1f} | {by_span} | {m['decode_tok_s']:.0f} | {m['prefill_tokens_s']:.0f} | "
                     f"{m['dump_GB']:.2f} | {m['dump_GB_s']:.2f} | {m['disk_write_GB_s']:.2f} | {m['load_GB_s']:.2f} |")
        for key in ("projected", "projected_bucketed", "projected_bucketed_with_dumps"):
            pr = RESULTS.get(key)
            if not pr:
                continue
            L += ["", f"Projected paper-scale run ({pr['items']} items, divergent fraction {pr['divergent_fraction']:.2f}, "
                  f"decode attention: {pr['attention']}, dumps: {pr.get('dumps', 'divergent')}): "
                  f"**{pr['total_s'] / 3600:.2f} h**"]
            for prec, p in pr["parts"].items():
                L.append(f"- {prec}: decode {p['decode_s'] / 60:.1f} min ({p['decode_steps_per_item']:.0f} steps/item), "
                         f"prefill {p['prefill_s'] / 60:.1f} min, dumps {p['dump_s'] / 60:.1f} min"
                         + (f"; its linear maps alone at the best measured GEMM rate: "
                            f"{p['linear_floor_s'] / 60:.1f} min" if "linear_floor_s" in p else ""))
        gemm = [m for m in RESULTS["projection"] if "gemm_TFLOP_s_rows" in m]
        if gemm:
            L += ["", "| shape | prec | linear maps at the decode rows (TFLOP/s) | at 2048 rows (TFLOP/s) |",
                  "| --- | --- | --- | --- |"]
            L += [f"| {m['shape']} | {m['precision']} | {m['gemm_TFLOP_s_rows']:.1f} ({m['gemm_rows']} rows) | "
                  f"{m['gemm_TFLOP_s_large']:.1f} |" for m in gemm]
    if RESULTS["bridge"]:
        L += ["", "### Bridge on the device (package engine)", "",
              "| regime | prec | prompt | live == incremental | prefill replicas equal | prefill == live | first K layer differing | "
              "suffix live == incremental | suffix live vs prefill: first divergence |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for b in RESULTS["bridge"]:
            L.append(f"| {b['regime']} | {b['precision']} | {b['prompt']} | {b['live_equals_incremental']} | "
                     f"{b['prefill_replicas_equal']} | {b['prefill_equals_live']} | {b['first_K_layer_differing']} | "
                     f"{b['suffix_live_equals_incremental']} | {b['suffix_live_vs_prefill_first_divergence']} |")
    if RESULTS["errors"]:
        L += ["", "### Errors", ""] + [f"- {e}" for e in RESULTS["errors"]]
    return "\n".join(L) + "\n"


def command_line() -> argparse.ArgumentParser:
    """The options: each section's shapes and lengths, the projection's measurement, the projected run's counts."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="toy shape on any device (tests the script)")
    ap.add_argument("--shapes", default="1.5B,14B")
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--bridge-shape", default="1.5B")
    ap.add_argument("--bridge-prompts", type=int, default=3)
    ap.add_argument("--bridge-prompt", type=int, default=200)
    ap.add_argument("--bridge-stage", type=int, default=32)
    ap.add_argument("--bridge-suffix", type=int, default=48)
    ap.add_argument("--control-items", type=int, default=16)
    ap.add_argument("--control-sample", type=int, default=8)
    ap.add_argument("--project-shape", default="14B")
    ap.add_argument("--proj-prompt", type=int, default=256)
    ap.add_argument("--proj-stage", type=int, default=2048)
    ap.add_argument("--proj-suffix", type=int, default=1024)
    ap.add_argument("--proj-max-rows", type=int, default=256, help="cap on the projection's decode rows")
    ap.add_argument("--proj-headroom-gib", type=float, default=8.0,
                    help="device memory left beside the weights and K/V rows when sizing the projection's batch")
    ap.add_argument("--proj-prefill-rows", type=int, default=4)
    ap.add_argument("--proj-steps", type=int, default=8)
    ap.add_argument("--proj-bucket", type=int, default=256, help="attention span bucket of the projection's decoder")
    ap.add_argument("--decode-attention", default="masked", choices=list(ATTENTIONS),
                    help="the static decoder's attention (triton: each row's keys up to its position; needs Triton)")
    ap.add_argument("--decode-kernels", default="library", choices=list(KERNELS),
                    help="the static forward's small operations (fused: one Triton kernel each; needs Triton)")
    ap.add_argument("--only-projection", action="store_true", help="skip the decode-rate and bridge sections")
    ap.add_argument("--fp32-attention-config", type=json.loads, default=None,
                    help="JSON object of fp32 attention settings for the Triton kernels (see bench/fp32_attention.py)")
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--divergent", type=float, default=166 / 200)
    ap.add_argument("--model-jobs", type=int, default=0, help="model-loading jobs of the projected run")
    ap.add_argument("--job-overhead-s", type=float, default=0.0,
                    help="each model job's start, imports and load (bench/pipeline_run.py measures it)")
    ap.add_argument("--transplant-specs", type=int, default=1,
                    help="transplant runs per direction (1: the all-layer one, the study's; the default sweeps: 11)")
    ap.add_argument("--minimal-budget", type=int, default=0, help="the minimal-transplant search's runs per direction")
    ap.add_argument("--floor-from", default=None,
                    help="a saved run's JSON: print each arm's floor (fp32 at the datasheet rate) and exit, no GPU")
    ap.add_argument("--scratch", default=None, help="folder for the cache-dump measurement (default: temp dir)")
    return ap


def print_floors(args) -> None:
    """``--floor-from``: each arm's floor of a saved run (fp32 at the datasheet rate) and the whole run's, as JSON."""
    saved = json.loads(Path(args.floor_from).read_text())
    kwargs = {"model_jobs": args.model_jobs, "job_overhead_s": args.job_overhead_s,
              "transplant_specs": args.transplant_specs, "minimal_budget": args.minimal_budget}
    floors = fp32_floor(saved["projection"], args.items, args.divergent, saved["meta"]["copy_TB_s"], **kwargs)
    floors["whole_run"] = run_floor(saved["projection"], args.items, args.divergent, saved["meta"]["copy_TB_s"],
                                    **kwargs)
    print(json.dumps(floors, indent=1))


def shrink_to_tiny(args) -> None:
    """``--tiny``: the toy shape and lengths for every section, so that every code path runs in seconds."""
    args.shapes = args.bridge_shape = args.project_shape = "tiny"
    args.prompt_len, args.new_tokens, args.batches = 24, 6, "2,3"
    args.bridge_prompts, args.bridge_prompt, args.bridge_stage, args.bridge_suffix = 1, 12, 4, 4
    args.control_items, args.control_sample = 3, 2
    args.proj_prompt, args.proj_stage, args.proj_suffix, args.proj_max_rows, args.proj_steps = 8, 16, 8, 3, 2
    args.proj_bucket = 8


def run_meta(args, device: str, flags: dict) -> dict:
    """The run's provenance (date, device, versions, numerics flags, argv) and the device's measured copy rate."""
    import transformers

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu:{platform.machine()}",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "numerics": flags, "argv": sys.argv[1:],
            "weights": "random (Qwen2Config with the real shapes)"}
    if args.decode_attention == "triton":
        from stagereplay.models import invariant_triton

        meta["triton_attention_configs"] = invariant_triton.CONFIGS
    meta["copy_TB_s"] = copy_rate(device, 0.05 if args.tiny else 4.0) / 1e12
    log(f"{meta['device']}: copy rate {meta['copy_TB_s']:.2f} TB/s; torch {meta['torch']}, transformers "
        f"{meta['transformers']}")
    return meta


def measure_model(model, shape: str, precision: str, args, device: str, copy_B_s: float, save) -> None:
    """The sections one model is measured in, each saved as it ends: its decode rates, the bridge (on the bridge's
    shape) and the projection's rates (on the projection's shape)."""
    if not args.only_projection:
        RESULTS["decode"].append(decode_rates(model, shape, precision, args, copy_B_s))
        save()
    if shape == args.bridge_shape and not args.only_projection:
        RESULTS["bridge"] += bridge_study(model, precision, args, EagerDecoder(model, ()), "eager")
        max_len = args.bridge_prompt + args.bridge_stage + args.bridge_suffix + 8
        regime = "cuda_graph" if device == "cuda" else "static"
        RESULTS["bridge"] += bridge_study(model, precision, args, make_decoder(
            model, (), regime, max_len=max_len), regime)
        save()
    if shape == args.project_shape:
        RESULTS["projection"].append(projection_measure(model, shape, precision, args))
        save()


def project_run(args) -> None:
    """The paper-scale run projected from the measured rates: as asked, without the audit, span-bucketed, and
    span-bucketed with the divergent items' cache dumps."""
    jobs = {"model_jobs": args.model_jobs, "job_overhead_s": args.job_overhead_s,
            "transplant_specs": args.transplant_specs, "minimal_budget": args.minimal_budget}
    RESULTS["projected"] = project(RESULTS["projection"], args.items, args.divergent, **jobs)
    RESULTS["projected_without_audit"] = project(RESULTS["projection"], args.items, args.divergent, audit=False)
    RESULTS["projected_bucketed"] = project(RESULTS["projection"], args.items, args.divergent, bucketed=True,
                                            **jobs)
    RESULTS["projected_bucketed_with_dumps"] = project(RESULTS["projection"], args.items, args.divergent,
                                                       bucketed=True, dumps="divergent")


def main(argv=None):
    ap = command_line()
    args = ap.parse_args(argv)
    if args.floor_from:
        print_floors(args)
        return
    if not args.out:
        ap.error("--out is needed to measure (only --floor-from runs without it)")
    if args.tiny:
        shrink_to_tiny(args)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.fp32_attention_config:
        from stagereplay.models import invariant_triton

        invariant_triton.CONFIGS["fp32"] = {**invariant_triton.CONFIGS["fp32"], **args.fp32_attention_config}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    flags = set_determinism(os.cpu_count() if device == "cuda" else 1)
    meta = run_meta(args, device, flags)
    RESULTS["meta"] = meta

    def save():
        (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        (out / "results.md").write_text(render(meta))

    for shape in args.shapes.split(","):
        for precision in args.precisions.split(","):
            model = None
            try:
                dt, model = timed(lambda: build_model(shape, precision, device))
                log(f"{shape} {precision}: built in {dt:.1f} s")
                measure_model(model, shape, precision, args, device, meta["copy_TB_s"] * 1e12, save)
            except Exception as exc:  # keep measuring the other shapes; the error goes into the results
                traceback.print_exc()
                RESULTS["errors"].append(f"{shape} {precision}: {type(exc).__name__}: {exc}")
                save()
            del model
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    if RESULTS["projection"]:
        project_run(args)
    save()
    log(render(meta))


if __name__ == "__main__":
    main()
