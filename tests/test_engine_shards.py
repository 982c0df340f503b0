"""The llama.cpp engine's replay and audit split by item shard (stagereplay.stages.engine; rules replay_on_engine,
audit_engine and their gathers, at engine llama_cpp): each shard's rows are the whole run's rows of its items, byte
for byte, the gathered file is the whole run's file, the shards' audits reproduce it, the audit runs each row once,
and the workflow plans one job per shard.
Needs the extra ``engines``, as tests/test_engine_llama_cpp.py does."""

from __future__ import annotations

import re

import pandas as pd
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from gguf_fixture import llama_cpp_or_skip, write_tiny_gguf

llama_cpp = llama_cpp_or_skip()

from stagereplay.engines import llama_cpp as engine
from stagereplay.io.parquet import read_parquet, write_parquet
from stagereplay.testing.controls import first_margin_nudged, margins_nudged
from stagereplay.stages.engine import (
    EngineReplaySettings,
    audit_engine,
    gather_engine_audit,
    gather_engine_rows,
    replay_on_engine,
)

QUESTIONS = ("12+34", "52-46+33", "7-3", "90+1")
STAGE = b"46-1-2-"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny GGUF, items and prefixes of QUESTIONS (item 2's reference generation missed the boundary), and a
    boundary that llama.cpp's own stage reaches on some items: a token of item 0's own greedy run."""
    folder = tmp_path_factory.mktemp("shards")
    path = folder / "tiny.gguf"
    write_tiny_gguf(path)
    with engine.LlamaCppEngine(path, engine.EngineSettings(kv_type="f32", n_ctx=128)) as e:
        prompts = [e.llm.tokenize(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n".encode(),
                                  add_bos=False, special=True) for q in QUESTIONS]
        stage = e.llm.tokenize(STAGE, add_bos=False)
        first = next(iter(e.llm.generate(prompts[0], temp=0.0, reset=True)))
    items = pd.DataFrame([{"item_index": i, "item_id": f"item-{i}", "gold_answer": "46", "question": q,
                           "source_row": i} for i, q in enumerate(QUESTIONS)])
    write_parquet(items, folder / "items.parquet", {})
    prefixes = pd.DataFrame([{"item_index": i, "item_id": f"item-{i}", "revision": "tiny", "precision": "bf16",
                              "status": "boundary_missing" if i == 2 else "ok", "prompt_ids": p,
                              "stage_ids": [] if i == 2 else stage, "prefix_fingerprint": "", "gold_answer": "46"}
                             for i, p in enumerate(prompts)])
    write_parquet(prefixes, folder / "prefixes.parquet", {})
    return folder, path, {"token_id": int(first), "occurrence": 1}


def table(path):
    """A Parquet file's rows as Arrow holds them, without its provenance (which names the job)."""
    return pq.read_table(path).replace_schema_metadata(None)


def settings(path, boundary, **kw) -> EngineReplaySettings:
    shard = {k: kw.pop(k) for k in ("shard", "n_shards", "contexts") if k in kw}
    return EngineReplaySettings(engine="llama_cpp", model=str(path), revision="tiny.gguf", precision="bf16",
                                max_new_tokens=6, boundary=boundary, max_stage_tokens=8,
                                settings=dict(chunk_size=3, **kw), **shard)


def test_each_shards_rows_are_the_whole_runs_rows_of_its_items_byte_for_byte(inputs):
    folder, path, boundary = inputs
    paths = (str(folder / "items.parquet"), str(folder / "prefixes.parquet"))
    whole = folder / "whole.parquet"
    replay_on_engine(*paths, str(whole), settings(path, boundary))
    parts = [folder / f"part_{s}.parquet" for s in range(3)]
    for shard, part in enumerate(parts):
        replay_on_engine(*paths, str(part), settings(path, boundary, shard=shard, n_shards=3))
    expected = read_parquet(whole)
    assert set(expected["stage_source"]) == {"engine", "reference"} and expected["item_index"].nunique() == 4
    assert set(expected.loc[expected["item_index"] == 2, "stage_comparison"]) <= {"reference_missing", "both_missing"}
    whole_table = table(whole)
    for shard, part in enumerate(parts):
        rows = table(part)
        assert set(rows["item_index"].to_pylist()) == {i for i in range(4) if i % 3 == shard}
        mine = whole_table.filter(pc.is_in(whole_table["item_index"], value_set=pc.unique(rows["item_index"])))
        assert rows.equals(mine)  # every column's values: ids, margins, fingerprints, the context
    gathered = folder / "gathered.parquet"
    gather_engine_rows("llama_cpp", [str(p) for p in parts], str(gathered))
    assert table(gathered).equals(whole_table)

    # the shards' audits read the gathered file, each recomputing its items only
    audits = [folder / f"audit_{s}.parquet" for s in range(3)]
    for shard, audit in enumerate(audits):
        audit_engine(*paths, str(gathered), str(audit), settings(path, boundary, shard=shard, n_shards=3))
        assert set(read_parquet(audit)["item_index"]) == {i for i in range(4) if i % 3 == shard}
    gather_engine_audit([str(a) for a in audits], str(folder / "audit.parquet"))
    audit = read_parquet(folder / "audit.parquet")
    assert len(audit) == len(expected) and audit["reproduced"].all()


def test_a_shard_outside_the_count_is_refused(inputs):
    with pytest.raises(ValueError, match="shard 2 of 2: need 0 <= shard < n_shards"):
        settings(inputs[1], inputs[2], shard=2, n_shards=2)


def test_the_workflow_plans_one_replay_and_one_audit_job_per_engine_shard(inputs, tmp_path):
    from workflow_runner import snakemake, tiny_config

    tiny_config(tmp_path, model=str(inputs[1]), revisions=["tiny"], engines=["llama_cpp"],
                llama_cpp={"shards": 3, "contexts": 2, "threads": 3})
    planned = snakemake(tmp_path, "-n", "--no-hooks", "--cores", "8").stdout
    counts = {rule: int(n) for rule, n in re.findall(r"^(\w+)\s+(\d+)$", planned, re.M)}
    assert {k: counts.get(k) for k in ("replay_on_engine", "audit_engine", "gather_engine_rows",
                                        "gather_engine_audit")} == {
        "replay_on_engine": 3, "audit_engine": 3, "gather_engine_rows": 1, "gather_engine_audit": 1}
    # each engine job claims its contexts' cores: 2 contexts of 3 threads
    jobs = re.findall(r"rule (replay_on_engine|audit_engine):[^\[]*?threads: (\d+)", planned)  # within its block
    assert len(jobs) == 6 and {threads for _, threads in jobs} == {"6"}


@pytest.mark.parametrize("script", ["gather_engine_rows", "gather_engine_audit"])
def test_the_gathers_import_no_model_stack(script):
    from test_job_imports import SCRIPTS, heavy_after_import, script_imports

    modules = script_imports(SCRIPTS / f"{script}.py")
    assert modules and not heavy_after_import(modules)


def test_side_by_side_jobs_each_claim_a_gpu_and_put_every_layer_on_it(inputs, tmp_path, monkeypatch):
    """With layers offloaded and two GPUs seen, two jobs hold different GPUs (the pipeline's lock files), and each
    context puts every layer on its own (split mode none), not across the GPU the other job holds."""
    from stagereplay.stages import engine as stage

    monkeypatch.setenv("STAGEREPLAY_GPU_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(engine, "gpu_count", lambda: 2)
    offloaded = settings(inputs[1], inputs[2], n_gpu_layers=-1)
    with stage.claim_engine_gpu(offloaded) as one, stage.claim_engine_gpu(offloaded) as two:
        assert {one.visible_index, two.visible_index} == {0, 1} and one.claimed and two.claimed
    assert not stage.claim_engine_gpu(settings(inputs[1], inputs[2])).claimed  # no layer offloaded: no claim

    seen = {}

    def record(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("recorded")

    monkeypatch.setattr(llama_cpp, "Llama", record)
    with pytest.raises(engine.EngineRefusedError):
        engine.LlamaCppEngine.open(str(inputs[1]), offloaded.config, "kv_f16", 128, main_gpu=1)
    assert (seen["split_mode"], seen["main_gpu"]) == (llama_cpp.LLAMA_SPLIT_MODE_NONE, 1)


def test_shards_on_one_visible_gpu_are_warned_of_and_shards_across_gpus_are_not(inputs, tmp_path, monkeypatch,
                                                                                 caplog):
    """Several shards with one GPU seen take turns on it (slower than one shard): the job's log says so and names
    the fix; one shard on one GPU, and several shards over as many GPUs, log nothing of it."""
    from stagereplay.stages import engine as stage

    monkeypatch.setenv("STAGEREPLAY_GPU_LOCK_DIR", str(tmp_path / "locks"))

    def warned(gpus, n_shards):
        monkeypatch.setattr(engine, "gpu_count", lambda: gpus)
        caplog.clear()
        with caplog.at_level("WARNING", logger="stagereplay"):
            stage.claim_engine_gpu(settings(inputs[1], inputs[2], n_gpu_layers=-1, shard=0, n_shards=n_shards))
        return [r.getMessage() for r in caplog.records if "take turns" in r.getMessage()]

    (message,) = warned(1, 4)
    assert "4 shards of the llama_cpp engine with 1 GPU visible" in message and "llama_cpp.shards" in message
    assert warned(1, 1) == [] and warned(4, 4) == []


def test_contexts_on_threads_give_the_one_contexts_rows_byte_for_byte_and_their_audit_reproduces(inputs):
    """Two contexts of one job, each on a thread over every other item, write the one context's file; the audit with
    three contexts reproduces it. The control: a row's margins moved by one ulp is told apart."""
    folder, path, boundary = inputs
    paths = (str(folder / "items.parquet"), str(folder / "prefixes.parquet"))
    one, two = folder / "one_context.parquet", folder / "two_contexts.parquet"
    replay_on_engine(*paths, str(one), settings(path, boundary))
    replay_on_engine(*paths, str(two), settings(path, boundary, contexts=2))
    assert table(two).equals(table(one)) and table(one).num_rows > 8
    audit = folder / "three_contexts_audit.parquet"
    audit_engine(*paths, str(two), str(audit), settings(path, boundary, contexts=3))
    assert read_parquet(audit)["reproduced"].all() and len(read_parquet(audit)) == table(one).num_rows

    assert not first_margin_nudged(table(two)).equals(table(one))
    with pytest.raises(ValueError, match="contexts 0: need at least 1"):
        settings(path, boundary, contexts=0)


def test_the_audit_runs_each_row_once_and_checks_every_stored_replica_against_it(inputs, monkeypatch):
    """The replay runs each construction twice (its replicas); the audit recomputes it once, as the pipeline's audit
    does, and compares both stored replicas with that run: a stored replica 2 one ulp off is named."""
    from stagereplay.experiments.audit import AuditFailedError

    folder, path, boundary = inputs
    paths = (str(folder / "items.parquet"), str(folder / "prefixes.parquet"))
    runs = {"n": 0}
    for name in ("replay", "generate"):
        original = getattr(engine.LlamaCppEngine, name)

        def counted(self, *args, _original=original, **kw):
            runs["n"] += 1
            return _original(self, *args, **kw)

        monkeypatch.setattr(engine.LlamaCppEngine, name, counted)
    ledger, audit = folder / "once.parquet", folder / "once_audit.parquet"
    replay_on_engine(*paths, str(ledger), settings(path, boundary))
    replayed, runs["n"] = runs["n"], 0
    audit_engine(*paths, str(ledger), str(audit), settings(path, boundary))
    stored = read_parquet(ledger)
    assert replayed == len(stored) and runs["n"] * 2 == replayed
    audited = read_parquet(audit)
    assert audited["reproduced"].all() and sorted(audited["replica"]) == sorted(stored["replica"])

    second = stored.index[(stored["replica"] == 2) & (stored["margins"].map(len) > 0)][0]
    stored.at[second, "margins"] = margins_nudged(stored.at[second, "margins"])
    tampered = folder / "once_tampered.parquet"
    write_parquet(stored, tampered, {})
    with pytest.raises(AuditFailedError, match=r"1 ledger row\(s\) did not reproduce:(.|\n)*margins"):
        audit_engine(*paths, str(tampered), str(folder / "tampered_audit.parquet"), settings(path, boundary))


def test_a_jobs_contexts_load_the_model_once_per_precision(inputs, monkeypatch):
    """Contexts beyond the first are siblings over its model (one copy of the weights): a job at three contexts loads
    the model twice per precision (the check before any row, then its contexts), not four times; their rows are the
    one context's (the test above)."""
    folder, path, boundary = inputs
    paths = (str(folder / "items.parquet"), str(folder / "prefixes.parquet"))
    loads, Llama = [], llama_cpp.Llama

    def counted(*args, **kw):
        loads.append(kw.get("type_k"))
        return Llama(*args, **kw)

    monkeypatch.setattr(llama_cpp, "Llama", counted)
    replay_on_engine(*paths, str(folder / "siblings.parquet"), settings(path, boundary, contexts=3, kv_types=["f32"]))
    assert len(loads) == 2 and table(folder / "siblings.parquet").num_rows > 8
    loads.clear()
    replay_on_engine(*paths, str(folder / "siblings_two_kv.parquet"),
                     settings(path, boundary, contexts=3, kv_types=["f16", "f32"]))
    assert len(loads) == 4 and len(set(loads)) == 2


def test_what_a_row_records_of_its_context_is_read_when_it_opens_not_on_the_contexts_threads(inputs, monkeypatch):
    """llama.cpp builds its system info in one static buffer, which contexts on threads would write at once (a row
    read it empty at 16 contexts on one H100): it is read on the thread that opens a context. Here a read on any other
    thread gives what such a race gave, and the rows at 2 contexts still record the one context's."""
    import threading

    folder, path, boundary = inputs
    paths = (str(folder / "items.parquet"), str(folder / "prefixes.parquet"))
    one = folder / "info_one.parquet"
    replay_on_engine(*paths, str(one), settings(path, boundary, kv_types=["f32"]))
    real = llama_cpp.llama_print_system_info

    def racy():
        return real() if threading.current_thread() is threading.main_thread() else b""

    monkeypatch.setattr(llama_cpp, "llama_print_system_info", racy)
    two = folder / "info_two.parquet"
    replay_on_engine(*paths, str(two), settings(path, boundary, contexts=2, kv_types=["f32"]))
    info = read_parquet(two)["system_info"]
    assert set(info) == set(read_parquet(one)["system_info"]) and "" not in set(info)
    assert table(two).equals(table(one))


@pytest.mark.parametrize("broken, named", [("drop", "missing_row"), ("twice", "duplicate_row"),
                                           ("replica 3", "unexpected_row")])
def test_the_audit_names_a_replica_the_file_lacks_holds_twice_or_should_not_hold(inputs, broken, named):
    """A stored replica 2 removed, held twice, or renumbered 3: each stops the audit naming the row, as the
    pipeline's audit does. The control: the file as written reproduces (the tests above)."""
    folder, path, boundary = inputs
    paths = (str(folder / "items.parquet"), str(folder / "prefixes.parquet"))
    ledger = folder / "replicas.parquet"
    if not ledger.exists():
        replay_on_engine(*paths, str(ledger), settings(path, boundary, kv_types=["f32"]))
    stored = read_parquet(ledger)
    second = stored.index[stored["replica"] == 2][0]
    if broken == "drop":
        stored = stored.drop(index=second)
    elif broken == "twice":
        stored = pd.concat([stored, stored.loc[[second]]], ignore_index=True)
    else:
        stored.at[second, "replica"] = 3
    tampered = folder / f"replicas_{broken.replace(' ', '_')}.parquet"
    write_parquet(stored, tampered, {})
    from stagereplay.experiments.audit import AuditFailedError

    with pytest.raises(AuditFailedError, match=rf"replica (2|3): {named}"):
        audit_engine(*paths, str(tampered), str(folder / "replicas_audit.parquet"),
                     settings(path, boundary, kv_types=["f32"]))
