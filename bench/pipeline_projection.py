"""Each rule of a measured workflow run, projected from measured rates, against its measured wall time.

    python bench/pipeline_projection.py --run RUN.json --measures M.json [--measures-batch1 M1.json] \\
        (--overhead-s O [--load-s L] | --overhead-json OVERHEAD.json) [--json OUT.json]
    python bench/pipeline_projection.py --measure-overhead MODEL_DIR --precision bf16 fp32 [--prepared-models DIR] \\
        [--regime cuda_graph --rows 16 --prompt 18 --stage 128 --max-len 258 --marker "~"] [--json OVERHEAD.json]
    python bench/pipeline_projection.py --config CONFIG.yaml [--set KEY=VALUE ...] --prompt P --stage S --suffix N \\
        --divergent bf16=0.83,fp32=0 --layers 48 --measures M.json [--measures-batch1 M1.json] \\
        (--overhead-s O [--load-s L] | --overhead-json OVERHEAD.json [--weights-GB bf16=28,fp32=56 --load-GB-s 2] \\
        [--fingerprint-GB-s F]) [--non-model-s C] [--compare-project [MEASURES.json ...]] \\
        [--schedule lockstep|suffix] [--gpus N [N ...] [--shards K]] [--json OUT.json]

RUN.json is what ``bench/pipeline_run.py`` writes (it must carry the config it ran with, ``config``, and the counts
its results record, ``counts``); M.json what ``bench/benchmark.py --only-projection --out DIR`` writes as
DIR/results.json (its ``projection`` list: per precision, a decode step fitted as a + b * span at ``rows`` rows, a
one-shot prefill rate in tokens/s, a cache-dump rate); M1.json the same measured with ``--proj-max-rows 1`` (the
batch-invariance control decodes at batch 1).

The model. Every model job's wall time is its overhead plus the work it decodes. The work is counted from the stage
code (src/stagereplay/stages, src/stagereplay/experiments, workflow/rules) as

- batched decode steps at a row count, priced at the measure's a + b * span for that precision and row count
  (``benchmark.decode_seconds``): for a measure of the masked attention every step at the decoder's whole buffer L
  (``decode_max_len``: the masked attention reads every buffer position at every step); for a measure of the
  triton attention (its ``step_fit`` bucket is 1: each row's keys up to its position) each step at its own
  position, summed over a cell's steps from the cache length it starts at (a row count measured at neither: the
  fit interpolated linearly in the rows between the two measured row counts around it);
- one-shot prefill tokens, at the measure's ``prefill_tokens_s``;
- cache-dump GB, at the measure's ``dump_GB_s``;
- and, where ``--overhead-json`` gives their rates (``--measure-overhead`` measures them), the greedy loop's host
  work per decode step (the greedy choice and its device sync), the boundary matcher's text decode per live row
  and stage step, and the sha256 fingerprints of every row's boundary cache (P + S - 1 positions). In the
  ``cuda_graph`` regime the loop's lookahead runs the host's checks of a step while the device runs the next, so
  of the greedy and matcher work only what exceeds the device's decode time is counted (for a run that records
  ``greedy_loop``, the loop it ran; a run not made, the loop of ``bench/pipeline_run.py``'s ``GREEDY_LOOP``).

Notation: n items, B = min(batch_size, n) rows a batch, ceil(n / B) batches (a partial last batch decodes a full
batch's steps at its own, fewer rows), P, S, N the ledger's mean prompt, stage and suffix lengths; in lockstep W,
S_b, N_b are the mean over batches of a batch's longest prompt (its padded width), stage and suffix. d_p is the
share of items whose matched live and prefill suffixes differ at precision p.

One *cell* is one construction decoded over one batch (``decode_rows``):

- batch > 1, the ``lockstep`` schedule (``--schedule lockstep``: the live schedule for every construction, as
  the decoder ran before the suffix schedule; price runs made then with it): the prompts in one forward (B * W tokens), then S_b + N_b - 1 steps at B rows (S_b - 1 without a
  suffix). ``prefill`` first builds its caches in one forward of B * (W + S_b - 1) tokens; ``chunked`` and
  ``prefix_cached`` build theirs by per-row forwards of their segments (priced as one batch-1 step each plus their
  tokens at the prefill rate: not measured as such). A built construction (``prefill``, ``chunked``,
  ``prefix_cached``) skips the steps before the batch's first boundary, K = s_b - 1 of them (s_b: the mean over
  batches of a batch's shortest stage; the ledger's ``batch_stage_shortest``, 1 for a run that did not record it,
  made before the skip): S_b + N_b - 1 - K steps from cache length W + K.
- batch > 1, the ``suffix`` schedule (the default, the decoder's now: decode/greedy.py; a run's JSON may record
  ``schedule``, a run that records none is priced as suffix):
  ``live`` and ``incremental`` as in lockstep; a built construction builds its caches as there (the same
  forwards and tokens) and then decodes only N_b steps at B rows (none without a suffix), each row from its own
  boundary (priced from the rows' mean, cache length W + S - 1): no prompt forward, no teacher-forced stage step,
  no skip. With every stage of one length (s_b = S_b) the lockstep skip leaves the same N_b steps, and the two
  schedules differ by the prompt forward only.
- batch 1 (one row, which starts at its boundary): ``live`` and ``incremental`` P tokens then S + N - 1 steps at 1
  row (S - 1 without a suffix); ``prefill`` P + S - 1 tokens then N steps (none without a suffix). Either schedule.

Counts per rule (per job), as the stage code does them. With ``shards: K`` every model rule runs K jobs over
whole batches of the plan (batch b on shard b % K; at batch 1, item by item): a per-precision rule one job per
precision and shard, the others one job per shard with every precision in it, each loading what the one job loads
(the stages load on every shard, so that the parts record one provenance; a shard without a batch pays its
overhead and loads only). A shard's batches holding one of k chosen items are its share of the expected batches
(the chance each of its batches holds one, ``RunShape.holding``; a recorded count spread by the same shares), and
a count of items (the batch-invariance sample, the dumped bytes) its share of the items:

- reconstruct_prefixes (per precision and shard): per batch, the matched experiment, live x2 and prefill x2 (two
  replicas each), and one incremental cell with suffix in every batch holding a bridge row (``bridge.n_rows``).
- generate_fixed_prefix (per precision and shard): per batch, every construction of
  ``fixed_prefix.constructions`` x2 (replicas), over the reference precision's prefixes.
- audit_ledger (per precision and shard): per batch, the matched experiment again with one replica (live x1,
  prefill x1; at every precision, since reconstruct_prefixes ran it at every precision) and every fixed-prefix
  construction x1.
- check_batch_invariance (per shard, every precision loaded in turn): at batch size 1 nothing (no model loaded).
  Else per precision, for each of min(``batch_invariance.sample``, n) items alone at batch 1: a live cell and a
  prefill cell (over the batched row's stage).
- measure_cache_differences (per shard, each of ``cache_differences.precisions`` loaded in turn; none at
  ``n_items`` 0): per precision, every batch holding one of min(``n_items``, n) sampled items: incremental and
  prefill cells without a suffix.
- dump_caches (per shard): per precision of the ledger that has items to dump (``dump.items``: divergent, d_p * n
  items; all; none), one load, and per batch holding one: both constructions of ``transplant.constructions`` rebuilt
  with their suffixes (live as incremental; the stage's ``Rebuild``), and two caches per item written.
- transplant_caches (per shard, at the transplant precision, always loaded): per batch holding a selected item
  (``transplant.select``: divergent, d * n; sample:k, k; a list), the Rebuild (two cells), then for each transplant
  spec (``enumerate_sweeps(transplant.sweeps, layers)``: 11 for the default sweeps and 28 layers) one cell per
  direction, of the recipient's construction (live -> prefill: a prefill cell; prefill -> live: incremental).
- find_minimal_transplants (per shard; no model loaded at budget 0 or without a divergent selected item): per batch
  holding a searched item (the divergent selected ones), the Rebuild, then per direction one recipient cell per
  round of the lockstep search (a batch's rounds: the most runs any of its rows used; at most the budget).
- measure_divergence_onset (per shard): per precision of the ledger with divergent items, one load, and per batch
  holding one, the Rebuild.
- replay_fixed_prefixes (per shard, transplant revisions other than the primary; bench/pipeline_run.py runs none):
  not projected.
- measure_fidelity (per precision and shard; none with ``fidelity.constructions`` empty): per batch holding a
  compared item (``fidelity.items``: all, or a sample), a ``live`` cell with its suffix and one cell per construction
  of ``fidelity.constructions`` (teacher-forced through live's suffix, from its boundaries in the suffix schedule).
  The loop observes every step, so the lookahead is off and the greedy host work counts in full; besides, per row and
  suffix step, the fp32 logits kept on the device and the per-step comparison (KL, logit difference), at rates from
  ``--overhead-json`` or, where it gives none, assumed (10 us and 22 us a row-step: not measured on a GPU; the
  output says so). Against the measured H200 run it projects 0.70 of the stage's time (bench/RESULTS.md).

Counts read from the run's results where it recorded them (``counts`` in RUN.json: the batches, the batches
holding bridge rows, the batch-invariance rows, the cache-difference batches, the dumped items and bytes, the
transplanted items and specs per direction, the minimal search's rounds per direction, the onset's items, and the
decode buffer L); derived from the config and the ledger's divergent shares otherwise (a batch holds one of k
items chosen among n with the hypergeometric chance). The report lists which was which.

Overhead. Every model job pays its process start and imports, and for each model it loads, the load, the decoder
and the CUDA-graph capture of its first step; its first load also imports the model's code. ``--overhead-s O`` is
one job with one load, ``--load-s L`` the part of O that a job pays again for each further precision it loads
(default 0; a job that loads no model is then priced at O - L). ``--overhead-json`` takes them apart (start, first
load's extra, each precision's load) with the host rates above from ``--measure-overhead``, which times them in a
fresh Python process as a job's script makes them (``stagereplay.stages.jobs.load``, the decoder, a first step),
without Snakemake; where Snakemake is installed it also times the import of ``snakemake.script`` (a job's script
preamble makes it), inside ``start_s``. Snakemake's scheduling and the benchmark wrapper are in none of them.

A run not made (``--config``): the same counts, all derived from a workflow config (the schema's defaults filled
as the workflow fills them, ``--set`` overriding keys) and the given lengths (a batch's longest prompt, stage and
suffix taken equal to the means), divergent shares and layer count; the decode buffer L = the longest prompt +
``max_stage_tokens`` + ``max_new_tokens``, as ``reconstruct_prefixes`` sets it. Each model job priced as above;
the wall for one GPU is the model jobs one after another plus ``--non-model-s``, a stated constant for the jobs
that load no model (default 0: not counted). ``--weights-GB`` with ``--load-GB-s`` prices each precision's load
as its weights read once at that rate (an assumption where the shape's load was not measured). Where the
measures carry the shape's linear parameters and their file the copy rate, the report gives the floor of the
same work (``benchmark.work_floor``: ``run_floor``'s pricing of these counts); ``--compare-project`` splits
``benchmark.project(bucketed=True)``'s count of the same variant by rule (``project_by_rule``).

N GPUs (``--gpus N [N ...]``, config mode): for each N the config's ``shards`` set to N (``--shards K``: K at
every N), every model job priced as above, and the jobs placed on the GPUs of one host by a list scheduler
(``list_schedule``): as many at a time as ``--resources gpu=N`` lets jobs of ``gpus_per_job`` GPUs run (each on
GPUs of its own, so at the measured speed; ``gpus_per_job: 0`` is refused), in the order of the rule DAG
(``job_dependencies``: a shard's fixed-prefix 2x2 after the reference precision's generation of that shard, the
transplants and the minimal search after the two ledger rules' jobs at the transplant precision, every other later
model job after every job of the two ledger rules, which ``gather_ledger`` joins), a free GPU taking the
ready job with the longest path to the end. The jobs that load no model take no time in it (their ``--non-model-s``
is added to the wall, as on one GPU). On one GPU the wall is the model jobs' sum, as above. Snakemake does not know
the jobs' times, so its order can be worse than this one; the report gives the bounds, the critical path and the
work over the GPUs.

Not projected (reported with their measured times): the rules that load no model, select_items, gather_ledger,
gather_bridge, gather_audit, check_audit, gather_transplant_baseline, select_transplant_items, plot_figures,
build_report, build_item_browser,
and prepare_model (it loads the model source once per precision, but claims no GPU and runs before every model job).

Where this counts otherwise than ``benchmark.project()`` (the paper-scale projection, left as it is): in a batch of
several rows, in the lockstep schedule, every construction runs the live schedule, so a prefill cell decodes
S + N - 1 steps less the skip as the others do, besides its one-shot prefill (project() gives it N steps, which holds
at batch 1 and in the suffix schedule only); a step attends over the
whole buffer for a masked-attention measure, over its own position for a triton one (project(bucketed=True) prices
bucketed spans, a bucket of one position for the triton attention); the items fill whole batches, the last one
partial (project() prices 200 rows as 200/62 batches at the 62-row rate); the matched experiment runs
at every precision, in reconstruct_prefixes and again in the audit (project() counts it at bf16 only); the bridge's
incremental cell, the batch-invariance control, cache differences, dumps' rebuilds and the divergence onset are
counted; and jobs are counted one by one, each with its overhead and loads.

The run's wall, with ``--resources gpu=1`` and every model job claiming the GPU (``gpus_per_job: 1``): the model
jobs run one after another, so the wall is the sum of their projected times plus the time the run spends with no
model job running, taken as measured (not projected): from the Snakemake log where the run recorded its jobs'
start and end (``log_jobs``: Snakemake's start, select_items and prepare_model before the first model job,
gather_ledger between the 2x2 and the audit, the reports after the last, and whatever else ran alone), else the
benchmarked non-model jobs before the first model job and after the last. Where model jobs could share the device
(another ``--gpu-slots``, ``gpus_per_job: 0``), the wall is not compared.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "workflow/schemas/config.schema.yaml"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/benchmark.py, imported where its rates are priced

BEFORE_MODEL_JOBS = ("select_items", "prepare_model")  # run side by side before the first model job
# after the last model job: the longer of plot_figures and build_item_browser, then build_report
AFTER_MODEL_JOBS = (("plot_figures", "build_item_browser"), ("build_report",))


# ---- the run's shape: what the counts are functions of ----------------------------------------------------------
def with_schema_defaults(value: dict, schema: dict) -> dict:
    """The config with every key it leaves out at the schema's default (as the workflow's validation fills them)."""
    out = dict(value)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if isinstance(out.get(key), dict) and "properties" in sub:
            out[key] = with_schema_defaults(out[key], sub)
    return out


def batches_holding(k: int, n: int, rows: int) -> float:
    """Expected batches (of ``rows`` rows, the last one partial) holding at least one of ``k`` items drawn from
    ``n`` without replacement."""
    if k <= 0 or n <= 0:
        return 0.0
    k = min(k, n)
    sizes = [min(rows, n - start) for start in range(0, n, rows)]
    return sum(1 - math.comb(n - size, k) / math.comb(n, k) for size in sizes)


@dataclass
class RunShape:
    """A run's items, batches, lengths and config, and the counts its results recorded (``read``) or that are
    derived from the config and ledger (``derived``): ``sources`` says which, by name."""

    config: dict
    n: int
    rows: int  # rows of a batch (1 without a plan)
    batches: float
    P: float
    S: float
    N: float
    W: float  # in lockstep: a batch's longest prompt, stage and suffix (means over batches); else P, S, N
    S_b: float
    N_b: float
    span: float  # the decode buffer L: positions a masked-attention step attends over
    divergent: dict
    recorded: dict
    skip: float = 0.0  # steps a built construction skips in lockstep: a batch's shortest stage less one (mean)
    schedule: str = "suffix"  # a built construction's schedule in a batch: lockstep, or suffix (see ``cell``)
    lookahead: bool = False  # the greedy loop overlapped the host's work with the device's (see ``price``)
    sources: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)

    @property
    def lockstep(self) -> bool:
        return self.rows > 1

    @property
    def precisions(self) -> list[str]:
        return list(self.config["precisions"])

    @property
    def transplant_precision(self) -> str:
        return self.config["transplant"].get("precision") or self.precisions[0]

    @property
    def boundary_positions(self) -> float:
        """Positions of one row's boundary cache: the prompt and the stage but its last token."""
        return self.P + self.S - 1

    def count(self, name: str, read, derive):
        """``read(recorded)`` where the run recorded it, else ``derive()``; notes the source under ``name``."""
        try:
            value = read(self.recorded)
        except (KeyError, TypeError):
            value = None
        self.sources[name] = "read" if value is not None else "derived"
        return value if value is not None else derive()

    def batch_sizes(self, shard: int | None = None) -> list[int]:
        """Rows of each batch of the plan (the last one partial where ``rows`` does not divide n; each item its own
        batch without a plan); of one shard's batches where ``shard`` is given (shards take whole batches, or items
        at batch 1)."""
        sizes = [min(self.rows, self.n - start) for start in range(0, self.n, self.rows)]
        return sizes if shard is None else sizes[shard::self.config["shards"]]

    def kinds(self, shard: int | None = None) -> dict:
        """{rows: batches}: the batches (of one shard) by their row count. A partial last batch is its own kind,
        decoded at its own rows. Where the run recorded another number of batches than the plan's, scaled to it."""
        out = {}
        for size in self.batch_sizes(shard):
            out[size] = out.get(size, 0) + 1
        units = len(self.batch_sizes())
        if self.batches != units:
            out = {rows: count * self.batches / units for rows, count in out.items()}
        return out

    @property
    def shards(self) -> int:
        return int(self.config["shards"])

    def holding(self, k: float, shard: int | None = None) -> dict:
        """{rows: expected batches of that size holding at least one of ``k`` items drawn from the n}; of one
        shard's batches where ``shard`` is given."""
        k = min(round(k), self.n)
        out = {}
        for size in self.batch_sizes(shard):
            chance = 0.0 if k <= 0 else 1 - math.comb(self.n - size, k) / math.comb(self.n, k)
            out[size] = out.get(size, 0.0) + chance
        return out

    def held(self, name: str, read, k: float, shard: int | None = None) -> dict:
        """{rows: batches holding one of ``k`` items}: the number the run recorded (``read``), spread over the batch
        sizes as the derived chances spread it, else derived; of one shard's batches where ``shard`` is given (its
        share of the derived chances)."""
        derived = self.holding(k)
        whole = self.count(name, read, lambda: sum(derived.values()))
        if shard is None or self.shards == 1:
            return spread(whole, derived, self.rows)
        mine = self.holding(k, shard)
        weight = sum(derived.values())
        return spread(whole * sum(mine.values()) / weight if weight else 0.0, mine, self.rows)

    def item_share(self, shard: int | None) -> float:
        """The share of the n items in one shard's batches (1 for the whole run)."""
        return 1.0 if shard is None or self.shards == 1 else sum(self.batch_sizes(shard)) / self.n


def spread(total: float, like: dict, rows: int) -> dict:
    """``total`` over the keys of ``like`` in proportion to its values (all of it at ``like``'s one key, or at
    ``rows`` where ``like`` is empty or all zero)."""
    weight = sum(like.values())
    if len(like) == 1 or not weight:
        return {next(iter(like)) if len(like) == 1 else rows: total}
    return {key: total * value / weight for key, value in like.items()}


SCHEDULES = ("lockstep", "suffix")
SCHEDULE = "suffix"  # the decoder's schedule now (decode/greedy.py); lockstep kept to price runs made before it
VOCAB = 151936  # Qwen2.5's vocabulary (the 14B's 152064): measure_fidelity's logits per row and step
# measure_fidelity's work beside its steps, per row-step, where --overhead-json does not give it (see the docstring):
OBSERVE_S = 1.0e-5  # one torch op a row and step (the logits' copy): a CUDA launch's host cost, assumed
COMPARE_S = 2.2e-5  # 16.5 us host (the table row and its DataFrame, timed on the VM's CPU) + 5.8 us device (bound)


def run_shape(run: dict) -> RunShape:
    if "config" not in run:
        raise ValueError("the run JSON holds no config: it was written before bench/pipeline_run.py stored it; "
                         "rerun bench/pipeline_run.py")
    config = with_schema_defaults(run["config"], yaml.safe_load(SCHEMA.read_text()))
    ledger = run.get("ledger") or {}
    if "mean_prompt" not in ledger:
        raise ValueError(f"the run JSON has no ledger lengths ({ledger.get('error', 'no ledger')}): nothing to count")
    n = int(config["n_items"])
    rows = min(int(config["batch_size"]), n)
    recorded = run.get("counts") or {}
    P, S, N = ledger["mean_prompt"], ledger["mean_stage"], ledger["mean_suffix"]
    shape = RunShape(config, n, rows, 0.0, P, S, N, P, S, N, 0.0, ledger.get("divergent_share", {}), recorded)
    if shape.lockstep:
        shape.W = shape.count("batch_width", lambda _: ledger.get("batch_width"), lambda: P)
        shape.S_b = shape.count("batch_stage", lambda _: ledger.get("batch_stage"), lambda: S)
        shape.N_b = shape.count("batch_suffix", lambda _: ledger.get("batch_suffix"), lambda: N)
        # a run that did not record its batches' shortest stages was made before built constructions skipped
        shape.skip = shape.count("batch_stage_shortest", lambda _: ledger.get("batch_stage_shortest"), lambda: 1.0) - 1
    shape.batches = shape.count("batches", lambda r: r["batches"], lambda: math.ceil(n / rows))
    shape.schedule = run.get("schedule", SCHEDULE)
    if shape.schedule not in SCHEDULES:
        raise ValueError(f"schedule {shape.schedule!r}: give one of {', '.join(SCHEDULES)}")
    loop = run.get("greedy_loop")
    if loop is None:
        shape.warnings.append("the run was made before the greedy loop's lookahead and built constructions' skip "
                              "(it records no greedy_loop): counted without them")
    shape.lookahead = bool(loop) and loop.get("lookahead") == config["decode_regime"]
    buffer = shape.count("decode_max_len", lambda r: r["decode"]["decode_max_len"],
                         lambda: shape.W + config["max_stage_tokens"] + config["max_new_tokens"])
    regime = config["decode_regime"]
    if regime == "eager":
        shape.warnings.append("decode_regime eager: the measures are of the static decoder; eager steps are "
                              "launch-bound and slower, so the projection is short")
    # The whole buffer: what the masked attention reads at every step. A measure of the triton attention (its
    # step_fit's bucket is 1) prices each step at its own position instead (``price``), up to this buffer.
    shape.span = buffer
    if config["shards"] > 1 and not shape.lockstep:
        shape.warnings.append("shards at batch 1: items split by item_index modulo shards, counted as equal shares")
    return shape


# ---- work: what a cell, a job and a rule decode ------------------------------------------------------------------
@dataclass
class Work:
    """Decode work at one precision: batched decode steps by row count, one-shot prefill tokens, rows whose boundary
    cache is fingerprinted, live rows' stage steps (the boundary matcher's), cache bytes dumped. ``segments`` holds
    the same steps by where they run, {(rows, start, count): how many times}: ``count`` steps from cache length
    ``start`` (what a measure of the triton attention prices step by step)."""

    steps: dict = field(default_factory=dict)  # rows -> steps
    prefill_tokens: float = 0.0
    boundary_rows: float = 0.0
    matcher_row_steps: float = 0.0
    dump_GB: float = 0.0
    segments: dict = field(default_factory=dict)  # (rows, start, count) -> multiplicity
    observed_row_steps: float = 0.0  # rows' fp32 logits copied and kept at a suffix step (measure_fidelity)
    compared_row_steps: float = 0.0  # compared rows' steps: step_measures and the table row (measure_fidelity)

    def __add__(self, other: "Work") -> "Work":
        steps = dict(self.steps)
        for rows, count in other.steps.items():
            steps[rows] = steps.get(rows, 0.0) + count
        segments = dict(self.segments)
        for key, times in other.segments.items():
            segments[key] = segments.get(key, 0.0) + times
        return Work(steps, self.prefill_tokens + other.prefill_tokens, self.boundary_rows + other.boundary_rows,
                    self.matcher_row_steps + other.matcher_row_steps, self.dump_GB + other.dump_GB, segments,
                    self.observed_row_steps + other.observed_row_steps,
                    self.compared_row_steps + other.compared_row_steps)

    def __mul__(self, k: float) -> "Work":
        return Work({rows: count * k for rows, count in self.steps.items()}, self.prefill_tokens * k,
                    self.boundary_rows * k, self.matcher_row_steps * k, self.dump_GB * k,
                    {key: times * k for key, times in self.segments.items()}, self.observed_row_steps * k,
                    self.compared_row_steps * k)

    __rmul__ = __mul__


def decoded(rows: int, start: float, count: float, times: float = 1.0, **rest) -> Work:
    """``times`` x ``count`` decode steps at ``rows`` rows from cache length ``start`` (the first step attends
    ``start`` + 1 positions), with the rest of a Work's fields."""
    return Work({rows: count * times}, segments={(rows, start, count): times} if count else {}, **rest)


def total(works) -> Work:
    out = Work()
    for work in works:
        out = out + work
    return out


def rebuilt_as(construction: str) -> str:
    """The construction that rebuilds ``construction`` from ids (live by its own schedule: incremental)."""
    from stagereplay.experiments import transplant

    return transplant.rebuilt_as(construction)


def segment_forwards(construction: str, tokens: float, chunk: int) -> float:
    """Per-row forwards of a construction built segment by segment (chunked, prefix_cached), for ``tokens`` ids."""
    return math.ceil(tokens / chunk) if construction == "chunked" else 2.0


def cell(shape: RunShape, construction: str, suffix: bool = True, alone: bool = False, rows: int | None = None) -> Work:
    """One construction decoded over one batch of ``rows`` rows (the run's batch size unless given: a partial last
    batch has fewer); ``alone``: one item at batch 1 whatever the run's batch size."""
    if construction not in ("live", "incremental", "prefill", "chunked", "prefix_cached"):
        raise ValueError(f"unknown construction {construction!r}")
    if shape.lockstep and not alone:
        rows, W, S, N = rows or shape.rows, shape.W, shape.S_b, shape.N_b
        if shape.schedule == "suffix" and construction not in ("live", "incremental"):
            # its rows start at their own boundaries (the rows' mean, W + S - 1) from the built caches: the batch's
            # longest suffix, no prompt forward, no teacher-forced stage step
            work = decoded(rows, W + shape.S - 1, N if suffix else 0.0)
        else:
            skip = 0.0 if construction in ("live", "incremental") else shape.skip  # before the first boundary
            work = decoded(rows, W + skip, S - 1 + (N if suffix else 0) - skip, prefill_tokens=rows * W)  # live schedule
        built = rows * (W + S - 1)
    else:
        rows, W, S, N = 1, shape.P, shape.S, shape.N
        if construction in ("live", "incremental"):  # the prompt, then every token one step
            return decoded(1, W, S - 1 + (N if suffix else 0), prefill_tokens=W, boundary_rows=1,
                           matcher_row_steps=S if construction == "live" else 0.0)
        work = decoded(1, W + S - 1, N if suffix else 0.0)  # from the built cache at the boundary
        built = W + S - 1
    if construction == "prefill":
        work.prefill_tokens += built
    elif construction in ("chunked", "prefix_cached"):
        forwards = rows * segment_forwards(construction, W + S - 1, shape.config["chunk_size"])
        # each forward priced as one step at the boundary cache's end (its keys: the prompt and the stage)
        work = work + decoded(1, W + S - 2, 1, times=forwards, prefill_tokens=built)
        note = f"{construction}: its per-row segment forwards are priced as batch-1 steps plus prefill tokens"
        if note not in shape.warnings:
            shape.warnings.append(note)
    work.boundary_rows = rows
    work.matcher_row_steps = rows * S if construction == "live" else 0.0
    return work


def rebuild(shape: RunShape, rows: int | None = None) -> Work:
    """Both constructions of ``transplant.constructions`` rebuilt with their suffixes (the stages' ``Rebuild``)."""
    return total(cell(shape, rebuilt_as(c), rows=rows) for c in shape.config["transplant"]["constructions"])


@dataclass
class JobWork:
    rule: str
    name: str
    loads: list  # precisions whose model the job loads, in order
    work: dict  # precision -> Work
    shard: int = 0
    precision: str | None = None  # the job's own precision (a rule with one job per precision and shard)
    seconds: float | None = None  # projected (``projected_rules``)
    lookahead: bool = True  # False: its loop observes or forces every step, so the lookahead is off (``price``)
    logits_GB: float = 0.0  # peak fp32 logits it keeps on the device (measure_fidelity)


# ---- counts per rule ---------------------------------------------------------------------------------------------
def per_precision_jobs(shape: RunShape, rule: str, per_batch) -> list[JobWork]:
    """One job per precision and shard decoding ``per_batch(precision, shard, rows)`` in each of its batches."""
    jobs = []
    for p in shape.precisions:
        for shard in range(shape.config["shards"]):
            work = total(per_batch(p, shard, rows) * batches for rows, batches in shape.kinds(shard).items())
            jobs.append(JobWork(rule, f"{rule}_{p}_{shard}", [p], {p: work}, shard, p))
    return jobs


def per_shard_jobs(shape: RunShape, rule: str, loads: list, per_shard) -> list[JobWork]:
    """One job per shard (every precision in one job), each loading ``loads`` (a stage loads what the whole run
    needs on every shard, so that their parts record one provenance) and decoding ``per_shard(shard)``: {precision:
    Work} of its batches. With one shard the job is named after the rule."""
    return [JobWork(rule, rule if shape.shards == 1 else f"{rule}_{shard}", list(loads), per_shard(shard), shard)
            for shard in range(shape.shards)]


def by_kind(held: dict, per_batch) -> Work:
    """``per_batch(rows)`` in each of the batches ``held`` counts by their rows."""
    return total(per_batch(rows) * batches for rows, batches in held.items())


def reconstruct_prefixes(shape: RunShape) -> list[JobWork]:
    k = min(shape.config["bridge"]["n_rows"], shape.n)
    everything = shape.kinds()

    def bridge_share(p, rows):
        held = shape.held(f"bridge_batches_{p}", lambda r: r["bridge"][p]["batches"], k)
        return held.get(rows, 0.0) / everything[rows]  # a batch's chance of a bridge row, by its size

    def per_batch(p, shard, rows):
        matched = 2 * cell(shape, "live", rows=rows) + 2 * cell(shape, "prefill", rows=rows)
        return matched + bridge_share(p, rows) * cell(shape, "incremental", rows=rows)

    return per_precision_jobs(shape, "reconstruct_prefixes", per_batch)


def fixed_prefix_cells(shape: RunShape, replicas: int, rows: int | None = None) -> Work:
    return replicas * total(cell(shape, c, rows=rows) for c in shape.config["fixed_prefix"]["constructions"])


def generate_fixed_prefix(shape: RunShape) -> list[JobWork]:
    return per_precision_jobs(shape, "generate_fixed_prefix", lambda p, shard, rows: fixed_prefix_cells(shape, 2, rows))


def audit_ledger(shape: RunShape) -> list[JobWork]:
    def per_batch(p, shard, rows):
        return cell(shape, "live", rows=rows) + cell(shape, "prefill", rows=rows) + fixed_prefix_cells(shape, 1, rows)

    return per_precision_jobs(shape, "audit_ledger", per_batch)


def check_batch_invariance(shape: RunShape) -> list[JobWork]:
    if not shape.lockstep:
        return per_shard_jobs(shape, "check_batch_invariance", [], lambda shard: {})
    k = min(shape.config["batch_invariance"]["sample"], shape.n)

    def per_shard(shard):
        work = {}
        for p in shape.precisions:  # the sampled items of the shard's batches: its share of the items
            live = shape.count(f"batch_invariance_live_{p}", lambda r: r["batch_invariance"][p]["live"], lambda: k)
            prefill = shape.count(f"batch_invariance_prefill_{p}", lambda r: r["batch_invariance"][p]["prefill"],
                                  lambda: k)
            share = shape.item_share(shard)
            work[p] = share * (live * cell(shape, "live", alone=True) + prefill * cell(shape, "prefill", alone=True))
        return work

    return per_shard_jobs(shape, "check_batch_invariance", shape.precisions, per_shard)


def measure_cache_differences(shape: RunShape) -> list[JobWork]:
    settings = shape.config["cache_differences"]
    k = min(settings["n_items"], shape.n)
    precisions = list(settings["precisions"]) if k else []

    def per_shard(shard):
        work = {}
        for p in precisions:
            held = shape.held(f"cache_difference_batches_{p}", lambda r: r["cache_differences"][p]["batches"], k,
                              shard)
            work[p] = by_kind(held, lambda rows: cell(shape, "incremental", suffix=False, rows=rows)
                              + cell(shape, "prefill", suffix=False, rows=rows))
        return work

    return per_shard_jobs(shape, "measure_cache_differences", precisions, per_shard)


def divergent_items(shape: RunShape, p: str) -> float:
    return shape.divergent.get(p, 0.0) * shape.n


def dump_caches(shape: RunShape, kv_GB_per_position: dict) -> list[JobWork]:
    chosen = shape.config["dump"]["items"]
    counted = {}
    for p in shape.precisions:
        derived = {"divergent": divergent_items(shape, p), "all": shape.n, "none": 0}[chosen]
        items = shape.count(f"dump_items_{p}", lambda r: r["dump"].get(p, {}).get("items", 0), lambda: derived)
        if round(items) == 0:
            continue
        gb = shape.count(f"dump_GB_{p}", lambda r: r["dump"][p]["bytes"] / 1e9,
                         lambda: 2 * items * shape.boundary_positions * kv_GB_per_position[p])
        counted[p] = (items, gb)

    def per_shard(shard):
        work = {}
        for p, (items, gb) in counted.items():  # the shard's batches, and its share of the items' bytes
            held = shape.held(f"dump_batches_{p}", lambda r: r["dump"][p]["batches"], items, shard)
            work[p] = by_kind(held, lambda rows: rebuild(shape, rows)) + Work(dump_GB=gb * shape.item_share(shard))
        return work

    return per_shard_jobs(shape, "dump_caches", list(counted), per_shard)


def selected_items(shape: RunShape, divergent_only: bool = False) -> float:
    """Items ``transplant.select`` picks (and of them, with ``divergent_only``, the divergent ones: expected)."""
    select, p = shape.config["transplant"]["select"], shape.transplant_precision
    share = shape.divergent.get(p, 0.0)
    if select == "divergent":
        return share * shape.n
    picked = int(select.split(":")[1]) if isinstance(select, str) else len(select)
    return picked * (share if divergent_only else 1.0)


def transplant_specs(shape: RunShape) -> int:
    """Transplants per direction the sweeps ask for (each distinct one once), on the model's layers."""
    from stagereplay.experiments.transplant import enumerate_sweeps

    layers = shape.count("num_layers", lambda r: r["num_layers"], lambda: model_layers(shape))
    return len(enumerate_sweeps(shape.config["transplant"]["sweeps"], layers))


def model_layers(shape: RunShape) -> int:
    """The layer count in the model folder's config.json; 28 (the 1.5B and 7B shapes'), noted, where unreadable."""
    try:
        return int(json.loads((Path(shape.config["model"]) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError):
        shape.warnings.append("the model's layer count is unknown: transplant specs counted for 28 layers")
        return 28


def recipient_cells(shape: RunShape, runs_per_direction: dict, rows: int | None = None) -> Work:
    """Runs of each direction ``donor->recipient``, each one cell of the recipient's construction rebuilt."""
    return total(runs * cell(shape, rebuilt_as(direction.split("->")[1]), rows=rows)
                 for direction, runs in runs_per_direction.items())


def directions(shape: RunShape) -> list[str]:
    a, b = shape.config["transplant"]["constructions"]
    return [f"{a}->{b}", f"{b}->{a}"]


def transplant_caches(shape: RunShape) -> list[JobWork]:
    p = shape.transplant_precision
    items = shape.count("transplant_items", lambda r: r["transplant"]["items"], lambda: selected_items(shape))
    specs = shape.count("transplant_specs", lambda r: r["transplant"]["specs_per_direction"],
                        lambda: transplant_specs(shape))

    def per_shard(shard):
        held = shape.held("transplant_batches", lambda r: r["transplant"]["batches"], items, shard)
        return {p: by_kind(held, lambda rows: rebuild(shape, rows)
                           + recipient_cells(shape, {d: specs for d in directions(shape)}, rows))}

    return per_shard_jobs(shape, "transplant_caches", [p], per_shard)


def find_minimal_transplants(shape: RunShape) -> list[JobWork]:
    p, budget = shape.transplant_precision, shape.config["transplant"]["minimal"]["budget"]
    items = shape.count("minimal_items", lambda r: r["minimal"]["items"],
                        lambda: selected_items(shape, divergent_only=True) if budget else 0)
    if round(items) == 0:
        return per_shard_jobs(shape, "find_minimal_transplants", [], lambda shard: {})
    held = shape.held("minimal_batches", lambda r: r["minimal"]["batches"], items)
    # a recorded direction may be named incremental where the rebuilt live cache was not the ledger's: the same cell
    rounds = shape.count("minimal_rounds", lambda r: r["minimal"]["rounds_per_direction"] or None,
                         lambda: {d: budget * sum(held.values()) for d in directions(shape)})
    by_rows = {d: spread(runs, held, shape.rows) for d, runs in rounds.items()}  # each batch's rounds, by its size

    def per_shard(shard):
        mine = shape.held("minimal_batches", lambda r: r["minimal"]["batches"], items, shard)
        # the shard's rounds: its share of the batches of each size
        return {p: total(batches * rebuild(shape, rows)
                         + recipient_cells(shape, {d: r.get(rows, 0.0) * (batches / held[rows] if shape.shards > 1
                                                                          else 1.0)
                                                   for d, r in by_rows.items()}, rows)
                         for rows, batches in mine.items() if batches)}

    return per_shard_jobs(shape, "find_minimal_transplants", [p], per_shard)


def measure_divergence_onset(shape: RunShape) -> list[JobWork]:
    counted = {}
    for p in shape.precisions:
        items = shape.count(f"onset_items_{p}", lambda r: r["onset"].get(p, {}).get("items", 0),
                            lambda: divergent_items(shape, p))
        if round(items) != 0:
            counted[p] = items

    def per_shard(shard):
        return {p: by_kind(shape.held(f"onset_batches_{p}", lambda r: r["onset"][p]["batches"], items, shard),
                           lambda rows: rebuild(shape, rows)) for p, items in counted.items()}

    return per_shard_jobs(shape, "measure_divergence_onset", list(counted), per_shard)


def fidelity_items(shape: RunShape) -> int:
    """Items ``fidelity.items`` compares (all, or a sample of N), none where ``fidelity.constructions`` is empty."""
    settings = shape.config["fidelity"]
    if not settings["constructions"]:
        return 0
    items = settings["items"]
    return shape.n if items == "all" else min(int(items), shape.n)


def fidelity_cells(shape: RunShape, rows: int, compared: float) -> Work:
    """One batch of measure_fidelity (``fidelity_batch``): ``live`` regenerated with its suffix, and each of
    ``fidelity.constructions`` teacher-forced through live's suffix (a cell of its construction with the suffix:
    the same steps, the ids forced); every row's fp32 logits kept at each of its N suffix steps on both sides, and
    ``compared`` rows (those wanted) compared step by step."""
    names = list(shape.config["fidelity"]["constructions"])
    work = cell(shape, "live", rows=rows) + total(cell(shape, c, rows=rows) for c in names)
    work.observed_row_steps = rows * shape.N * (1 + len(names))
    work.compared_row_steps = compared * shape.N * len(names)
    return work


def measure_fidelity(shape: RunShape, vocab: int = 0) -> list[JobWork]:
    """Per precision and shard, every batch holding a compared item (``fidelity.items``): ``fidelity_cells``; none
    where ``fidelity.constructions`` is empty. The loop observes (and forces) every step, so its lookahead is off.
    Its peak logits on the device: the reference's kept rows plus one construction's, rows x N_b x vocab x 4 B each."""
    k = fidelity_items(shape)
    if not k:
        return []
    jobs = []
    for p in shape.precisions:
        for shard in range(shape.shards):
            held = shape.held(f"fidelity_batches_{p}", lambda r: r["fidelity"][p]["batches"], k, shard)
            work = by_kind(held, lambda rows: fidelity_cells(shape, rows, rows * k / shape.n))
            job = JobWork("measure_fidelity", f"measure_fidelity_{p}_{shard}", [p], {p: work}, shard, p,
                          lookahead=False)
            job.logits_GB = 2 * max(held, default=0) * shape.N_b * vocab * 4 / 1e9 if any(held.values()) else 0.0
            jobs.append(job)
    return jobs


def model_jobs(shape: RunShape, kv_GB_per_position: dict, vocab: int = 0) -> list[JobWork]:
    """Every model job of the run, with the work it decodes."""
    jobs = []
    for rule in (reconstruct_prefixes, generate_fixed_prefix, audit_ledger, check_batch_invariance,
                 measure_cache_differences, transplant_caches, find_minimal_transplants, measure_divergence_onset):
        jobs += rule(shape)
    jobs += dump_caches(shape, kv_GB_per_position)
    jobs += measure_fidelity(shape, vocab)
    return jobs


# ---- the rule DAG on N GPUs ----------------------------------------------------------------------------------------
LEDGER_RULES = ("reconstruct_prefixes", "generate_fixed_prefix")  # what gather_ledger joins
# read the ledger's rows at the transplant precision alone (gather_transplant_baseline), through select_transplant_items
AT_TRANSPLANT_PRECISION = ("transplant_caches", "find_minimal_transplants")


def job_dependencies(jobs: list[JobWork], shape: RunShape) -> dict:
    """{job name: the model jobs it waits for}, as the workflow's inputs chain them through the jobs that load no
    model: the fixed-prefix 2x2 of a shard reads that shard's prefixes of the reference precision
    (``parts/prefixes_<reference>_<shard>``); the transplants and the minimal search read the ledger's rows at the
    transplant precision, which ``gather_transplant_baseline`` joins from that precision's jobs of the two ledger
    rules (and ``select_transplant_items`` selects from); every other later model job reads the ledger or the
    prefixes that ``gather_ledger`` joins from every job of the two ledger rules (the audit, the controls, the cache
    differences, the dumps, the onset)."""
    reference = shape.config["reference_precision"]
    ledger = {j.name for j in jobs if j.rule in LEDGER_RULES}
    at_transplant_precision = {j.name for j in jobs if j.rule in LEDGER_RULES
                               and j.precision == shape.transplant_precision}
    after = {}
    for job in jobs:
        if job.rule == "reconstruct_prefixes":
            after[job.name] = set()
        elif job.rule == "generate_fixed_prefix":
            after[job.name] = {j.name for j in jobs if j.rule == "reconstruct_prefixes" and j.precision == reference
                               and j.shard == job.shard}
        elif job.rule in AT_TRANSPLANT_PRECISION:
            after[job.name] = set(at_transplant_precision)
        else:
            after[job.name] = set(ledger)
    return after


def list_schedule(seconds: dict, after: dict, slots: int) -> dict:
    """The jobs (``seconds``: {name: duration}, ``after``: {name: names it waits for}) on ``slots`` devices, each
    job on one: whenever a device is free it takes the ready job with the longest path to the end of the DAG (its
    own time and its longest chain of dependents; ties by name), as a list scheduler does. Snakemake does not know
    the jobs' times, so its order can be worse; the makespan is bounded below by the critical path and by the work
    over the devices. Returns {"makespan_s", "critical_path_s", "work_s", "jobs": {name: (start, end, device)}}."""
    if slots < 1:
        raise ValueError(f"{slots} devices: give at least one")
    unknown = {d for deps in after.values() for d in deps} - set(seconds)
    if unknown:
        raise ValueError(f"jobs wait for jobs not in the DAG: {sorted(unknown)}")
    dependents = {name: [] for name in seconds}
    for name, deps in after.items():
        for d in deps:
            dependents[d].append(name)
    rank = {}

    def tail(name, seen=()):
        if name in seen:
            raise ValueError(f"the DAG has a cycle through {name}")
        if name not in rank:
            rank[name] = seconds[name] + max((tail(d, (*seen, name)) for d in dependents[name]), default=0.0)
        return rank[name]

    for name in seconds:
        tail(name)
    waiting = {name: set(after.get(name, ())) for name in seconds}
    free = list(range(slots))
    running, placed, now = [], {}, 0.0  # running: (end, device, name)
    while len(placed) < len(seconds):
        ready = sorted((n for n, deps in waiting.items() if not deps and n not in placed), key=lambda n: (-rank[n], n))
        while free and ready:
            name, device = ready.pop(0), free.pop(0)
            placed[name] = (now, now + seconds[name], device)
            running.append((now + seconds[name], device, name))
        if not running:
            raise ValueError("no job is ready and none is running: the DAG has a cycle")
        running.sort()
        end, device, name = running.pop(0)
        now = end
        free.append(device)
        free.sort()
        for other in dependents[name]:
            waiting[other].discard(name)
    return {"makespan_s": max((end for _, end, _ in placed.values()), default=0.0),
            "critical_path_s": max(rank.values(), default=0.0), "work_s": sum(seconds.values()), "jobs": placed}


# ---- rates ---------------------------------------------------------------------------------------------------------
@dataclass
class Overhead:
    """A model job's fixed cost: its start (process, imports) and per model loaded (load, decoder, first graph)."""

    start_s: float
    load_s: dict  # precision -> seconds of one load, its decoder and first step
    first_load_extra_s: float = 0.0  # what a job's first load costs more (the model's code imported)
    greedy_step_s: dict = field(default_factory=dict)  # rows -> host seconds per decode step (greedy choice, sync)
    matcher_s_per_row_step: float = 0.0
    fingerprint_GB_s: float | None = None
    observe_s_per_row_step: float = 0.0  # measure_fidelity: a row's fp32 logits copied and kept, per step
    compare_s_per_row_step: float = 0.0  # measure_fidelity: step_measures and the table row, per compared step

    @classmethod
    def from_seconds(cls, overhead_s: float, load_s: float = 0.0) -> "Overhead":
        """``overhead_s``: a job with one load; ``load_s``: the part of it each further load costs again."""
        return cls(overhead_s - load_s, {"*": load_s})

    @classmethod
    def from_json(cls, measured: dict) -> "Overhead":
        return cls(measured["start_s"], measured["load_s"], measured.get("first_load_extra_s", 0.0),
                   {int(r): s for r, s in measured.get("greedy_step_s", {}).items()},
                   measured.get("matcher_s_per_row_step", 0.0), measured.get("fingerprint_GB_s"),
                   measured.get("observe_s_per_row_step", OBSERVE_S), measured.get("compare_s_per_row_step", COMPARE_S))

    def of_job(self, loads: list) -> float:
        """Start, and one load per precision loaded (one not measured: the mean of those measured)."""
        mean = sum(self.load_s.values()) / len(self.load_s) if self.load_s else 0.0
        first = self.first_load_extra_s if loads else 0.0
        return self.start_s + first + sum(self.load_s.get(p, mean) for p in loads)

    def greedy(self, rows: int) -> float:
        if not self.greedy_step_s:
            return 0.0
        nearest = min(self.greedy_step_s, key=lambda r: abs(r - rows))
        return self.greedy_step_s[nearest]


class Rates:
    """The measures by (precision, rows), and the overhead."""

    def __init__(self, measures: list[dict], overhead: Overhead, warnings: list):
        self.by = {(m["precision"], int(m["rows"])): m for m in measures}
        self.overhead, self.warnings = overhead, warnings
        self.vocab = VOCAB  # measure_fidelity's logits (the measures record no vocabulary)

    def nearest(self, precision: str, rows: int) -> dict:
        """The measure at ``precision`` whose row count is nearest ``rows``."""
        mine = {r: m for (p, r), m in self.by.items() if p == precision}
        if not mine:
            raise ValueError(f"no measure at precision {precision!r} (measured: {sorted(set(self.by))})")
        return mine[min(mine, key=lambda r: abs(r - rows))]

    def step_measure(self, precision: str, rows: int) -> dict:
        """The measure that prices a step at ``rows`` rows: the one measured there; else, between two measured row
        counts of the same attention, their fit interpolated linearly in the rows (a partial last batch); else the
        nearest row count's (noted)."""
        mine = {r: m for (p, r), m in self.by.items() if p == precision}
        if rows in mine:
            return mine[rows]
        below = max((r for r in mine if r < rows), default=None)
        above = min((r for r in mine if r > rows), default=None)
        if below is not None and above is not None and (
                mine[below]["step_fit"]["bucket"] == mine[above]["step_fit"]["bucket"]):
            lo, hi, t = mine[below], mine[above], (rows - below) / (above - below)
            fit = {key: lo["step_fit"][key] + t * (hi["step_fit"][key] - lo["step_fit"][key])
                   for key in ("a_s", "b_s_per_position")}
            note = (f"{precision} steps at {rows} rows priced by the step fit interpolated between the {below}- and "
                    f"{above}-row measures")
            if note not in self.warnings:
                self.warnings.append(note)
            return {**hi, "rows": rows, "step_fit": {**fit, "bucket": hi["step_fit"]["bucket"]},
                    "step_s": lo["step_s"] + t * (hi["step_s"] - lo["step_s"])}
        m = self.nearest(precision, rows)
        note = f"{precision} steps at {rows} rows priced at the {m['rows']}-row measure (none at {rows} rows)"
        if note not in self.warnings:
            self.warnings.append(note)
        return m

    def kv_GB_per_position(self, precision: str) -> float:
        m = self.nearest(precision, 1)
        return m["kv_GB_per_row"] / m["max_len"]


def step_seconds(m: dict, span: float) -> float:
    """One decode step of the measure's batch attending over ``span`` positions: ``benchmark.decode_seconds`` of
    one step with the span its own bucket (its time per row, times the rows)."""
    from benchmark import decode_seconds  # bench/benchmark.py

    span = int(round(span))
    at_span = {**m, "max_len": span, "step_fit": {**m["step_fit"], "bucket": span}}
    return decode_seconds(at_span, span - 1, 1, bucketed=True) * m["rows"]


def by_position(m: dict) -> bool:
    """Whether the measure is of an attention that reads each row's keys up to its position (the triton attention:
    ``bench/benchmark.py`` records its bucket as 1 position), so a step costs what its own position costs."""
    return m["step_fit"]["bucket"] == 1


def steps_seconds(m: dict, start: float, count: float, buffer: float) -> float:
    """``count`` decode steps of the measure's batch from cache length ``start``, each at its own position (up to
    the buffer): ``benchmark.decode_seconds(bucketed=True)`` with a bucket of one position sums a + b * span over
    the steps. Fractional lengths (a ledger's means): the steps' mean cost at the rounded lengths, times ``count``."""
    from benchmark import decode_seconds  # bench/benchmark.py

    whole = max(1, round(count))
    at = {**m, "max_len": int(round(buffer)), "step_fit": {**m["step_fit"], "bucket": 1}}
    return decode_seconds(at, int(round(start)), whole, bucketed=True) * m["rows"] * count / whole


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
    fingerprint = fingerprint_GB / rates.overhead.fingerprint_GB_s if rates.overhead.fingerprint_GB_s else 0.0
    out = {"decode_s": decode, "prefill_s": work.prefill_tokens / measure["prefill_tokens_s"],
           "dump_s": work.dump_GB / measure["dump_GB_s"], "host_s": host, "fingerprint_s": fingerprint}
    if work.observed_row_steps or work.compared_row_steps:  # measure_fidelity's logits kept and compared
        out["fidelity_s"] = (work.observed_row_steps * rates.overhead.observe_s_per_row_step
                             + work.compared_row_steps * rates.overhead.compare_s_per_row_step)
    return out


def job_seconds(job: JobWork, shape: RunShape, rates: Rates) -> dict:
    parts = {"overhead_s": rates.overhead.of_job(job.loads)}
    for precision, work in job.work.items():
        for part, seconds in price(work, precision, shape, rates, job.lookahead).items():
            parts[part] = parts.get(part, 0.0) + seconds
    return {"s": sum(parts.values()), **parts}


# ---- the comparison ------------------------------------------------------------------------------------------------
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


# ---- a run not made: projected from its config --------------------------------------------------------------------
def load_config(path: str, overrides: list[str] = ()) -> dict:
    """A workflow config with ``KEY.SUB=VALUE`` overrides (VALUE read as YAML), the schema's defaults filled as the
    workflow fills them (``snakemake.utils.validate(set_default=True)``, which also refuses an invalid config; the
    schema walk ``with_schema_defaults`` where Snakemake is not installed)."""
    config = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: give KEY=VALUE (a dotted key, a YAML value)")
        *parents, last = key.split(".")
        node = config
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = yaml.safe_load(value)
    try:
        from snakemake.utils import validate
    except ImportError:
        return with_schema_defaults(config, yaml.safe_load(SCHEMA.read_text()))
    validate(config, str(SCHEMA), set_default=True)
    return config


def config_run(config: dict, prompt: float, stage: float, suffix: float, divergent: dict, layers: int,
               shortest_stage: float | None = None, schedule: str = SCHEDULE) -> dict:
    """What ``run_shape`` reads of a run, for one not made: the config, the ledger's lengths (a batch's longest prompt,
    stage and suffix taken equal to the means; its shortest stage ``shortest_stage``, else the mean too), the
    divergent shares and the model's layer count; no counts recorded, so every other count is derived from the
    config (the decode buffer as ``reconstruct_prefixes`` sets it: the longest prompt + max_stage_tokens +
    max_new_tokens); ``schedule`` the built constructions' schedule in a batch (``cell``)."""
    ledger = {"mean_prompt": prompt, "mean_stage": stage, "mean_suffix": suffix, "batch_width": prompt,
              "batch_stage": stage, "batch_stage_shortest": stage if shortest_stage is None else shortest_stage,
              "batch_suffix": suffix, "divergent_share": dict(divergent)}
    from pipeline_run import GREEDY_LOOP  # bench/pipeline_run.py: what the package's loop does now

    return {"config": config, "ledger": ledger, "counts": {"num_layers": layers}, "greedy_loop": GREEDY_LOOP,
            "schedule": schedule}


def on_gpus(run: dict, measures: list[dict], overhead: Overhead, gpus: list[int], measures_batch1=None,
            shards: int | None = None, non_model_s: float = 0.0) -> list[dict]:
    """The run on each of ``gpus`` GPUs of one host: the config's ``shards`` set to ``shards`` (default: the GPU
    count), every model job priced, and the jobs placed on the GPUs by ``list_schedule`` along
    ``job_dependencies``, as many at a time as ``--resources gpu=N`` lets jobs of ``gpus_per_job`` GPUs run (each
    model job on GPUs of its own, so at its measured speed); the wall adds ``non_model_s`` (the jobs that load no
    model, run one after another as on one GPU)."""
    per_job = int(run["config"].get("gpus_per_job") or 0)
    if per_job < 1:
        raise ValueError(f"gpus_per_job: {per_job}: the model jobs claim no GPU, so --resources gpu=N does not limit "
                         "how many share one; set gpus_per_job: 1 to price N GPUs")
    out = []
    for n in gpus:
        config = {**run["config"], "shards": shards or n}
        shape = run_shape({**run, "config": config})
        _, jobs = projected_rules(shape, rates_for(shape, measures, overhead, measures_batch1))
        slots = n // per_job
        if slots < 1:
            raise ValueError(f"{n} GPUs: fewer than the {per_job} a model job claims (gpus_per_job)")
        placed = list_schedule({j.name: j.seconds for j in jobs}, job_dependencies(jobs, shape), slots)
        out.append({"gpus": n, "shards": config["shards"], "jobs": len(jobs), "jobs_at_once": slots,
                    "model_jobs_s": placed["makespan_s"], "non_model_s": non_model_s,
                    "wall_s": placed["makespan_s"] + non_model_s, "critical_path_s": placed["critical_path_s"],
                    "work_s": placed["work_s"], "busy": placed["work_s"] / (slots * placed["makespan_s"])
                    if placed["makespan_s"] else None,
                    "placed": {name: list(v) for name, v in placed["jobs"].items()}})
    return out


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


def arm_counts(jobs: list[JobWork], shape: RunShape, rates: Rates) -> dict:
    """Per precision, the work the jobs decode as ``benchmark.work_floor`` counts it (row-steps, batched steps, K/V
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


def project_config(run: dict, measures: list[dict], overhead: Overhead, measures_batch1: list[dict] | None = None,
                   non_model_s: float = 0.0, copy_TB_s: float | None = None) -> dict:
    """Each rule of a run not made (``config_run``), projected: jobs, seconds and their parts; the model jobs one
    after another plus ``non_model_s`` (a stated constant for the jobs that load no model: 0 leaves them out); the
    floor of the same work at the datasheet rates (``benchmark.work_floor``) where ``copy_TB_s`` is given."""
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
                           "fingerprint_GB_s": overhead.fingerprint_GB_s}}
    if copy_TB_s and all("linear_params" in m for m in measures):
        from benchmark import work_floor  # bench/benchmark.py

        report["floor"] = work_floor(report["arms"], measures, copy_TB_s)
    return report


def project_by_rule(measures: list[dict], items: int, divergent: float, transplant_specs: int = 1,
                    minimal_budget: int = 0, model_jobs: int = 0, job_overhead_s: float = 0.0) -> dict:
    """``benchmark.project(bucketed=True)``'s count and pricing, split by the rule whose work each part stands for
    (its total is project()'s ``total_s``): {rule: seconds}, the job overhead under "job overhead". project() counts
    per item at the measure's P, S, N: the 2x2 at every precision (generate_fixed_prefix), the matched experiment's
    live x2 at bf16 only (reconstruct_prefixes; its prefill rows taken to be the 2x2's), the audit (2 cells at
    bf16, 1 at fp32), and at bf16 the transplants in a share 1 - (1 - divergent) ** rows of the items' batches
    (transplant_caches: the rebuild and a cell per spec; find_minimal_transplants: the rebuild and a cell per run
    of the budget). A cell: incremental (S + N steps from P, a P prefill) and prefill (N steps from P + S - 1, a
    P + S prefill)."""
    from benchmark import decode_seconds  # bench/benchmark.py

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


def render_projection(report: dict, old: dict | None = None) -> str:
    """The rule-by-rule projection of a run not made (minutes), with project()'s split of the same run where given."""
    def mins(x):
        return "-" if x is None else f"{x / 60:.1f}"

    head = (f"{'rule':<28} {'jobs':>4} {'overhead':>9} {'decode':>8} {'prefill':>8} {'host+fp':>8} {'dump':>6} "
            f"{'total':>8}")
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
        if old:
            row += "".join(f" {mins(table.get(name)):>14}" for table in old.values())
        lines.append(row)
    m = report["model_jobs"]
    total = f"{'model jobs':<28} {m['jobs']:>4} {'':>9} {'':>8} {'':>8} {'':>8} {'':>6} {mins(m['projected_s']):>8}"
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


def parse_shares(text: str) -> dict:
    """``bf16=0.83,fp32=0`` -> {"bf16": 0.83, "fp32": 0.0}."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r}: give PRECISION=VALUE")
        out[key.strip()] = float(value)
    return out


def load_measures(path: str) -> list[dict]:
    saved = json.loads(Path(path).read_text())
    measures = saved["projection"] if isinstance(saved, dict) else saved
    if not measures:
        raise ValueError(f"{path} holds no projection measures (bench/benchmark.py --only-projection writes them)")
    return measures


# ---- the overhead, measured in a fresh process --------------------------------------------------------------------
def overhead_child(args) -> dict:
    """In a fresh process (time from ``args.spawned``, the parent's clock before it started this one): the imports a
    job's script makes, then per precision the model load and decoder as ``stagereplay.stages.jobs.load`` makes them
    and their first step (the graph capture), then the first precision once more: a job's first load also imports
    the model's code, what the second load of the first precision does not pay. Then the host rates of the greedy
    loop on the last decoder."""
    started = time.time()
    try:  # a job's script preamble imports it (not counted where Snakemake is not installed)
        import snakemake.script  # noqa: F401
        snakemake_import_s = time.time() - started
    except ImportError:
        snakemake_import_s = None
    import torch  # noqa: F401 - the imports a job's script makes, timed
    import stagereplay.stages.controls  # noqa: F401
    import stagereplay.stages.reconstruct  # noqa: F401
    import stagereplay.stages.transplant  # noqa: F401

    imported = time.time()
    out = {"python_start_s": started - args.spawned, "imports_s": imported - started,
           "snakemake_import_s": snakemake_import_s, "start_s": imported - args.spawned, "load_s": {},
           "first_step_s": {}}
    cold = None
    for precision in [*args.precision, args.precision[0]]:
        job, batch, loaded_s, first_s = timed_load(precision, args)
        if cold is None:
            cold = loaded_s + first_s
        else:  # a warm load: the model's code imported already
            out["load_s"][precision], out["first_step_s"][precision] = loaded_s + first_s, first_s
        if precision == args.precision[0] and precision in out["load_s"]:
            out.update(host_rates(job, batch, args))
        del job, batch
        release_device()
    out["first_load_extra_s"] = max(0.0, cold - out["load_s"][args.precision[0]])
    return out


def timed_load(precision: str, args) -> tuple:
    """A job's model load and decoder at ``precision`` (``stagereplay.stages.jobs.load``) and its first step:
    (job, batch, load seconds, first-step seconds)."""
    from stagereplay.decode.regimes import make_decoder
    from stagereplay.models.loading import eos_token_ids
    from stagereplay.stages.jobs import load
    from stagereplay.stages.settings import ModelSettings

    settings = ModelSettings(model=args.measure_overhead, revision=args.revision, device=args.device,
                             prepared_models=args.prepared_models, progress=False)
    t0 = time.perf_counter()
    job = load(settings, precision, numerics="default", make_decoder=lambda loaded: make_decoder(
        loaded.model, tuple(eos_token_ids(loaded)), args.regime, max_len=args.max_len, max_rows=args.rows))
    loaded_s = time.perf_counter() - t0
    batch, first_s = first_step(job.decoder, args)
    return job, batch, loaded_s, first_s


def prompts_of(args) -> list[list[int]]:
    return [[5 + (r + j) % 7 for j in range(args.prompt)] for r in range(args.rows)]


def first_step(decoder, args) -> tuple:
    """The decoder's prompts forward and first one-token step at ``args.rows`` rows (a CUDA graph's capture)."""
    t0 = time.perf_counter()
    batch, _ = decoder.open(prompts_of(args))
    decoder.step(batch, [5] * args.rows)
    synchronize()
    return batch, time.perf_counter() - t0


def host_rates(job, batch, args) -> dict:
    """Per decode step, the greedy choice and its sync at ``args.rows`` rows and at 1; the boundary matcher's text
    decode per live row and step, over the ids the model itself generates (mean over stage lengths 1..``args.stage``);
    the fingerprint rate of the batch's caches, stepped on to a boundary cache's length (prompt + stage - 1)."""
    import torch

    from stagereplay.decode.greedy import BoundaryMatcher, decode_rows, greedy_choice
    from stagereplay.io.fingerprints import fingerprint_layers

    vocab = job.loaded.model.config.vocab_size
    out = {"greedy_step_s": {}}
    for rows in sorted({args.rows, 1}):
        logits = torch.randn(rows, vocab, device=job.decoder.device)
        greedy_choice(logits)
        t0 = time.perf_counter()
        for _ in range(20):
            greedy_choice(logits)
        out["greedy_step_s"][rows] = (time.perf_counter() - t0) / 20
    while batch.length < min(args.prompt + args.stage - 1, args.max_len - 1):
        job.decoder.step(batch, [5] * args.rows)
    layers = [job.decoder.row_layers(batch, r, batch.length) for r in range(args.rows)]
    size = sum(t.numel() * t.element_size() for row in layers for pair in row for t in pair)
    t0 = time.perf_counter()
    for row in layers:
        fingerprint_layers(row)
    out["fingerprint_GB_s"] = size / 1e9 / (time.perf_counter() - t0)
    if args.marker:
        tokenizer = job.loaded.tokenizer
        matcher = BoundaryMatcher(args.stage, text=args.marker, decode=tokenizer.decode)
        budget = max(1, min(2 * args.stage, args.max_len - args.prompt - 1))
        generated = decode_rows(job.decoder, prompts_of(args)[:1], matcher=matcher, max_stage_tokens=budget,
                                max_new_tokens=0)[0]
        ids = generated.stage_ids or generated.suffix_ids
        t0 = time.perf_counter()
        for length in range(1, len(ids) + 1):
            matcher.reached(ids[:length])
        out["matcher_s_per_row_step"] = (time.perf_counter() - t0) / len(ids)
        out["matcher_stage_tokens"] = len(ids)
    return out


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release_device() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_overhead(args) -> dict:
    """Run :func:`overhead_child` in a fresh Python process and return what it measured, with the process's whole
    wall time."""
    command = [sys.executable, str(Path(__file__).resolve()), "--overhead-child", "--measure-overhead",
               args.measure_overhead, "--precision", *args.precision, "--regime", args.regime, "--rows", str(args.rows),
               "--prompt", str(args.prompt), "--stage", str(args.stage), "--max-len", str(args.max_len),
               "--device", args.device, "--revision", args.revision]
    command += ["--prepared-models", args.prepared_models] if args.prepared_models else []
    command += ["--marker", args.marker] if args.marker else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    spawned = time.time()
    done = subprocess.run(command + ["--spawned", repr(spawned)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the overhead measurement failed:\n{done.stderr[-4000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    measured["process_s"] = time.time() - spawned
    measured["argv"] = sys.argv[1:]
    return measured


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
        from stagereplay.experiments.transplant import enumerate_sweeps

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


def main(argv=None) -> int:
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
    over.add_argument("--overhead-child", action="store_true", help=argparse.SUPPRESS)
    over.add_argument("--spawned", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.overhead_child or args.measure_overhead:
        args.prompt = 16 if args.prompt is None else int(args.prompt)
        args.stage = 64 if args.stage is None else int(args.stage)
    if args.overhead_child:
        print(json.dumps(overhead_child(args)))
        return 0
    if args.measure_overhead:
        measured = measure_overhead(args)
        text = json.dumps(measured, indent=1)
        print(text)
        if args.json:
            Path(args.json).write_text(text + "\n")
        return 0
    if not ((args.run or args.config) and args.measures) or (args.overhead_s is None) == (args.overhead_json is None):
        ap.error("give --run or --config, --measures and one of --overhead-s or --overhead-json (or "
                 "--measure-overhead MODEL_DIR)")
    measured = json.loads(Path(args.overhead_json).read_text()) if args.overhead_json else {}
    overhead = (Overhead.from_json(measured) if args.overhead_json
                else Overhead.from_seconds(args.overhead_s, args.load_s))
    if args.config:
        return main_config(args, ap, overhead, measured)
    run = json.loads(Path(args.run).read_text())
    if args.schedule:
        run["schedule"] = args.schedule
    report = compare(run, load_measures(args.measures), overhead,
                     load_measures(args.measures_batch1) if args.measures_batch1 else None)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
