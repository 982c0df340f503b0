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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pandas as pd

from stagereplay.decode.greedy import matcher_from_config
from stagereplay.engines import llama_cpp as engine
from stagereplay.engines.llama_cpp_rows import Detokenizer, engine_rows, own_stage_rows
from stagereplay.experiments.audit import AUDIT_SCHEMA, AuditFailedError, compare_row, failures_message, record
from stagereplay.experiments.rows import RunSettings
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.io.provenance import software_versions
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

    def __post_init__(self):
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

    def engine_settings(self, kv_type: str, n_ctx: int) -> engine.EngineSettings:
        return engine.EngineSettings(kv_type=kv_type, n_ctx=self.n_ctx or n_ctx, n_batch=self.n_batch,
                                     n_ubatch=self.n_ubatch, threads=self.threads, n_gpu_layers=self.n_gpu_layers,
                                     flash_attn=self.flash_attn, chunk_size=self.chunk_size)

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


def _context_size(items: list[EngineItem], s: EngineReplaySettings) -> int:
    own = s.max_stage_tokens if "engine" in s.stage_sources else 0
    return max((len(i.prompt_ids) + max(own, len(i.reference_stage or [])) for i in items), default=1) + \
        s.max_new_tokens


def _check_forwards(e: engine.LlamaCppEngine, items: list[EngineItem], s: EngineReplaySettings) -> None:
    """Every forward of every item's constructions in one compute graph, else an error naming the item."""
    for it in items:
        name = it.item["item_id"]
        if "engine" in s.stage_sources:
            e.check_item(engine.constructions_for("engine", s.constructions), len(it.prompt_ids),
                         s.max_stage_tokens - 1, f"item {name!r}, over llama.cpp's own stage of up to "
                         f"max_stage_tokens {s.max_stage_tokens} ids")
        if "reference" in s.stage_sources and it.reference_stage:
            e.check_item(engine.constructions_for("reference", s.constructions), len(it.prompt_ids),
                         len(it.reference_stage) - 1, f"item {name!r}, over the reference stage ids")


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


def _rows(s: EngineReplaySettings, items: list[EngineItem]) -> tuple[list[dict], dict]:
    path, n_ctx = s.gguf(), _context_size(items, s)
    rows, contexts = [], {}
    for kv_type in s.kv_types:  # every context opened (and refused, if it is) before the first row is decoded
        with engine.LlamaCppEngine(path, s.engine_settings(kv_type, n_ctx)) as e:
            contexts[kv_type] = e.provenance()
            _check_forwards(e, items, s)
    for kv_type in s.kv_types:
        with engine.LlamaCppEngine(path, s.engine_settings(kv_type, n_ctx)) as e:
            matcher = matcher_from_config(s.boundary, Detokenizer(e))
            for it in items:
                rows += _item_rows(e, it, s, matcher, s.run_settings(kv_type))
        log.info("llama.cpp kv %s: %d items, stage ids of %s, %d constructions x 2 replicas", kv_type, len(items),
                 "/".join(s.stage_sources), len(s.constructions))
    return rows, contexts


def replay_on_llama_cpp(items_path: str, prefixes_path: str, out_path: str, s: EngineReplaySettings) -> None:
    items = engine_items(items_path, prefixes_path, s.precision)
    rows, contexts = _rows(s, items)
    frame = pd.DataFrame(rows, columns=engine.ENGINE_LEDGER_SCHEMA.names)
    write_parquet(frame, out_path, _provenance("replay_on_llama_cpp", s, contexts), engine.ENGINE_LEDGER_SCHEMA)


KEY = ["experiment", "item_index", "precision", "construction", "replica"]


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
    stored = read_parquet(ledger_path)
    rows, contexts = _rows(s, engine_items(items_path, prefixes_path, s.precision))
    records = audit_rows(stored, pd.DataFrame(rows, columns=engine.ENGINE_LEDGER_SCHEMA.names))
    failed = [r for r in records if not r["reproduced"]]
    if failed:
        raise AuditFailedError("llama.cpp engine rows of " + ledger_path + ": " + failures_message(failed))
    prov = _provenance("audit_llama_cpp", s, contexts)
    prov["audited"] = read_provenance(ledger_path).get("engine_contexts")
    frame = pd.DataFrame(records, columns=AUDIT_SCHEMA.names).sort_values(KEY)
    write_parquet(frame, out_path, prov, AUDIT_SCHEMA)
