"""Stages ``replay_on_llama_cpp`` and ``audit_llama_cpp``: the reference precision's prefix ids of a GGUF revision
replayed by llama.cpp in each of its constructions and KV types, and those rows recomputed by a second job.

``replay_on_llama_cpp`` writes results/<run>/<revision>/engine_llama_cpp.parquet: ledger rows (the ledger's columns,
then the engine's context on every row) of experiment ``engine_llama_cpp``, precision ``kv_f16`` / ``kv_f32``.
``audit_llama_cpp`` recomputes every row from scratch and compares every column, margins as float32 bytes, writing
engine_llama_cpp_audit.parquet in the audit's schema; rows that did not reproduce stop the job, named.
Neither loads torch: the model is llama.cpp's, the ids are the pipeline's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pandas as pd

from stagereplay.engines import llama_cpp as engine
from stagereplay.experiments.audit import AUDIT_SCHEMA, AuditFailedError, compare_row, failures_message, record
from stagereplay.experiments.rows import RunSettings
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.io.provenance import software_versions
from stagereplay.models.sources import resolve_source

log = logging.getLogger("stagereplay")


@dataclass(frozen=True, kw_only=True)
class EngineReplaySettings:
    """The rule's params: the revision's GGUF file, the prefixes' precision, the budget and the engine's context."""

    model: str
    revision: str | None
    base_dir: str = "."
    model_fingerprint: dict | None = None  # the file's sha256 when the workflow planned: a changed file reruns
    precision: str  # whose prefixes are replayed (the reference precision)
    max_new_tokens: int
    answer_format: str = "last_number"
    stage_end: str | None = "</think>"
    kv_types: tuple[str, ...] = engine.KV_TYPES
    constructions: tuple[str, ...] = tuple(engine.CONSTRUCTIONS)
    n_ctx: int | None = None
    n_batch: int | None = None
    n_ubatch: int | None = None
    threads: int = 1
    n_gpu_layers: int = 0
    flash_attn: bool = False
    chunk_size: int = 16

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


def replayed_prefixes(items_path: str, prefixes_path: str, precision: str) -> list[tuple[dict, list, list]]:
    """(item, prompt ids, stage ids) of every item whose generation at ``precision`` reached the boundary, in item
    order."""
    items = read_parquet(items_path).set_index("item_index")
    prefixes = read_parquet(prefixes_path)
    at = prefixes[(prefixes["precision"] == precision) & (prefixes["status"] == "ok")].sort_values("item_index")
    if not (prefixes["precision"] == precision).any():
        raise ValueError(f"{prefixes_path} holds no prefixes at {precision}; the engine replays the reference "
                         "precision's prefix ids")
    out = []
    for row in at.itertuples(index=False):
        item = {"item_index": int(row.item_index), "item_id": row.item_id,
                "gold_answer": items.loc[int(row.item_index), "gold_answer"]}
        out.append((item, [int(t) for t in row.prompt_ids], [int(t) for t in row.stage_ids]))
    return out


def _context_size(prefixes, max_new_tokens: int) -> int:
    return max((len(p) + len(s) for _, p, s in prefixes), default=1) + max_new_tokens


def _provenance(stage: str, s: EngineReplaySettings, contexts: dict) -> dict:
    return {"stage": stage, **software_versions(), "engine": engine.ENGINE, "engine_contexts": contexts,
            "prefix_precision": s.precision, "config": {k: v for k, v in vars(s).items() if k != "base_dir"}}


def _rows(s: EngineReplaySettings, prefixes) -> tuple[list[dict], dict]:
    path, n_ctx = s.gguf(), _context_size(prefixes, s.max_new_tokens)
    rows, contexts = [], {}
    for kv_type in s.kv_types:  # every context opened (and refused, if it is) before the first row is decoded
        with engine.LlamaCppEngine(path, s.engine_settings(kv_type, n_ctx)) as e:
            contexts[kv_type] = e.provenance()
    for kv_type in s.kv_types:
        with engine.LlamaCppEngine(path, s.engine_settings(kv_type, n_ctx)) as e:
            for item, prompt, stage in prefixes:
                rows += engine.engine_rows(e, item, prompt, stage, s.run_settings(kv_type), s.constructions)
        log.info("llama.cpp kv %s: %d items x %d constructions x 2 replicas", kv_type, len(prefixes),
                 len(s.constructions))
    return rows, contexts


def replay_on_llama_cpp(items_path: str, prefixes_path: str, out_path: str, s: EngineReplaySettings) -> None:
    prefixes = replayed_prefixes(items_path, prefixes_path, s.precision)
    rows, contexts = _rows(s, prefixes)
    frame = pd.DataFrame(rows, columns=engine.ENGINE_LEDGER_SCHEMA.names)
    write_parquet(frame, out_path, _provenance("replay_on_llama_cpp", s, contexts), engine.ENGINE_LEDGER_SCHEMA)


KEY = ["item_index", "precision", "construction", "replica"]


def audit_rows(stored: pd.DataFrame, recomputed: pd.DataFrame) -> list[dict]:
    """An audit record per stored row: every column compared with the recomputed replica 1 of its item,
    construction and KV type (the engine's context columns too); recomputed rows the file lacks are missing."""
    fresh = {(int(r["item_index"]), r["precision"], r["construction"]): r
             for r in recomputed[recomputed["replica"] == 1].to_dict("records")}
    out, seen = [], set()
    for row in stored.to_dict("records"):
        key = (int(row["item_index"]), row["precision"], row["construction"])
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
    prefixes = replayed_prefixes(items_path, prefixes_path, s.precision)
    rows, contexts = _rows(s, prefixes)
    records = audit_rows(stored, pd.DataFrame(rows, columns=engine.ENGINE_LEDGER_SCHEMA.names))
    failed = [r for r in records if not r["reproduced"]]
    if failed:
        raise AuditFailedError("llama.cpp engine rows of " + ledger_path + ": " + failures_message(failed))
    prov = _provenance("audit_llama_cpp", s, contexts)
    prov["audited"] = read_provenance(ledger_path).get("engine_contexts")
    frame = pd.DataFrame(records, columns=AUDIT_SCHEMA.names).sort_values(KEY)
    write_parquet(frame, out_path, prov, AUDIT_SCHEMA)
