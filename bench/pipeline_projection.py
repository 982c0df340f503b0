"""Each rule of a measured workflow run, projected from measured rates, against its measured wall time.

    python bench/pipeline_projection.py --run RUN.json --measures M.json [--measures-batch1 M1.json] \\
        (--overhead-s O [--load-s L] | --overhead-json OVERHEAD.json) [--json OUT.json]
    python bench/pipeline_projection.py --measure-overhead MODEL_DIR --precision bf16 fp32 [--prepared-models DIR] \\
        [--regime cuda_graph --rows 16 --prompt 18 --stage 128 --max-len 258 --marker "~"] [--json OVERHEAD.json]
    python bench/pipeline_projection.py --config CONFIG.yaml [--set KEY=VALUE ...] --prompt P --stage S --suffix N \\
        --divergent bf16=0.83,fp32=0 --layers 48 --measures M.json [--measures-batch1 M1.json] \\
        (--overhead-s O [--load-s L] | --overhead-json OVERHEAD.json [--weights-GB bf16=28,fp32=56 --load-GB-s 2] \\
        [--fingerprint-GB-s F] [--fingerprint-copy-GB-s C]) [--non-model-s C] [--compare-project [MEASURES.json ...]] \\
        [--schedule lockstep|suffix] [--gpus N [N ...] [--shards K]] [--json OUT.json]

RUN.json is what ``bench/pipeline_run.py`` writes (it must carry the config it ran with, ``config``, and the counts
its results record, ``counts``); M.json what ``bench/benchmark.py --only-projection --out DIR`` writes as
DIR/results.json (its ``projection`` list: per precision, a decode step fitted as a + b * span at ``rows`` rows, a
one-shot prefill rate in tokens/s, a cache-dump rate); M1.json the same measured with ``--proj-max-rows 1`` (the
batch-invariance control decodes at batch 1).

The projection is the package's :mod:`stagereplay.projection` (src/stagereplay/projection/): the model jobs of the
workflow's own DAG of the config (``dag``, through Snakemake's API) and the work each decodes, counted by its rule as
the stage code does it (``jobs``, ``counts``), priced at the measures' rates (``pricing``),
placed on N GPUs (``schedule``) and set against the run (``report``); each module's docstring gives its part of the
model. This script reads the files, builds the overhead and prints the tables:

- ``--run``: each rule of the run against its measured time (``report.compare``); ``--schedule`` overrides the
  schedule the run recorded.
- ``--config``: a run not made (``report.project_config``), its config's keys overridden with ``--set``; the wall
  for one GPU adds ``--non-model-s``, a stated constant for the jobs that load no model (default 0: not counted).
  Where the measures carry the shape's linear parameters, the column ``floor`` is each rule's own decode and prefill
  at the datasheet rates (no start-up or host work): what no schedule of that rule's work can beat on this GPU.
  ``--weights-GB`` with ``--load-GB-s`` prices each precision's load as its weights read once at that rate (an
  assumption where the shape's load was not measured); ``--compare-project`` splits
  ``benchmark.project(bucketed=True)``'s count of the same variant by rule (``paper.project_by_rule``); ``--gpus``
  gives the wall on N GPUs of one host (``schedule.on_gpus``; ``--shards K``: K shards at every N).
- The overhead: ``--overhead-s O`` is one job with one load, ``--load-s L`` the part of O that a job pays again for
  each further precision it loads (default 0; a job that loads no model is then priced at O - L).
  ``--overhead-json`` takes them apart (start, first load's extra, each precision's load) with the host rates from
  ``--measure-overhead``, which times them in a fresh Python process as a job's script makes them
  (``bench/job_overhead.py``), without Snakemake.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stagereplay.experiments.transplant_specs import enumerate_sweeps
from stagereplay.projection.paper import project_by_rule
from stagereplay.projection.rates import Overhead, load_measures
from stagereplay.projection.report import compare, project_config, render, render_gpus, render_projection
from stagereplay.projection.schedule import on_gpus
from stagereplay.projection.shape import SCHEDULE, SCHEDULES, config_run, load_config

from job_overhead import measure_overhead


def parse_shares(text: str) -> dict:
    """``bf16=0.83,fp32=0`` -> {"bf16": 0.83, "fp32": 0.0}."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r}: give PRECISION=VALUE")
        out[key.strip()] = float(value)
    return out


# ---- the command line ------------------------------------------------------------------------------------------------
def main_config(args, ap, overhead: Overhead, measured: dict) -> int:
    """--config: project a run not made, rule by rule."""
    lengths = (args.prompt, args.stage, args.suffix)
    if None in lengths or args.layers is None:
        ap.error("--config needs --prompt, --stage, --suffix and --layers")
    if args.weights_GB:
        if not args.load_GB_s:
            ap.error("--weights-GB needs --load-GB-s")
        first_step = measured.get("first_step_s", {})
        overhead.load_s = {p: gb / args.load_GB_s + first_step.get(p, 0.0)
                           for p, gb in parse_shares(args.weights_GB).items()}
    if args.fingerprint_GB_s:
        overhead.fingerprint_GB_s = args.fingerprint_GB_s
    if args.fingerprint_copy_GB_s:
        overhead.fingerprint_copy_GB_s = args.fingerprint_copy_GB_s
    config = load_config(args.config, args.set)
    args.schedule = args.schedule or SCHEDULE
    run = config_run(config, *lengths, parse_shares(args.divergent), args.layers, args.stage_shortest,
                     args.schedule)
    measures = load_measures(args.measures)
    saved = json.loads(Path(args.measures).read_text())
    copy_TB_s = saved.get("meta", {}).get("copy_TB_s") if isinstance(saved, dict) else None
    report = project_config(run, measures, overhead, load_measures(args.measures_batch1) if args.measures_batch1
                            else None, non_model_s=args.non_model_s, copy_TB_s=copy_TB_s)
    report["config"] = config
    report["argv"] = sys.argv[1:]
    old = None
    if args.compare_project is not None:
        kwargs = {"transplant_specs": len(enumerate_sweeps(config["transplant"]["sweeps"], args.layers)),
                  "minimal_budget": config["transplant"]["minimal"]["budget"],
                  "model_jobs": args.project_model_jobs, "job_overhead_s": args.project_job_overhead_s}
        share = parse_shares(args.divergent).get("bf16", 0.0)
        old = {Path(path).stem: project_by_rule(load_measures(path), config["n_items"], share, **kwargs)
               for path in (args.compare_project or [args.measures])}
        report["project_by_rule"] = {"arguments": {"items": config["n_items"], "divergent": share, **kwargs},
                                     **{label: table for label, table in old.items()}}
    print(render_projection(report, old))
    if args.gpus:
        report["gpus"] = on_gpus(run, measures, overhead, args.gpus, load_measures(args.measures_batch1)
                                 if args.measures_batch1 else None, args.shards, args.non_model_s)
        print(render_gpus(report["gpus"], args.schedule))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


def command_line() -> argparse.ArgumentParser:
    """The options of the three modes: --run (a measured run), --config (a run not made), --measure-overhead."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", help="bench/pipeline_run.py's JSON (with its config and counts)")
    ap.add_argument("--measures", help="bench/benchmark.py --only-projection's results.json, at the run's batch size")
    ap.add_argument("--measures-batch1", help="the same measured with --proj-max-rows 1")
    ap.add_argument("--overhead-s", type=float, help="one model job's start, imports and one model load")
    ap.add_argument("--load-s", type=float, default=0.0,
                    help="the part of --overhead-s a job pays again for each further precision it loads")
    ap.add_argument("--overhead-json", help="--measure-overhead's JSON (start, loads and host rates)")
    ap.add_argument("--json", help="write the comparison (or the overhead measured) here")
    ap.add_argument("--schedule", choices=SCHEDULES, default=None,
                    help="a built construction's schedule in a batch of several rows: suffix (only its suffix steps, "
                         "from each row's boundary: the decoder's now; the default with --config, and with --run where "
                         "the run records none) or lockstep (the live schedule's steps: runs made before the suffix "
                         "schedule). With --run it overrides the run's recorded schedule")
    made = ap.add_argument_group("--config: a run not made, projected from its config and lengths")
    made.add_argument("--config", help="a workflow config (YAML); the schema's defaults filled as the workflow does")
    made.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config key (dotted, VALUE as YAML), e.g. transplant.minimal.budget=0")
    made.add_argument("--suffix", type=float, help="suffix tokens (mean = a batch's longest); --prompt and --stage "
                      "give the prompt and stage tokens")
    made.add_argument("--divergent", default="", help="share of items whose matched suffixes differ, by precision: "
                      "bf16=0.83,fp32=0")
    made.add_argument("--stage-shortest", type=float, default=None,
                      help="a batch's shortest stage (a built construction skips the steps before its boundary); "
                           "default: --stage, as if every stage had the mean length")
    made.add_argument("--layers", type=int, help="the model's layer count (the transplant sweeps' specs)")

    made.add_argument("--gpus", type=int, nargs="+", metavar="N",
                      help="also the wall on N GPUs of one host (e.g. 1 2 4 8): shards = N, the rule DAG's jobs "
                           "placed on them")
    made.add_argument("--shards", type=int, help="with --gpus: this shard count at every GPU count (default: N)")
    made.add_argument("--non-model-s", type=float, default=0.0,
                      help="a stated constant for the jobs that load no model (default 0: not counted)")
    made.add_argument("--weights-GB", default="", help="with --load-GB-s: each precision's load is its weights read "
                      "once at that rate (plus the measured first step), e.g. bf16=28,fp32=56")
    made.add_argument("--load-GB-s", type=float, help="the disk rate of --weights-GB's loads")
    made.add_argument("--fingerprint-GB-s", type=float, help="the fingerprint rate (instead of --overhead-json's)")
    made.add_argument("--fingerprint-copy-GB-s", type=float,
                      help="the pending fingerprints' snapshot copy to page-locked memory (instead of "
                           "--overhead-json's): fingerprints priced as that copy plus the hashing beyond the decode")
    made.add_argument("--compare-project", nargs="*", metavar="MEASURES.json",
                      help="also split benchmark.project(bucketed=True)'s count of the same variant by rule, on "
                           "these measures (default: --measures)")
    made.add_argument("--project-model-jobs", type=int, default=12, help="project()'s model jobs (12 in RESULTS)")
    made.add_argument("--project-job-overhead-s", type=float, default=15.0, help="project()'s seconds a job")
    over = ap.add_argument_group("--measure-overhead: a model job's fixed cost, timed in a fresh process")
    over.add_argument("--measure-overhead", metavar="MODEL_DIR", help="the model folder the run's jobs load")
    over.add_argument("--precision", nargs="+", default=["bf16"])
    over.add_argument("--prepared-models", help="results/<run>/models/<revision>.json: load the store entries that "
                      "run recorded, as the workflow's jobs do")
    over.add_argument("--revision", default="local")
    over.add_argument("--device", default="auto")
    over.add_argument("--regime", default="cuda_graph")
    over.add_argument("--rows", type=int, default=1, help="the decoder's rows (the run's batch size)")
    over.add_argument("--prompt", type=float, default=None, help="prompt tokens of the first step (default 16; "
                      "with --config: the projected run's prompt, mean = a batch's longest)")
    over.add_argument("--stage", type=float, default=None, help="stage length of the matcher's timing (default 64; "
                      "with --config: the projected run's stage, mean = a batch's longest)")
    over.add_argument("--max-len", type=int, default=256, help="the decoder's buffer (the run's decode_max_len)")
    over.add_argument("--marker", default=None, help="the boundary marker (times the matcher's text decode)")
    return ap


def main_measure_overhead(args) -> int:
    """--measure-overhead: a model job's fixed cost, timed in a fresh process; printed (and written) as JSON."""
    args.prompt = 16 if args.prompt is None else int(args.prompt)
    args.stage = 64 if args.stage is None else int(args.stage)
    measured = measure_overhead(args)
    text = json.dumps(measured, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def main_run(args, overhead: Overhead) -> int:
    """--run: each rule of a measured run against its projection."""
    run = json.loads(Path(args.run).read_text())
    if args.schedule:
        run["schedule"] = args.schedule
    report = compare(run, load_measures(args.measures), overhead,
                     load_measures(args.measures_batch1) if args.measures_batch1 else None)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    ap = command_line()
    args = ap.parse_args(argv)
    if args.measure_overhead:
        return main_measure_overhead(args)
    if not ((args.run or args.config) and args.measures) or (args.overhead_s is None) == (args.overhead_json is None):
        ap.error("give --run or --config, --measures and one of --overhead-s or --overhead-json (or "
                 "--measure-overhead MODEL_DIR)")
    measured = json.loads(Path(args.overhead_json).read_text()) if args.overhead_json else {}
    overhead = (Overhead.from_json(measured) if args.overhead_json
                else Overhead.from_seconds(args.overhead_s, args.load_s))
    if args.config:
        return main_config(args, ap, overhead, measured)
    return main_run(args, overhead)


if __name__ == "__main__":
    sys.exit(main())
