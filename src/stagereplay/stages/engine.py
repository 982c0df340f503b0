"""Stages ``replay_on_engine`` and ``audit_engine``: a revision's items replayed by a serving engine (any engine of
the catalogue, :mod:`stagereplay.engines.protocol`) in each of its constructions and precisions, over the engine's
own stage and over the pipeline's stage ids, and those rows recomputed by a second job.

``replay_on_engine`` writes results/<run>/<revision>/engine_<engine>.parquet: ledger rows (the ledger's columns,
then whose stage ids each row used and the engine's context) of experiments ``<engine>_own_stage`` (stage_source
``engine``: the generating construction generates the stage from the prompt the reference precision's generation
read, with the config's boundary and ``max_stage_tokens``; the other constructions rebuild it) and
``<engine>_reference_stage`` (stage_source ``reference``: the reference precision's stage ids), one precision per
context the engine's config block names (llama.cpp: ``kv_f16`` / ``kv_f32``).
``audit_engine`` recomputes every row from scratch, once (one replica, as the pipeline's audit: every stored
replica is compared with it), and compares every column, margins as float32 bytes, writing
engine_<engine>_audit.parquet in the audit's schema; rows that did not reproduce stop the job, named.
Every planned prefix is checked by each context before the first row is decoded. Neither loads torch: the model is
the engine's.

Both split by item shard (``shard`` of ``n_shards``: the items whose ``item_index`` is ``shard`` modulo
``n_shards``, the pipeline's rule without a batch plan), one model per job, the parts joined by
``gather_engine_rows`` and ``gather_engine_audit``. Nothing a row holds depends on the shard: the context's size
comes from the whole selection, every item runs alone from scratch, and the rows are sorted by their key; so a
shard's rows are the whole run's rows of its items, byte for byte.

Nothing here knows any one engine: the engine's class comes from the catalogue by name, its settings from its
config block (``settings``, the fields of its config class).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass

import pandas as pd

from stagereplay.decode.greedy import matcher_from_config
from stagereplay.decode.plans import batches_of
from stagereplay.engines import protocol
from stagereplay.engines.protocol import PlannedPrefix
from stagereplay.engines.rows import (
    STAGE_SOURCES,
    compare_stages,
    constructions_for,
    context_fields,
    engine_rows,
    ledger_schema,
    own_stage_rows,
    reference_of,
)
from stagereplay.experiments.audit import (
    AUDIT_SCHEMA,
    REPLICAS,
    AuditFailedError,
    compare_row,
    failures_message,
    held_counts,
    missing_replicas,
    record,
    unvouched,
)
from stagereplay.experiments.rows import RunSettings
from stagereplay.io.keys import LEDGER_KEY, within_revision
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.io.provenance import software_versions
from stagereplay.models.gpus import GpuSlot, claim_gpu
from stagereplay.stages.gather import gather

log = logging.getLogger("stagereplay")


@dataclass(frozen=True, kw_only=True)
class EngineReplaySettings:
    """The rule's params: which engine, the revision's model, the prefixes' precision, the stage rule and budgets,
    which stage ids and constructions, and the engine's own settings (its config block, as its config class's
    fields)."""

    engine: str  # the catalogue's engine
    model: str
    revision: str | None
    base_dir: str = "."
    model_fingerprint: dict | None = None  # the file's sha256 when the workflow planned: a changed file reruns
    precision: str  # whose prompts and stage ids are replayed (the reference precision)
    boundary: dict  # the config's boundary: the engine's own stage ends where the pipeline's would
    max_stage_tokens: int
    max_new_tokens: int
    answer_format: str = "last_number"
    stage_end: str | None = "</think>"
    stage_sources: tuple[str, ...] = STAGE_SOURCES
    constructions: tuple[str, ...] | None = None  # None: every construction of the engine's
    settings: dict = dataclasses.field(default_factory=dict)  # the engine's config block; missing keys: defaults
    shard: int = 0  # this job's items: item_index modulo n_shards
    n_shards: int = 1
    contexts: int = 1  # the job's contexts (over one copy of the model), each on a thread of its own

    def __post_init__(self):
        if not 0 <= self.shard < self.n_shards:
            raise ValueError(f"shard {self.shard} of {self.n_shards}: need 0 <= shard < n_shards")
        if self.contexts < 1:
            raise ValueError(f"{self.engine}.contexts {self.contexts}: need at least 1")
        for source in self.stage_sources:
            reference = reference_of(self.engine, source)
            if reference not in constructions_for(self.engine, source, self.names):
                raise ValueError(f"{self.engine}.constructions {list(self.names)} lacks {reference!r}, what the "
                                 f"{source}'s stage ids are compared with: add it, or drop {source!r} from "
                                 f"{self.engine}.stage_sources")

    @property
    def engine_class(self) -> type:
        return protocol.engine_class(self.engine)

    @property
    def names(self) -> tuple[str, ...]:
        """The constructions the job runs."""
        if self.constructions is not None:
            return tuple(self.constructions)
        from stagereplay import catalogue

        return tuple(c.name for c in catalogue.engine(self.engine).constructions)

    @property
    def config(self):
        """The engine's config block, as its config class."""
        return self.engine_class.config_class(**self.settings)

    def model_file(self) -> str:
        return self.engine_class.model_file(self.model, self.revision, self.base_dir)

    def run_settings(self, precision: str) -> RunSettings:
        return RunSettings(self.revision or "", precision, None, self.max_new_tokens, self.answer_format,
                           self.stage_end, decode_regime=self.engine)


@dataclass(frozen=True)
class EngineItem:
    item: dict
    prompt_ids: list[int]
    reference_stage: list[int] | None  # the pipeline's stage ids; None: its generation missed the boundary


def engine_items(items_path: str, prefixes_path: str, precision: str) -> list[EngineItem]:
    """Every item of the prefixes at ``precision``, in item order: its prompt ids, and its stage ids where that
    generation reached the boundary."""
    items = read_parquet(items_path).set_index("item_index")
    prefixes = read_parquet(prefixes_path)
    if not (prefixes["precision"] == precision).any():
        raise ValueError(f"{prefixes_path} holds no prefixes at {precision}; the engine replays the reference "
                         "precision's prompts and stage ids")
    at = prefixes[prefixes["precision"] == precision].sort_values("item_index")
    out = []
    for row in at.itertuples(index=False):
        item = {"item_index": int(row.item_index), "item_id": row.item_id,
                "gold_answer": items.loc[int(row.item_index), "gold_answer"]}
        stage = [int(t) for t in row.stage_ids] if row.status == "ok" else None
        out.append(EngineItem(item, [int(t) for t in row.prompt_ids], stage or None))
    return out


def shard_items(items: list[EngineItem], shard: int, n_shards: int) -> list[EngineItem]:
    """The items of one shard, in item order (:func:`stagereplay.decode.plans.batches_of` without a plan)."""
    mine = {int(b.items[0]["item_index"]) for b in batches_of([it.item for it in items], None, shard, n_shards)}
    return [it for it in items if int(it.item["item_index"]) in mine]


def _context_size(items: list[EngineItem], s: EngineReplaySettings) -> int:
    own = s.max_stage_tokens if "engine" in s.stage_sources else 0
    return max((len(i.prompt_ids) + max(own, len(i.reference_stage or [])) for i in items), default=1) + \
        s.max_new_tokens


def planned_prefixes(items: list[EngineItem], s: EngineReplaySettings) -> list[PlannedPrefix]:
    """Every boundary state the job's constructions will build, at its longest, for a check before any work."""
    planned = []
    for it in items:
        name = it.item["item_id"]
        if "engine" in s.stage_sources:
            planned.append(PlannedPrefix(constructions_for(s.engine, "engine", s.names), len(it.prompt_ids),
                                         s.max_stage_tokens - 1,
                                         f"item {name!r}, over {s.engine_class.label}'s own stage of up to "
                                         f"max_stage_tokens {s.max_stage_tokens} ids"))
        if "reference" in s.stage_sources and it.reference_stage:
            planned.append(PlannedPrefix(constructions_for(s.engine, "reference", s.names), len(it.prompt_ids),
                                         len(it.reference_stage) - 1, f"item {name!r}, over the reference stage ids"))
    return planned


def _provenance(stage: str, s: EngineReplaySettings, contexts: dict) -> dict:
    return {"stage": stage, **software_versions(), "engine": s.engine, "engine_contexts": contexts,
            "prefix_precision": s.precision, "config": {k: v for k, v in vars(s).items() if k != "base_dir"}}


def _item_rows(e, it: EngineItem, s: EngineReplaySettings, matcher, settings: RunSettings,
               replicas: tuple[int, ...]) -> list[dict]:
    rows, comparison = [], None
    if "engine" in s.stage_sources:
        own, stage = own_stage_rows(e, it.item, it.prompt_ids, matcher, s.max_stage_tokens, settings,
                                    constructions_for(s.engine, "engine", s.names), replicas,
                                    reference_stage=it.reference_stage)
        rows += own
        comparison = compare_stages(stage, it.reference_stage)
    if "reference" in s.stage_sources and it.reference_stage:
        rows += engine_rows(e, it.item, it.prompt_ids, it.reference_stage, settings,
                            constructions_for(s.engine, "reference", s.names), replicas, source="reference",
                            comparison=comparison)
    return rows


def claim_engine_gpu(s: EngineReplaySettings) -> GpuSlot:
    """A GPU of this job's own where the engine's config offloads and the engine sees several (the pipeline's lock
    files: jobs side by side under --resources gpu=K each take one), else no claim."""
    if not s.config.gpus():
        return GpuSlot("cpu")
    n_visible = s.engine_class.visible_gpus()
    if s.n_shards > 1 and n_visible <= 1:
        log.warning("%d shards of the %s engine with %d GPU visible: shards side by side on one GPU take turns on "
                    "it and run slower than one shard (0.70x at 4 shards on one H100, docs/ENGINES.md, \"Shards and "
                    "GPUs\"); set %s.shards to the number of GPUs", s.n_shards, s.engine, n_visible, s.engine)
    return claim_gpu("cuda", n_visible=n_visible)


def _rows(s: EngineReplaySettings, items: list[EngineItem], gpu: GpuSlot,
          replicas: tuple[int, ...] = REPLICAS) -> tuple[pd.DataFrame, dict]:
    """The rows of this shard's items, each construction once per replica (checked bit for bit), sorted by their
    key; ``items`` is the whole selection's, which sizes the context and is checked whole, so that no shard count
    changes a context or lets a bad item through. On a claimed GPU the engine puts its work on it (not on the
    others, which other jobs hold)."""
    cls, config = s.engine_class, s.config
    path, n_ctx = s.model_file(), _context_size(items, s)
    rows, contexts = [], {}
    for precision in config.precisions():  # every context opened (and refused, if it is) before the first row
        with cls.open(path, config, precision, n_ctx, gpu.visible_index) as e:
            contexts[precision] = e.provenance()
            e.check_prefixes(planned_prefixes(items, s))
    mine = shard_items(items, s.shard, s.n_shards)
    for precision in config.precisions():
        with contextlib.ExitStack() as stack:
            engines = [stack.enter_context(cls.open(path, config, precision, n_ctx, gpu.visible_index))]
            engines += [stack.enter_context(engines[0].sibling())  # the model once: closed before the first
                        for _ in range(min(s.contexts, max(len(mine), 1)) - 1)]
            rows += _rows_on_engines(engines, mine, s, s.run_settings(precision), replicas)
        log.info("%s %s: %d items (shard %d of %d) on %d context(s), stage ids of %s, %d constructions x %d "
                 "replica(s)", cls.label, precision, len(mine), s.shard, s.n_shards, len(engines),
                 "/".join(s.stage_sources), len(s.names), len(replicas))
    frame = pd.DataFrame(rows, columns=ledger_schema(cls).names)
    return frame.sort_values(SORT_KEYS, kind="stable").reset_index(drop=True), contexts


def _rows_on_engines(engines: list, items: list[EngineItem], s: EngineReplaySettings, settings: RunSettings,
                     replicas: tuple[int, ...]) -> list[dict]:
    """The rows of ``items``, each engine on a thread of its own taking the next item not yet taken (one engine: this
    thread, in order), so that a context with long items does not leave the others idle at the end. Every item runs
    alone in a cleared context, so which engine ran it changes no byte; with several on one GPU, they share this
    process's CUDA context and overlap (separate processes take turns). After an error no engine takes another
    item."""

    def run(e, take) -> list[dict]:
        matcher = matcher_from_config(s.boundary, e)
        out = []
        for it in iter(take, None):
            out += _item_rows(e, it, s, matcher, settings, replicas)
        return out

    queue, lock, failed = list(reversed(items)), threading.Lock(), threading.Event()

    def take() -> EngineItem | None:
        with lock:
            return queue.pop() if queue and not failed.is_set() else None

    if len(engines) == 1:
        return run(engines[0], take)

    def guarded(e) -> list[dict]:
        try:
            return run(e, take)
        except BaseException:
            failed.set()
            raise

    with concurrent.futures.ThreadPoolExecutor(len(engines), thread_name_prefix=f"{s.engine}-context") as pool:
        done = [pool.submit(guarded, e) for e in engines]
        return [row for future in done for row in future.result()]


def replay_on_engine(items_path: str, prefixes_path: str, out_path: str, s: EngineReplaySettings) -> None:
    with claim_engine_gpu(s) as gpu:
        frame, contexts = _rows(s, engine_items(items_path, prefixes_path, s.precision), gpu)
    prov = dict(_provenance("replay_on_engine", s, contexts), gpu=gpu.record())
    write_parquet(frame, out_path, prov, ledger_schema(s.engine_class))


SORT_KEYS = within_revision(LEDGER_KEY)  # a row's key in its revision's file, and the order the file holds


def audit_rows(stored: pd.DataFrame, recomputed: pd.DataFrame, context: list[str]) -> list[dict]:
    """An audit record per stored row: every column compared with the recomputed replica 1 of its experiment (whose
    stage ids), item, construction and precision, the ``context`` columns (whose stage ids, the engine's) too. As
    the pipeline's audit, it refuses what a recomputation cannot vouch for (a row held twice, a replica outside
    :data:`REPLICAS`), and each replica of a recomputed row that the file lacks is missing."""
    fresh = {(r["experiment"], int(r["item_index"]), r["precision"], r["construction"]): r
             for r in recomputed[recomputed["replica"] == 1].to_dict("records")}
    rows = stored.to_dict("records")
    counts = held_counts(rows)
    out, seen = [], set()
    for row in rows:
        key = (row["experiment"], int(row["item_index"]), row["precision"], row["construction"])
        seen.add((*key, int(row["replica"])))
        expected = fresh.get(key)
        if (refused := unvouched(row, counts)) is not None:
            out.append(refused)
            continue
        if expected is None:
            out.append(record(row, False, ["extra_row"], "no such row is recomputed"))
            continue
        expected = dict(expected, replica=row["replica"])
        differed, detail = compare_row(row, expected)
        changed = [name for name in context if row.get(name) != expected.get(name)]
        if changed:
            detail = "; ".join(filter(None, [detail, "engine context: " + ", ".join(
                f"{c} {row.get(c)!r} -> {expected.get(c)!r}" for c in changed)]))
        out.append(record(row, not (differed or changed), differed + changed, detail))
    return out + missing_replicas(fresh, seen, "recomputed, not in the file")


def audit_engine(items_path: str, prefixes_path: str, ledger_path: str, out_path: str,
                 s: EngineReplaySettings) -> None:
    items = engine_items(items_path, prefixes_path, s.precision)
    mine = {int(it.item["item_index"]) for it in shard_items(items, s.shard, s.n_shards)}
    stored = read_parquet(ledger_path)
    stored = stored[stored["item_index"].astype(int).isin(mine)]
    with claim_engine_gpu(s) as gpu:
        recomputed, contexts = _rows(s, items, gpu, replicas=REPLICAS[:1])
    records = audit_rows(stored, recomputed, context_fields(s.engine_class))
    failed = [r for r in records if not r["reproduced"]]
    if failed:
        raise AuditFailedError(f"{s.engine_class.label} engine rows of {ledger_path}: " + failures_message(failed))
    prov = dict(_provenance("audit_engine", s, contexts), gpu=gpu.record())
    audited = read_provenance(ledger_path)  # a gathered file records its parts'
    prov["audited"] = audited.get("engine_contexts") or [p.get("engine_contexts") for p in audited.get("parts", [])]
    frame = pd.DataFrame(records, columns=AUDIT_SCHEMA.names).sort_values(SORT_KEYS, kind="stable")
    write_parquet(frame, out_path, prov, AUDIT_SCHEMA)


def gather_engine_rows(engine: str, parts: list[str], out_path: str) -> None:
    """The shards' engine rows in one file, in the order one job writes them (sorted by their key)."""
    gather(parts, out_path, ledger_schema(protocol.engine_class(engine)), SORT_KEYS)


def gather_engine_audit(parts: list[str], out_path: str) -> None:
    gather(parts, out_path, AUDIT_SCHEMA, SORT_KEYS)
