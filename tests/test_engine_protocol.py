"""The engine protocol (stagereplay.engines.protocol): a new engine is one class, one catalogue entry and one config
block. A dummy engine (pure Python, deterministic over a fake vocabulary; no llama.cpp) is added to the catalogue
here and runs through the engine stage unchanged: its rows over its own stage and the pipeline's, the replica check,
the audit, shards and their gather. docs/EXTENDING.md points here: copy this file for a new engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stagereplay import catalogue
from stagereplay.analysis import inputs
from stagereplay.catalogue import Engine as EngineEntry
from stagereplay.catalogue import EngineConstruction, ResultFile
from stagereplay.decode.greedy import RowResult, stage_end
from stagereplay.engines.protocol import Engine, engine_class
from stagereplay.engines.rows import ledger_schema
from stagereplay.experiments.audit import AuditFailedError
from stagereplay.experiments.recipe import ReplicaMismatchError
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.stages.engine import (
    EngineReplaySettings,
    audit_engine,
    gather_engine_audit,
    gather_engine_rows,
    replay_on_engine,
)

VOCAB = 16  # ids 0..15; 15 ends the suffix (end of generation)


@dataclass(frozen=True, kw_only=True)
class DummyConfig:
    """The dummy's config block: its precisions (one context each) and a flag that breaks replicas."""

    inherited: ClassVar[tuple[str, ...]] = ()
    precisions_run: tuple[str, ...] = ("dummy_a", "dummy_b")
    drift: bool = False  # every run differs from the last in its margins: replicas must not pass

    def precisions(self) -> tuple[str, ...]:
        return tuple(self.precisions_run)

    def gpus(self) -> int:
        return 0


class DummyEngine:
    """Logits are a hash of (precision, the ids fed so far): every construction of the same ids gives the same
    state, so that the constructions agree and replicas are exact."""

    name: ClassVar[str] = "dummy"
    label: ClassVar[str] = "Dummy"
    config_class: ClassVar[type] = DummyConfig
    fields: ClassVar[list] = [("dummy_precision", pa.string()), ("dummy_forwards", pa.int32())]

    def __init__(self, config: DummyConfig, precision: str):
        self.config, self.precision, self.runs = config, precision, 0

    @classmethod
    def require(cls) -> None:
        pass

    @classmethod
    def model_file(cls, model: str, revision: str | None, base_dir: str) -> str:
        return f"{model}@{revision}"

    @classmethod
    def open(cls, path, config, precision, n_ctx, main_gpu):
        return cls(config, precision)

    @classmethod
    def visible_gpus(cls) -> int:
        return 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        pass

    def sibling(self):
        return type(self)(self.config, self.precision)

    def provenance(self) -> dict:
        return {"dummy_precision": self.precision, "dummy_forwards": 1}

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)

    def check_prefixes(self, prefixes) -> None:
        if any(p.prompt_len + p.n_cached > 1000 for p in prefixes):
            raise ValueError("too long for the dummy")

    def _logits(self, ids: list[int]) -> np.ndarray:
        digest = hashlib.sha256(f"{self.precision}:{ids}".encode()).digest()
        return np.frombuffer(digest[:VOCAB], np.uint8).astype(np.float32)  # (vocab,)

    def _state(self, ids: list[int]) -> tuple:
        whole = hashlib.sha256(f"{self.precision}:{ids}".encode()).hexdigest()
        return whole, [whole[:8]], [whole[8:16]]

    def _continue(self, prompt_ids, stage_ids, max_new_tokens) -> RowResult:
        self.runs += 1
        ids = list(prompt_ids) + list(stage_ids)
        fingerprints = self._state(ids[:-1])
        suffix, margins, stop = [], [], "max_new_tokens"
        for _ in range(max_new_tokens):
            logits = self._logits(ids)
            token = int(np.argmax(logits))
            second, first = np.partition(logits, -2)[-2:]
            suffix.append(token)
            margins.append(float(first - second) + (self.runs if self.config.drift else 0))
            ids.append(token)
            if token == VOCAB - 1:
                stop = "eos"
                break
        return RowResult(list(stage_ids), suffix, margins, stop, pad=0,
                         position=len(prompt_ids) + len(stage_ids) - 1, fingerprints=fingerprints)

    def replay(self, construction, prompt_ids, stage_ids, max_new_tokens) -> RowResult:
        return self._continue(prompt_ids, stage_ids, max_new_tokens)

    def generate(self, prompt_ids, matcher, max_stage_tokens, max_new_tokens) -> RowResult:
        generated: list[int] = []
        while True:
            token = int(np.argmax(self._logits(list(prompt_ids) + generated)))
            generated.append(token)
            ended = stage_end(matcher, generated, max_stage_tokens, token == VOCAB - 1)
            if ended == "boundary":
                return self._continue(prompt_ids, generated, max_new_tokens)
            if ended == "boundary_missing":
                return RowResult([], generated, [], "boundary_missing")


@pytest.fixture
def dummy(monkeypatch):
    """The dummy in the catalogue: one entry (its class, outputs, constructions) and its results files."""
    entry = EngineEntry("dummy", f"{__name__}.DummyEngine", ("engine_dummy", "engine_dummy_audit"), constructions=(
        EngineConstruction("live", "the dummy's own greedy generation", "incremental", generates=True),
        EngineConstruction("incremental", "the dummy token by token", "incremental"),
        EngineConstruction("prefill", "the dummy in one forward", "prefill"),
    ))
    monkeypatch.setattr(catalogue, "ENGINES", (*catalogue.ENGINES, entry))
    monkeypatch.setattr(catalogue, "RESULT_FILES", (
        *catalogue.RESULT_FILES, ResultFile("engine_dummy", "{revision}/engine_dummy.parquet", "gather_engine_rows"),
        ResultFile("engine_dummy_audit", "{revision}/engine_dummy_audit.parquet", "gather_engine_audit")))
    return entry


@pytest.fixture
def paths(tmp_path) -> tuple[str, str]:
    """items.parquet and prefixes.parquet of four items; item 2's reference generation missed the boundary."""
    items = pd.DataFrame([{"item_index": i, "item_id": f"item-{i}", "gold_answer": "7", "question": f"q{i}",
                           "source_row": i} for i in range(4)])
    write_parquet(items, tmp_path / "items.parquet", {})
    prefixes = pd.DataFrame([{"item_index": i, "item_id": f"item-{i}", "revision": "r", "precision": "bf16",
                              "status": "boundary_missing" if i == 2 else "ok", "prompt_ids": [1, 2, i],
                              "stage_ids": [] if i == 2 else [3, 4, 5], "prefix_fingerprint": "",
                              "gold_answer": "7"} for i in range(4)])
    write_parquet(prefixes, tmp_path / "prefixes.parquet", {})
    return str(tmp_path / "items.parquet"), str(tmp_path / "prefixes.parquet")


def settings(**kw) -> EngineReplaySettings:
    given = {k: kw.pop(k) for k in ("shard", "n_shards") if k in kw}
    return EngineReplaySettings(engine="dummy", model="dummy-model", revision="r", precision="bf16",
                                boundary={"marker": "1", "occurrence": 1}, max_stage_tokens=6, max_new_tokens=5,
                                settings=kw, **given)


def table(path):
    return pq.read_table(path).replace_schema_metadata(None)


def test_the_dummy_and_llama_cpp_implement_the_protocol(dummy):
    assert isinstance(DummyEngine(DummyConfig(), "dummy_a"), Engine)
    assert engine_class("dummy") is DummyEngine
    llama = pytest.importorskip("stagereplay.engines.llama_cpp").LlamaCppEngine  # no binding needed to import
    members = [name for name in dir(Engine) if not name.startswith("_")] + list(Engine.__annotations__)
    assert [m for m in members if not hasattr(llama, m) and m != "precision"] == []
    assert isinstance(llama.__dict__["precision"], property)


def test_the_stage_runs_the_dummy_rows_replicas_audit_and_gather(dummy, paths, tmp_path):
    rows = tmp_path / "engine_dummy.parquet"
    replay_on_engine(*paths, str(rows), settings())
    frame = read_parquet(rows)
    assert pq.read_schema(rows).names == ledger_schema(DummyEngine).names
    assert set(frame["experiment"]) == {"dummy_own_stage", "dummy_reference_stage"}
    assert set(frame["decode_regime"]) == {"dummy"} and set(frame["engine"]) == {"dummy"}
    assert set(frame["precision"]) == {"dummy_a", "dummy_b"} == set(read_provenance(rows)["engine_contexts"])
    own = frame[frame["stage_source"] == "engine"]
    reached = own[own["status"] == "ok"]
    assert set(reached["construction"]) == {"live", "incremental", "prefill"}  # live generates; the others rebuild
    assert set(frame.loc[frame["stage_source"] == "reference", "construction"]) == {"incremental", "prefill"}
    assert 2 not in set(frame.loc[frame["stage_source"] == "reference", "item_index"])
    for _, pair in frame.groupby(["experiment", "precision", "item_index", "construction"]):
        assert len(pair) == 2 and pair["suffix_ids"].map(tuple).nunique() == 1  # two replicas, identical
    # the rebuilt states of the same ids are the generated one's, as the dummy builds them
    first = reached[reached["replica"] == 1].groupby(["precision", "item_index"])["cache_fingerprint"].nunique()
    assert set(first) == {1}

    audit = tmp_path / "audit.parquet"
    audit_engine(*paths, str(rows), str(audit), settings())
    assert read_parquet(audit)["reproduced"].all() and len(read_parquet(audit)) == len(frame)

    parts = [tmp_path / f"part_{s}.parquet" for s in range(2)]
    for shard, part in enumerate(parts):
        replay_on_engine(*paths, str(part), settings(shard=shard, n_shards=2))
    gathered = tmp_path / "gathered.parquet"
    gather_engine_rows("dummy", [str(p) for p in parts], str(gathered))
    assert table(gathered).equals(table(rows))
    audits = [tmp_path / f"audit_{s}.parquet" for s in range(2)]
    for shard, part in enumerate(audits):
        audit_engine(*paths, str(gathered), str(part), settings(shard=shard, n_shards=2))
    gather_engine_audit([str(a) for a in audits], str(tmp_path / "audits.parquet"))
    assert table(tmp_path / "audits.parquet").equals(table(audit))


def test_a_dummy_row_changed_fails_its_audit_and_drifting_replicas_stop_the_run(dummy, paths, tmp_path):
    rows = tmp_path / "engine_dummy.parquet"
    replay_on_engine(*paths, str(rows), settings())
    frame = read_parquet(rows)
    frame.at[0, "dummy_forwards"] = 2
    write_parquet(frame, rows, {}, ledger_schema(DummyEngine))
    with pytest.raises(AuditFailedError, match=r"Dummy engine rows of (.|\n)*dummy_forwards 2 -> 1"):
        audit_engine(*paths, str(rows), str(tmp_path / "audit.parquet"), settings())
    with pytest.raises(ReplicaMismatchError, match=r"Dummy live over the engine's stage ids, replicas 1 "
                                                   r"and 2 at dummy_a differ in margins"):
        replay_on_engine(*paths, str(tmp_path / "again.parquet"), settings(drift=True))


def test_the_dummy_is_listed_where_engines_are(dummy):
    assert "dummy" in catalogue.engine_names() and catalogue.schema_enums()["engines"][-1] == "dummy"
    assert catalogue.result_file("engine_dummy").rule == "gather_engine_rows"
    with pytest.raises(ValueError, match=r"dummy.constructions \['incremental', 'prefill'\] lacks 'live'"):
        dataclasses.replace(settings(), constructions=("incremental", "prefill"))


def test_the_reports_inputs_cover_every_engine_of_the_catalogue():
    """analysis.inputs and the report's producers are derived from the catalogue's engines, not listed by hand."""
    from stagereplay.analysis.revision_data import PRODUCERS

    outputs = [o for e in catalogue.ENGINES for o in e.outputs]
    assert all(inputs.FILES[o] == f"{o}.parquet" for o in outputs) and set(outputs) <= set(PRODUCERS)


def test_the_report_has_a_section_and_findings_for_the_dummy(dummy, paths, tmp_path):
    """The report's engine section and the beyond-the-study rows are the catalogue's, for any engine: the dummy's
    rows are counted under its own name. Control: without the dummy in the catalogue there is no such section."""
    from stagereplay.analysis import report
    from stagereplay.analysis.engine_report import engine_section
    from stagereplay.analysis.findings import engine_rows
    from stagereplay.analysis.revision_data import RevisionData

    assert [s.key for s in report.sections()][-2:] == ["engine_dummy", "excluded"]
    rows = tmp_path / "engine_dummy.parquet"
    replay_on_engine(*paths, str(rows), settings())
    lines, numbers = engine_section(RevisionData("r", {"engine_dummy": str(rows)}), dummy)
    text = "\n".join(lines)
    assert "Over its own stage, `live` is dummy's own greedy generation" in text and "llama" not in text
    assert {s["side"] for s in numbers["splits"]} == {"dummy, its own stage", "dummy, reference ids"}
    found = engine_rows("r", {"engine_dummy": numbers}, None, False)
    assert {row[0].split(" (")[0] for row in found} == {"dummy live vs incremental", "dummy live vs prefill",
                                                      "dummy incremental vs prefill"}


def test_without_the_dummy_the_report_has_no_section_for_it():
    from stagereplay.analysis import report

    assert "engine_dummy" not in [s.key for s in report.sections()]
