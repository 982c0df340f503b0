"""A run's shape: what the projection's counts are functions of. From a run's JSON (``bench/pipeline_run.py``'s:
the config it ran with, the ledger's lengths and the counts its results recorded), or for a run not made from a
workflow config and given lengths (``config_run``).

Notation: n items, B = min(batch_size, n) rows a batch, ceil(n / B) batches (a partial last batch decodes a full
batch's steps at its own, fewer rows), P, S, N the ledger's mean prompt, stage and suffix lengths; in lockstep W,
S_b, N_b are the mean over batches of a batch's longest prompt (its padded width), stage and suffix. d_p is the
share of items whose matched live and prefill suffixes differ at precision p.

Counts are read from the run's results where it recorded them (``counts`` in its JSON: the batches, the batches
holding bridge rows, the batch-invariance rows, the cache-difference batches, the dumped items and bytes, the
transplanted items and specs per direction, the minimal search's rounds per direction, the onset's items, and the
decode buffer L); derived from the config and the ledger's divergent shares otherwise (a batch holds one of k
items chosen among n with the hypergeometric chance). ``RunShape.sources`` says which was which.

A run not made: the same counts, all derived from a workflow config (the schema's defaults filled as the workflow
fills them, ``KEY=VALUE`` overrides applied) and the given lengths (a batch's longest prompt, stage and suffix
taken equal to the means), divergent shares and layer count; the decode buffer L = the longest prompt +
``max_stage_tokens`` + ``max_new_tokens``, as ``reconstruct_prefixes`` sets it.

Reads the workflow's schema (``workflow/schemas/config.schema.yaml`` of the checkout this package sits in).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SCHEMA = Path(__file__).resolve().parents[3] / "workflow/schemas/config.schema.yaml"
# The package's greedy loop now, as a run records it (``greedy_loop``): its lookahead in the cuda_graph regime, and
# built constructions skipping the steps before their batch's first boundary. A run not made is priced with it.
GREEDY_LOOP = {"lookahead": "cuda_graph", "built_constructions_skip_before_first_boundary": True}
# a built construction's schedule in a batch (``counts.cell``)
SCHEDULES = ("lockstep", "suffix")
SCHEDULE = "suffix"  # the decoder's schedule now (decode/greedy.py); lockstep kept to price runs made before it


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
    schedule: str = "suffix"  # a built construction's schedule in a batch: lockstep, or suffix (see ``counts.cell``)
    lookahead: bool = False  # the greedy loop overlapped the host's work with the device's (see ``pricing.price``)
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
    # step_fit's bucket is 1) prices each step at its own position instead (``pricing.price``), up to this buffer.
    shape.span = buffer
    if config["shards"] > 1 and not shape.lockstep:
        shape.warnings.append("shards at batch 1: items split by item_index modulo shards, counted as equal shares")
    return shape


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
    max_new_tokens); ``schedule`` the built constructions' schedule in a batch (``counts.cell``)."""
    ledger = {"mean_prompt": prompt, "mean_stage": stage, "mean_suffix": suffix, "batch_width": prompt,
              "batch_stage": stage, "batch_stage_shortest": stage if shortest_stage is None else shortest_stage,
              "batch_suffix": suffix, "divergent_share": dict(divergent)}
    return {"config": config, "ledger": ledger, "counts": {"num_layers": layers}, "greedy_loop": GREEDY_LOOP,
            "schedule": schedule}
