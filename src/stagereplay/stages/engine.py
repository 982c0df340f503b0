"""Stages ``replay_on_llama_cpp`` and ``audit_llama_cpp``: a GGUF revision's items replayed by llama.cpp in each of
its constructions and KV types, over llama.cpp's own stage and over the pipeline's stage ids, and those rows
recomputed by a second job.

``replay_on_llama_cpp`` writes results/<run>/<revision>/engine_llama_cpp.parquet: ledger rows (the ledger's columns,
then whose stage ids each row used and the engine's context) of experiments ``llama_cpp_own_stage`` (stage_source
``engine``: ``live`` generates the stage from the prompt the reference precision's generation read, with the config's
boundary and ``max_stage_tokens``; the other constructions rebuild it) and ``llama_cpp_reference_stage``
(stage_source ``reference``: the reference precision's stage ids), precision ``kv_f16`` / ``kv_f32``.
``audit_llama_cpp`` recomputes every row from scratch and compares every column, margins as float32 bytes, writing
engine_llama_cpp_audit.parquet in the audit's schema; rows that did not reproduce stop the job, named.
Every forward is checked against the context's ``n_ubatch`` for every item before the first row is decoded.
Neither loads torch: the model is llama.cpp's.

Both split by item shard (``shard`` of ``n_shards``: the items whose ``item_index`` is ``shard`` modulo
``n_shards``, the pipeline's rule without a batch plan), one model per job, the parts joined by
``gather_engine_llama_cpp`` and ``gather_engine_llama_cpp_audit``. Nothing a row holds depends on the shard: the
context's size comes from the whole selection, every item runs alone in a cleared context, and the rows are sorted
by their key; so a shard's rows are the whole run's rows of its items, byte for byte.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pandas as pd

from stagereplay.decode.greedy import matcher_from_config
from stagereplay.decode.plans import batches_of
from stagereplay.engines import llama_cpp as engine
from stagereplay.engines.llama_cpp_binding import gpu_count
from stagereplay.engines.llama_cpp_rows import Detokenizer, engine_rows, own_stage_rows
from stagereplay.experiments.audit import AUDIT_SCHEMA, AuditFailedError, compare_row, failures_message, record
from stagereplay.experiments.rows import RunSettings
from stagereplay.io.keys import LEDGER_KEY, within_revision
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.io.provenance import software_versions
from stagereplay.models.gpus import GpuSlot, claim_gpu
from stagereplay.stages.gather import gather
from stagereplay.models.sources import resolve_source

log = logging.getLogger("stagereplay")


@dataclass(frozen=True, kw_only=True)
class EngineReplaySettings:
    """The rule's params: the revision's GGUF file, the prefixes' precision, the stage rule and budgets, and the
    engine's context."""

    model: str
    revision: str | None
    base_dir: str = "."
    model_fingerprint: dict | None = None  # the file's sha256 when the workflow planned: a changed file reruns
    precision: str  # whose prompts and stage ids are replayed (the reference precision)
    boundary: dict  # the config's boundary: llama.cpp's own stage ends where the pipeline's would
    max_stage_tokens: int
    max_new_tokens: int
    answer_format: str = "last_number"
    stage_end: str | None = "</think>"
    stage_sources: tuple[str, ...] = engine.STAGE_SOURCES
    kv_types: tuple[str, ...] = engine.KV_TYPES
    constructions: tuple[str, ...] = tuple(engine.CONSTRUCTIONS)
    n_ctx: int | None = None
    n_batch: int | None = None
    n_ubatch: int | None = None
    threads: int = 1
    n_gpu_layers: int = 0
    flash_attn: bool = False
    chunk_size: int = 16
    shard: int = 0  # this job's items: item_index modulo n_shards
    n_shards: int = 1

    def __post_init__(self):
        if not 0 <= self.shard < self.n_shards:
            raise ValueError(f"shard {self.shard} of {self.n_shards}: need 0 <= shard < n_shards")
        for source in self.stage_sources:
            reference = engine.OWN_REFERENCE if source == "engine" else engine.REFERENCE_REFERENCE
            if reference not in engine.constructions_for(source, self.constructions):
                raise ValueError(f"llama_cpp.constructions {list(self.constructions)} lacks {reference!r}, what the "
                                 f"{source}'s stage ids are compared with: add it, or drop {source!r} from "
                                 "llama_cpp.stage_sources")

    def gguf(self) -> str:
        source = resolve_source(self.model, self.revision, self.base_dir)
        if source.kind != "gguf":
            raise ValueError(f"engines: [llama_cpp] replays a GGUF file; revision {self.revision!r} of model "
                             f"{self.model!r} is a {source.kind} model. Give model a .gguf file (or a folder and "
                             "revisions naming .gguf files), or leave engines empty")
        return f"{source.path}/{source.gguf_file}"

    def engine_settings(self, kv_type: str, n_ctx: int, main_gpu: int | None = None) -> engine.EngineSettings:
        return engine.EngineSettings(kv_type=kv_type, n_ctx=self.n_ctx or n_ctx, n_batch=self.n_batch,
                                     n_ubatch=self.n_ubatch, threads=self.threads, n_gpu_layers=self.n_gpu_layers,
                                     flash_attn=self.flash_attn, chunk_size=self.chunk_size, main_gpu=main_gpu)

    def run_settings(self, kv_type: str) -> RunSettings:
        return RunSettings(self.revision or "", engine.precision_of(kv_type), None, self.max_new_tokens,
                           self.answer_format, self.stage_end, decode_regime=engine.DECODE_REGIME,
                           chunk_size=self.chunk_size)


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


def _check_forwards(e: engine.LlamaCppEngine, items: list[EngineItem], s: EngineReplaySettings) -> None:
    """Every forward of every item's constructions in one compute graph, else an error naming the item with the
    longest (so that the value it names holds every item)."""
    longest = []  # (tokens, construction, what)
    for it in items:
        name = it.item["item_id"]
        if "engine" in s.stage_sources:
            longest.append((*e.longest_forward(engine.constructions_for("engine", s.constructions),
                                               len(it.prompt_ids), s.max_stage_tokens - 1),
                            f"item {name!r}, over llama.cpp's own stage of up to max_stage_tokens "
                            f"{s.max_stage_tokens} ids"))
        if "reference" in s.stage_sources and it.reference_stage:
            longest.append((*e.longest_forward(engine.constructions_for("reference", s.constructions),
                                               len(it.prompt_ids), len(it.reference_stage) - 1),
                            f"item {name!r}, over the reference stage ids"))
    if longest:
        size, construction, what = max(longest, key=lambda x: x[0])
        e.check_forward(size, f"{what}: {construction}'s longest forward")


def _provenance(stage: str, s: EngineReplaySettings, contexts: dict) -> dict:
    return {"stage": stage, **software_versions(), "engine": engine.ENGINE, "engine_contexts": contexts,
            "prefix_precision": s.precision, "config": {k: v for k, v in vars(s).items() if k != "base_dir"}}


def _item_rows(e: engine.LlamaCppEngine, it: EngineItem, s: EngineReplaySettings, matcher, settings) -> list[dict]:
    rows, comparison = [], None
    if "engine" in s.stage_sources:
        own, stage = own_stage_rows(e, it.item, it.prompt_ids, matcher, s.max_stage_tokens, settings,
                                    engine.constructions_for("engine", s.constructions),
                                    reference_stage=it.reference_stage)
        rows += own
        comparison = engine.compare_stages(stage, it.reference_stage)
    if "reference" in s.stage_sources and it.reference_stage:
        rows += engine_rows(e, it.item, it.prompt_ids, it.reference_stage, settings,
                            engine.constructions_for("reference", s.constructions), source="reference",
                            comparison=comparison)
    return rows


def claim_engine_gpu(s: EngineReplaySettings) -> GpuSlot:
    """A GPU of this job's own where layers are offloaded and llama.cpp sees several (the pipeline's lock files:
    jobs side by side under --resources gpu=K each take one), else no claim."""
    if not s.n_gpu_layers:
        return GpuSlot("cpu")
    return claim_gpu("cuda", n_visible=gpu_count())


def _rows(s: EngineReplaySettings, items: list[EngineItem], gpu: GpuSlot) -> tuple[pd.DataFrame, dict]:
    """The rows of this shard's items, sorted by their key; ``items`` is the whole selection's, which sizes the
    context and is checked whole, so that no shard count changes a context or lets a bad item through. On a claimed
    GPU every offloaded layer is on it (not spread over the others, which other jobs hold)."""
    path, n_ctx = s.gguf(), _context_size(items, s)
    rows, contexts = [], {}
    at = dict(main_gpu=gpu.visible_index)
    for kv_type in s.kv_types:  # every context opened (and refused, if it is) before the first row is decoded
        with engine.LlamaCppEngine(path, s.engine_settings(kv_type, n_ctx, **at)) as e:
            contexts[kv_type] = e.provenance()
            _check_forwards(e, items, s)
    mine = shard_items(items, s.shard, s.n_shards)
    for kv_type in s.kv_types:
        with engine.LlamaCppEngine(path, s.engine_settings(kv_type, n_ctx, **at)) as e:
            matcher = matcher_from_config(s.boundary, Detokenizer(e))
            for it in mine:
                rows += _item_rows(e, it, s, matcher, s.run_settings(kv_type))
        log.info("llama.cpp kv %s: %d items (shard %d of %d), stage ids of %s, %d constructions x 2 replicas",
                 kv_type, len(mine), s.shard, s.n_shards, "/".join(s.stage_sources), len(s.constructions))
    frame = pd.DataFrame(rows, columns=engine.ENGINE_LEDGER_SCHEMA.names)
    return frame.sort_values(SORT_KEYS, kind="stable").reset_index(drop=True), contexts


def replay_on_llama_cpp(items_path: str, prefixes_path: str, out_path: str, s: EngineReplaySettings) -> None:
    with claim_engine_gpu(s) as gpu:
        frame, contexts = _rows(s, engine_items(items_path, prefixes_path, s.precision), gpu)
    prov = dict(_provenance("replay_on_llama_cpp", s, contexts), gpu=gpu.record())
    write_parquet(frame, out_path, prov, engine.ENGINE_LEDGER_SCHEMA)


SORT_KEYS = within_revision(LEDGER_KEY)  # a row's key in its revision's file, and the order the file holds


def audit_rows(stored: pd.DataFrame, recomputed: pd.DataFrame) -> list[dict]:
    """An audit record per stored row: every column compared with the recomputed replica 1 of its experiment (whose
    stage ids), item, construction and KV type (the engine's columns too); recomputed rows the file lacks are
    missing."""
    fresh = {(r["experiment"], int(r["item_index"]), r["precision"], r["construction"]): r
             for r in recomputed[recomputed["replica"] == 1].to_dict("records")}
    out, seen = [], set()
    for row in stored.to_dict("records"):
        key = (row["experiment"], int(row["item_index"]), row["precision"], row["construction"])
        seen.add(key)
        expected = fresh.get(key)
        if expected is None:
            out.append(record(row, False, ["extra_row"], "no such row is recomputed"))
            continue
        expected = dict(expected, replica=row["replica"])
        differed, detail = compare_row(row, expected)
        context = [name for name, _ in engine.ENGINE_FIELDS if row.get(name) != expected.get(name)]
        if context:
            detail = "; ".join(filter(None, [detail, "engine context: " + ", ".join(
                f"{c} {row.get(c)!r} -> {expected.get(c)!r}" for c in context)]))
        out.append(record(row, not (differed or context), differed + context, detail))
    for key, row in fresh.items():
        if key not in seen:
            out.append(record(row, False, ["missing_row"], "recomputed, not in the file"))
    return out


def audit_llama_cpp(items_path: str, prefixes_path: str, ledger_path: str, out_path: str,
                    s: EngineReplaySettings) -> None:
    items = engine_items(items_path, prefixes_path, s.precision)
    mine = {int(it.item["item_index"]) for it in shard_items(items, s.shard, s.n_shards)}
    stored = read_parquet(ledger_path)
    stored = stored[stored["item_index"].astype(int).isin(mine)]
    with claim_engine_gpu(s) as gpu:
        recomputed, contexts = _rows(s, items, gpu)
    records = audit_rows(stored, recomputed)
    failed = [r for r in records if not r["reproduced"]]
    if failed:
        raise AuditFailedError("llama.cpp engine rows of " + ledger_path + ": " + failures_message(failed))
    prov = dict(_provenance("audit_llama_cpp", s, contexts), gpu=gpu.record())
    audited = read_provenance(ledger_path)  # a gathered file records its parts'
    prov["audited"] = audited.get("engine_contexts") or [p.get("engine_contexts") for p in audited.get("parts", [])]
    frame = pd.DataFrame(records, columns=AUDIT_SCHEMA.names).sort_values(SORT_KEYS, kind="stable")
    write_parquet(frame, out_path, prov, AUDIT_SCHEMA)


def gather_engine_llama_cpp(parts: list[str], out_path: str) -> None:
    """The shards' engine rows in one file, in the order one job writes them (sorted by their key)."""
    gather(parts, out_path, engine.ENGINE_LEDGER_SCHEMA, SORT_KEYS)


def gather_engine_llama_cpp_audit(parts: list[str], out_path: str) -> None:
    gather(parts, out_path, AUDIT_SCHEMA, SORT_KEYS)
