"""What each model job decodes: the jobs are the workflow's (Snakemake's own DAG of the config, :mod:`.dag`), and
what each kind of rule's job decodes is counted here, as the stage code (src/stagereplay/stages,
src/stagereplay/experiments) does it, in cells (:mod:`.counts`). Prices nothing (:mod:`.pricing` does).

The DAG gives which jobs run (each rule's jobs per revision, precision and shard: with ``shards: K`` K jobs of a
rule, over whole batches of the plan, batch b on shard b % K; at batch 1, item by item), the precisions each may
load (its ``params.snapshots``) and the model jobs each waits for. ``WORK`` holds, by rule name, how one rule's
jobs decode; a model rule of the DAG that is in neither ``WORK`` nor ``NOT_PRICED`` is refused (``model_jobs``), so
that a new rule cannot be left out unnoticed. What the DAG cannot know is counted here from the run's shape: what a
job finds in its inputs (which precisions of a dump or an onset have items, so load a model; whether a search has a
divergent item to search). Every revision's jobs are counted from the one shape (the lengths and divergent shares
given or recorded, which are the primary revision's).

A shard's batches holding one of k chosen items are its share of the expected batches (the chance each of its
batches holds one, ``RunShape.holding``; a recorded count spread by the same shares), and a count of items (the
batch-invariance sample, the dumped bytes) its share of the items. Per rule, per job:

- reconstruct_prefixes (per precision and shard): per batch, the matched experiment, live x2 and prefill x2 (two
  replicas each), and one incremental cell with suffix in every batch holding a bridge row (``bridge.n_rows``).
- generate_fixed_prefix (per precision and shard): per batch, every construction of
  ``fixed_prefix.constructions`` x2 (replicas), over the reference precision's prefixes.
- audit_ledger (per precision and shard): per batch, the matched experiment again with one replica (live x1,
  prefill x1; at every precision, since reconstruct_prefixes ran it at every precision) and every fixed-prefix
  construction x1.
- check_batch_invariance (per shard, every precision loaded in turn; the DAG has none at batch size 1 or sample
  0): per precision, for each of min(``batch_invariance.sample``, n) items alone at batch 1: a live cell and a
  prefill cell (over the batched row's stage).
- measure_cache_differences (per shard, each of ``cache_differences.precisions`` loaded in turn; none at
  ``n_items`` 0): per precision, every batch holding one of min(``n_items``, n) sampled items: incremental and
  prefill cells without a suffix.
- dump_caches (per shard): per precision of the ledger that has items to dump (``dump.items``: divergent, d_p * n
  items; all; none), one load, and per batch holding one: both constructions of ``transplant.constructions`` rebuilt
  with their suffixes (live as incremental; the stage's ``Rebuild``), and two caches per item written.
- transplant_caches (per shard, at the transplant precision, always loaded): per batch holding a selected item
  (``transplant.select``: divergent, d * n; sample:k, k; a list), the Rebuild (two cells), then for each transplant
  spec (``enumerate_sweeps(transplant.sweeps, layers)``: 11 for the default sweeps and 28 layers) two cells per
  direction (the donor's bytes and their placebo), of the recipient's construction (live -> prefill: a prefill
  cell; prefill -> live: incremental), and one sham cell per direction.
- find_minimal_transplants (per shard; no model loaded at budget 0 or without a divergent selected item): per batch
  holding a searched item (the divergent selected ones), the Rebuild, then per direction one sham cell and two
  recipient cells (the box and its placebo) per round of the lockstep search (a batch's rounds: the most runs any
  of its rows used; at most the budget).
- measure_divergence_onset (per shard): per precision of the ledger with divergent items, one load, and per batch
  holding one, the Rebuild.
- measure_fidelity (per precision and shard; none with ``fidelity.constructions`` empty): per batch holding a
  compared item (``fidelity.items``: all, or a sample), a ``live`` cell with its suffix and one cell per construction
  of ``fidelity.constructions`` (teacher-forced through live's suffix, from its boundaries in the suffix schedule).
  The loop observes every step, so the lookahead is off and the greedy host work counts in full; besides, per row and
  suffix step, the fp32 logits kept on the device and the per-step comparison (KL, logit difference), at the
  overhead's rates (``rates.Overhead``) or, where it gives none, assumed (10 us and 22 us a row-step: not measured
  on a GPU; the report says so). Against the measured H200 run it projects 0.70 of the stage's time
  (bench/RESULTS.md).

Not priced (``NOT_PRICED``; the report notes their jobs): replay_fixed_prefixes (transplant revisions other than
the primary; bench/pipeline_run.py runs none) and the llama.cpp engine's rules (``engines``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from stagereplay.experiments.transplant_specs import enumerate_sweeps, rebuilt_as
from stagereplay.projection.counts import Work, by_kind, cell, rebuild, total
from stagereplay.projection.dag import DagJob, model_dag
from stagereplay.projection.packing import packed, packed_work
from stagereplay.projection.shape import RunShape, spread


@dataclass
class JobWork:
    rule: str
    name: str  # ``job_name``
    loads: list  # precisions whose model the job loads, in order
    work: dict  # precision -> Work
    shard: int = 0
    precision: str | None = None  # the job's own precision (a rule with one job per precision and shard)
    seconds: float | None = None  # projected (``projected_rules``)
    lookahead: bool = True  # False: its loop observes or forces every step, so the lookahead is off (``pricing.price``)
    logits_GB: float = 0.0  # peak fp32 logits it keeps on the device (measure_fidelity)
    key: tuple = ()  # the DAG's job (``DagJob.key``)
    after: frozenset = frozenset()  # the DAG's model jobs it waits for (their keys)


@dataclass
class ModelSize:
    """What some jobs' work needs of the model: a K/V position's GB by precision (the dumps' bytes) and the
    vocabulary (the fidelity stage's logits)."""

    kv_GB_per_position: dict
    vocab: int = 0


# ---- counts per rule: each takes the rule's jobs of the DAG and gives their work, job by job -----------------------
def job_shard(job: DagJob) -> int:
    return int(job.wildcard("shard"))


def per_precision_jobs(shape: RunShape, planned: list[DagJob], per_batch) -> list[JobWork]:
    """Jobs of one precision and shard each, decoding ``per_batch(precision, shard, rows)`` in each of its
    batches."""
    jobs = []
    for job in planned:
        p, shard = job.wildcard("precision"), job_shard(job)
        work = total(per_batch(p, shard, rows) * batches for rows, batches in shape.kinds(shard).items())
        jobs.append(JobWork(job.rule, "", list(job.loads), {p: work}, shard, p))
    return jobs


def per_shard_jobs(planned: list[DagJob], loads, per_shard) -> list[JobWork]:
    """Jobs of one shard each (every precision in one job), each loading ``loads(job)`` (of what the DAG lets it
    load: a stage loads what the whole run needs on every shard, so that their parts record one provenance) and
    decoding ``per_shard(shard)``: {precision: Work} of its batches, at the precisions it loads."""
    jobs = []
    for job in planned:
        loaded = loads(job)
        work = {p: w for p, w in per_shard(job_shard(job)).items() if p in loaded}
        jobs.append(JobWork(job.rule, "", loaded, work, job_shard(job)))
    return jobs


def all_loads(job: DagJob) -> list:
    return list(job.loads)


def no_loads(job: DagJob) -> list:
    return []


def reconstruct_prefixes(shape: RunShape, planned: list[DagJob], size: ModelSize) -> list[JobWork]:
    k = min(shape.config["bridge"]["n_rows"], shape.n)
    everything = shape.kinds()

    def bridge_share(p, rows):
        held = shape.held(f"bridge_batches_{p}", lambda r: r["bridge"][p]["batches"], k)
        return held.get(rows, 0.0) / everything[rows]  # a batch's chance of a bridge row, by its size

    def per_batch(p, shard, rows):
        matched = 2 * cell(shape, "live", rows=rows) + 2 * cell(shape, "prefill", rows=rows)
        return matched + bridge_share(p, rows) * cell(shape, "incremental", rows=rows)

    return per_precision_jobs(shape, planned, per_batch)


def fixed_prefix_cells(shape: RunShape, replicas: int, rows: int | None = None) -> Work:
    return replicas * total(cell(shape, c, rows=rows) for c in shape.config["fixed_prefix"]["constructions"])


def generate_fixed_prefix(shape: RunShape, planned: list[DagJob], size: ModelSize) -> list[JobWork]:
    return per_precision_jobs(shape, planned, lambda p, shard, rows: fixed_prefix_cells(shape, 2, rows))


def audit_ledger(shape: RunShape, planned: list[DagJob], size: ModelSize) -> list[JobWork]:
    def per_batch(p, shard, rows):
        return cell(shape, "live", rows=rows) + cell(shape, "prefill", rows=rows) + fixed_prefix_cells(shape, 1, rows)

    return per_precision_jobs(shape, planned, per_batch)


def check_batch_invariance(shape: RunShape, planned: list[DagJob], size: ModelSize) -> list[JobWork]:
    if not shape.lockstep:  # one row a batch (fewer items than batch_size): no batched row to compare
        return per_shard_jobs(planned, no_loads, lambda shard: {})
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

    return per_shard_jobs(planned, all_loads, per_shard)


def measure_cache_differences(shape: RunShape, planned: list[DagJob], size: ModelSize) -> list[JobWork]:
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

    return per_shard_jobs(planned, all_loads, per_shard)


def divergent_items(shape: RunShape, p: str) -> float:
    return shape.divergent.get(p, 0.0) * shape.n


def dump_caches(shape: RunShape, planned: list[DagJob], size: ModelSize) -> list[JobWork]:
    chosen = shape.config["dump"]["items"]
    counted = {}
    for p in shape.precisions:
        derived = {"divergent": divergent_items(shape, p), "all": shape.n, "none": 0}[chosen]
        items = shape.count(f"dump_items_{p}", lambda r: r["dump"].get(p, {}).get("items", 0), lambda: derived)
        if round(items) == 0:
            continue
        gb = shape.count(f"dump_GB_{p}", lambda r: r["dump"][p]["bytes"] / 1e9,
                         lambda: 2 * items * shape.boundary_positions * size.kv_GB_per_position[p])
        counted[p] = (items, gb)

    def per_shard(shard):
        work = {}
        for p, (items, gb) in counted.items():  # the shard's batches, and its share of the items' bytes
            held = shape.held(f"dump_batches_{p}", lambda r: r["dump"][p]["batches"], items, shard)
            work[p] = by_kind(held, lambda rows: rebuild(shape, rows)) + Work(dump_GB=gb * shape.item_share(shard))
        return work

    return per_shard_jobs(planned, lambda job: [p for p in job.loads if p in counted], per_shard)


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


def by_rows_share(items: float, held: dict, rows: int) -> float:
    """The selected items a batch of ``rows`` rows holds, of ``items`` over the batches ``held`` ({rows: batches}):
    in proportion to its rows (a partial last batch holds fewer than a full one), so that the batches' shares sum to
    ``items``."""
    slots = sum(r * batches for r, batches in held.items())
    return items * rows / slots if slots else 0.0


ARMS = 2  # each transplant and each search trial runs twice: the donor's bytes and their placebo
SHAMS = 1  # and once per direction and batch, the sham (the recipient's own bytes written back)


def controls(shape: RunShape, stage: str) -> tuple[int, int]:
    """(arms, shams) of a transplant stage: as the run recorded them (a record from before the controls: one arm,
    no sham), else this code's."""
    arms = shape.count(f"{stage}_arms", lambda r: r[stage].get("arms", 1), lambda: ARMS)
    shams = shape.count(f"{stage}_shams", lambda r: r[stage].get("shams", 0), lambda: SHAMS)
    return arms, shams


def transplant_caches(shape: RunShape, planned: list[DagJob], size: ModelSize) -> list[JobWork]:
    p = shape.transplant_precision
    items = shape.count("transplant_items", lambda r: r["transplant"]["items"], lambda: selected_items(shape))
    specs = shape.count("transplant_specs", lambda r: r["transplant"]["specs_per_direction"],
                        lambda: transplant_specs(shape))

    arms, shams = controls(shape, "transplant")

    def per_shard(shard):
        held = shape.held("transplant_batches", lambda r: r["transplant"]["batches"], items, shard)
        if packed(shape):  # a batch's items: the selected items over the batches holding one, by their rows
            share = items * shape.item_share(shard)
            return {p: by_kind(held, lambda rows: rebuild(shape, rows) + packed_work(
                shape, rows, by_rows_share(share, held, rows) * len(directions(shape)) * (arms * specs + shams)))}
        return {p: by_kind(held, lambda rows: rebuild(shape, rows)
                           + recipient_cells(shape, {d: arms * specs + shams for d in directions(shape)}, rows))}

    return per_shard_jobs(planned, all_loads, per_shard)


def find_minimal_transplants(shape: RunShape, planned: list[DagJob], size: ModelSize) -> list[JobWork]:
    p, budget = shape.transplant_precision, shape.config["transplant"]["minimal"]["budget"]
    items = shape.count("minimal_items", lambda r: r["minimal"]["items"],
                        lambda: selected_items(shape, divergent_only=True) if budget else 0)
    if round(items) == 0:
        return per_shard_jobs(planned, no_loads, lambda shard: {})
    held = shape.held("minimal_batches", lambda r: r["minimal"]["batches"], items)
    # a recorded direction may be named incremental where the rebuilt live cache was not the ledger's: the same cell
    rounds = shape.count("minimal_rounds", lambda r: r["minimal"]["rounds_per_direction"] or None,
                         lambda: {d: budget * sum(held.values()) for d in directions(shape)})
    by_rows = {d: spread(runs, held, shape.rows) for d, runs in rounds.items()}  # each batch's rounds, by its size
    arms, shams = controls(shape, "minimal")

    def per_shard(shard):
        mine = shape.held("minimal_batches", lambda r: r["minimal"]["batches"], items, shard)
        if packed(shape):  # per batch and round, every searching row's box and placebo, both directions together
            return {p: total(batches * (rebuild(shape, rows) + packed_work(
                                 shape, rows, by_rows_share(items, held, rows) * shams * len(by_rows)))
                             + packed_work(shape, rows, by_rows_share(items, held, rows) * len(by_rows) * arms)
                             * (max(r.get(rows, 0.0) for r in by_rows.values()) / held[rows]) * batches
                             for rows, batches in mine.items() if batches)}
        # the shard's rounds: its share of the batches of each size
        return {p: total(batches * rebuild(shape, rows)
                         + recipient_cells(shape, {d: arms * r.get(rows, 0.0) * (batches / held[rows]
                                                                                 if shape.shards > 1 else 1.0)
                                                   + shams * batches for d, r in by_rows.items()}, rows)
                         for rows, batches in mine.items() if batches)}

    return per_shard_jobs(planned, all_loads, per_shard)


def measure_divergence_onset(shape: RunShape, planned: list[DagJob], size: ModelSize) -> list[JobWork]:
    counted = {}
    for p in shape.precisions:
        items = shape.count(f"onset_items_{p}", lambda r: r["onset"].get(p, {}).get("items", 0),
                            lambda: divergent_items(shape, p))
        if round(items) != 0:
            counted[p] = items

    def per_shard(shard):
        return {p: by_kind(shape.held(f"onset_batches_{p}", lambda r: r["onset"][p]["batches"], items, shard),
                           lambda rows: rebuild(shape, rows)) for p, items in counted.items()}

    return per_shard_jobs(planned, lambda job: [p for p in job.loads if p in counted], per_shard)


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


def measure_fidelity(shape: RunShape, planned: list[DagJob], size: ModelSize) -> list[JobWork]:
    """Per precision and shard, every batch holding a compared item (``fidelity.items``): ``fidelity_cells``. The
    loop observes (and forces) every step, so its lookahead is off. Its peak logits on the device: the reference's
    kept rows plus one construction's, rows x N_b x vocab x 4 B each."""
    k = fidelity_items(shape)
    jobs = []
    for job in planned:
        p, shard = job.wildcard("precision"), job_shard(job)
        held = shape.held(f"fidelity_batches_{p}", lambda r: r["fidelity"][p]["batches"], k, shard)
        work = by_kind(held, lambda rows: fidelity_cells(shape, rows, rows * k / shape.n))
        priced = JobWork(job.rule, "", list(job.loads), {p: work}, shard, p, lookahead=False)
        priced.logits_GB = 2 * max(held, default=0) * shape.N_b * size.vocab * 4 / 1e9 if any(held.values()) else 0.0
        jobs.append(priced)
    return jobs


# ---- the DAG's model jobs, priced by rule ----------------------------------------------------------------------------
# How each model rule's jobs decode, in the order the report lists them. A model rule of the DAG missing here and
# from NOT_PRICED is refused: add its count here (and its test) when adding the rule.
WORK = {"reconstruct_prefixes": reconstruct_prefixes, "generate_fixed_prefix": generate_fixed_prefix,
        "audit_ledger": audit_ledger, "check_batch_invariance": check_batch_invariance,
        "measure_cache_differences": measure_cache_differences, "transplant_caches": transplant_caches,
        "find_minimal_transplants": find_minimal_transplants, "measure_divergence_onset": measure_divergence_onset,
        "dump_caches": dump_caches, "measure_fidelity": measure_fidelity}
# Model rules known and left out of the projection, and why (the report notes their jobs).
NOT_PRICED = {
    "replay_fixed_prefixes": "a transplant revision's own baseline, not counted",
    "replay_on_engine": "a serving engine (llama.cpp): no rates measured for it",
    "audit_engine": "a serving engine (llama.cpp): no rates measured for it",
}


class UnpricedRuleError(ValueError):
    """The DAG holds model jobs of a rule the projection does not know how to count."""


def job_name(job: DagJob, shards: int, revisions: int) -> str:
    """The rule, the revision where the DAG's model jobs are at several, then the precision and shard of a rule of
    one job per precision and shard, or the shard of one of one job per shard where there are several."""
    parts = [job.rule] + ([job.wildcard("revision")] if revisions > 1 else [])
    if job.wildcard("precision") is not None:
        parts += [job.wildcard("precision"), job.wildcard("shard")]
    elif shards > 1:
        parts.append(job.wildcard("shard"))
    return "_".join(parts)


def model_jobs(shape: RunShape, kv_GB_per_position: dict, vocab: int = 0,
               planned: list[DagJob] | None = None) -> list[JobWork]:
    """Every model job of the workflow's DAG of the run's config (``dag.model_dag``; ``planned`` where given), with
    the work it decodes (``WORK``, by rule), rule by rule in ``WORK``'s order, each rule's jobs by revision,
    precision and shard. A model rule of the DAG that ``WORK`` does not count is refused (``UnpricedRuleError``); one
    of ``NOT_PRICED`` is left out and noted."""
    planned = model_dag(shape.config) if planned is None else planned
    rules = {job.rule for job in planned}
    unknown = sorted(rules - set(WORK) - set(NOT_PRICED))
    if unknown:
        raise UnpricedRuleError(
            f"the workflow's DAG holds model jobs (rules with a gpu resource) of {', '.join(unknown)}, which the "
            "projection does not count: add how their jobs decode to stagereplay.projection.jobs.WORK (or the rule "
            "and why to NOT_PRICED)")
    for rule in sorted(rules & set(NOT_PRICED)):
        count = sum(job.rule == rule for job in planned)
        shape.warnings.append(f"{rule}: {count} model job(s) of the DAG not projected ({NOT_PRICED[rule]})")
    revisions = len({job.wildcard("revision") for job in planned})
    size = ModelSize(kv_GB_per_position, vocab)
    jobs = []
    for rule, count in WORK.items():
        mine = sorted((job for job in planned if job.rule == rule), key=lambda job: (
            str(job.wildcard("revision")), shape.precisions.index(job.wildcard("precision", shape.precisions[0])),
            job_shard(job)))
        for job, priced in zip(mine, count(shape, mine, size) if mine else []):
            priced.name, priced.key, priced.after = job_name(job, shape.shards, revisions), job.key, job.after
            jobs.append(priced)
    return jobs
