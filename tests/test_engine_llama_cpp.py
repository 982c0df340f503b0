"""The llama.cpp engine (stagereplay.engines.llama_cpp) on a tiny random Qwen2 GGUF written by stagereplay.testing:
its constructions' forwards, exact replicas checked on bytes, the model it runs, the ledger rows and their audit, the
report's section, and a clear error for each bad input. Needs the extra ``engines``: without the binding this file
skips saying so, and fails where ``CI`` is set (CI installs the extra)."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

try:
    import llama_cpp
except ImportError as exc:  # pragma: no cover - which branch runs depends on the machine
    WHY = f"llama-cpp-python is not installed ({exc}); install it with pip install -e '.[engines]' (docs/ENGINES.md)"
    if os.environ.get("CI"):
        pytest.fail(WHY, pytrace=False)
    pytest.skip(WHY, allow_module_level=True)

from gguf_fixture import TINY, write_tiny_gguf

from stagereplay.analysis.engine_report import engine_section, split_counts
from stagereplay.analysis.revision_data import RevisionData
from stagereplay.engines import llama_cpp as engine
from stagereplay.experiments.audit import AuditFailedError
from stagereplay.experiments.recipe import ReplicaMismatchError
from stagereplay.experiments.rows import LEDGER_SCHEMA, RunSettings
from stagereplay.io.parquet import read_parquet, read_provenance, write_parquet
from stagereplay.stages.engine import EngineReplaySettings, audit_llama_cpp, replay_on_llama_cpp
from stagereplay.testing.gguf import character_vocabulary, write_gguf

QUESTIONS = ("12+34", "52-46+33")
STAGE = b"46-1-2-"  # stage text: the boundary token last
MAX_NEW = 10


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "tiny.gguf"
    model = write_tiny_gguf(path)
    return path, model


def open_engine(path, kv_type="f32", **kw):
    return engine.LlamaCppEngine(path, engine.EngineSettings(kv_type=kv_type, n_ctx=128, chunk_size=3, **kw))


def ids_of(e, question: str) -> tuple[list[int], list[int]]:
    prompt = e.llm.tokenize(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n".encode(),
                            add_bos=False, special=True)
    return prompt, e.llm.tokenize(STAGE, add_bos=False)


def item(i: int) -> dict:
    return {"item_index": i, "item_id": f"item-{i}", "gold_answer": "46"}


def test_each_construction_runs_its_forwards(gguf, monkeypatch):
    """Per construction, the llama_decode calls that build the boundary cache (the prefix but its last token), and
    the prompt cache's save and restore between the prompt and the stage."""
    with open_engine(gguf[0]) as e:
        prompt, stage = ids_of(e, QUESTIONS[0])
        P, S = len(prompt), len(stage) - 1
        calls = []
        monkeypatch.setattr(e.llm, "eval", lambda ids: calls.append(len(ids)))
        monkeypatch.setattr(e.llm, "save_state", lambda: calls.append("save") or "state")
        monkeypatch.setattr(e.llm, "load_state", lambda state: calls.append(f"load {state}"))
        seen = {}
        for name in engine.CONSTRUCTIONS:
            calls.clear()
            e.build(name, prompt, stage)
            seen[name] = list(calls)
    chunks = [3] * ((P + S) // 3) + ([(P + S) % 3] if (P + S) % 3 else [])
    assert seen == {"live": [P] + [1] * S, "prefill": [P + S], "prompt_cache": [P, "save", "load state", S],
                    "chunked": chunks}


def test_replicas_are_exact_on_bytes_and_rows_hold_the_ledger_schema(gguf):
    rows = []
    for kv_type in engine.KV_TYPES:
        settings = RunSettings("tiny", engine.precision_of(kv_type), None, MAX_NEW, stage_end=None,
                               decode_regime=engine.DECODE_REGIME)
        with open_engine(gguf[0], kv_type) as e:
            for i, question in enumerate(QUESTIONS):
                rows += engine.engine_rows(e, item(i), *ids_of(e, question), settings)
    frame = pd.DataFrame(rows)
    table = pa.Table.from_pandas(frame, schema=engine.ENGINE_LEDGER_SCHEMA, preserve_index=False)
    assert table.schema.names[:len(LEDGER_SCHEMA)] == LEDGER_SCHEMA.names
    assert len(frame) == len(engine.KV_TYPES) * len(QUESTIONS) * len(engine.CONSTRUCTIONS) * 2
    for _, pair in frame.groupby(["precision", "item_index", "construction"]):
        one, two = pair.to_dict("records")
        assert one["suffix_ids"] == two["suffix_ids"] and len(one["suffix_ids"]) > 0
        assert np.asarray(one["margins"], "<f4").tobytes() == np.asarray(two["margins"], "<f4").tobytes()
        assert (one["cache_fingerprint"], one["cache_k_fingerprints"], one["cache_v_fingerprints"]) == \
            (two["cache_fingerprint"], two["cache_k_fingerprints"], two["cache_v_fingerprints"])
        assert len(one["cache_k_fingerprints"]) == len(one["cache_v_fingerprints"]) == TINY["num_hidden_layers"]
    assert set(frame["binding_version"]) == {llama_cpp.__version__}
    assert set(frame["system_info"]) == {llama_cpp.llama_print_system_info().decode().strip()}
    assert set(frame["status"]) == {"ok"} and set(frame["experiment"]) == {engine.EXPERIMENT}
    # the KV type is the precision factor: an f16 cache holds other bytes than an f32 one of the same ids
    live = frame[(frame["construction"] == "live") & (frame["replica"] == 1) & (frame["item_index"] == 0)]
    assert live["cache_fingerprint"].nunique() == 2


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "llama"])
def test_the_first_suffix_step_is_the_models_next_token(gguf, tmp_path, architecture):
    """llama.cpp reads what the test writer writes (its metadata suffices for llama.cpp's loader) and runs that
    model, fed the boundary state's ids at their positions: its first suffix token is the written transformers
    model's greedy choice after the prefix, and its margin that model's fp32 margin to 1e-4 (both fp32 with f32 KV;
    llama.cpp sums in another order: a few ulps of logits of size 0.1 to 1)."""
    import torch

    path, model = gguf
    if architecture != "qwen2":
        path = tmp_path / f"{architecture}.gguf"
        shape = dict(TINY, head_dim=16) if architecture == "qwen3" else dict(TINY)
        model = write_gguf(path, shape, vocabulary=character_vocabulary(), architecture=architecture,
                           from_model=True).model
    with open_engine(path, "f32") as e:
        for question in QUESTIONS:
            prompt, stage = ids_of(e, question)
            res = e.replay("prefill", prompt, stage, 1)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + stage])).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            assert res.suffix_ids[0] == int(torch.argmax(logits))
            assert abs(res.margins[0] - float(top[0] - top[1])) < 1e-4


def test_a_replica_one_bit_off_stops_the_run(gguf, monkeypatch):
    with open_engine(gguf[0]) as e:
        prompt, stage = ids_of(e, QUESTIONS[0])
        first = e.replay("prefill", prompt, stage, MAX_NEW)
        other = engine.RowResult(first.stage_ids, first.suffix_ids,
                                 [float(np.nextafter(np.float32(first.margins[0]), np.float32(1)))] + first.margins[1:],
                                 first.stop_reason, first.pad, first.position, first.fingerprints)
        assert engine.replica_difference(first, first) is None
        assert engine.replica_difference(first, other) == "margins"
        runs = iter([first, other])
        monkeypatch.setattr(e, "replay", lambda *a, **k: next(runs))
        settings = RunSettings("tiny", "kv_f32", None, MAX_NEW, decode_regime=engine.DECODE_REGIME)
        with pytest.raises(ReplicaMismatchError, match="prefill replicas 1 and 2 at kv_f32 differ in margins"):
            engine.engine_rows(e, item(0), prompt, stage, settings, ("prefill",))


def test_a_sequence_state_of_another_layout_is_refused(gguf):
    with open_engine(gguf[0]) as e:
        prompt, stage = ids_of(e, QUESTIONS[0])
        e.build("prefill", prompt, stage)
        blob = e.sequence_state()
    whole, ks, vs = engine.state_fingerprints(blob)
    assert len(ks) == len(vs) == TINY["num_hidden_layers"] and len(set(ks + vs)) == len(ks + vs)
    for bad in (blob[:-1], blob + b"\0"):
        with pytest.raises(engine.EngineRefusedError, match="not in the layout this reader knows"):
            engine.state_fingerprints(bad)


def test_the_stage_writes_rows_that_its_audit_reproduces_and_the_report_counts(gguf, tmp_path):
    path = gguf[0]
    with open_engine(path) as e:
        ids = [ids_of(e, q) for q in QUESTIONS]
    items = pd.DataFrame([dict(item(i), question=q, source_row=i) for i, q in enumerate(QUESTIONS)])
    write_parquet(items, tmp_path / "items.parquet", {})
    prefixes = pd.DataFrame([{**item(i), "revision": "tiny", "precision": "bf16", "status": "ok",
                              "prompt_ids": p, "stage_ids": s, "prefix_fingerprint": ""}
                             for i, (p, s) in enumerate(ids)])
    write_parquet(prefixes, tmp_path / "prefixes.parquet", {})
    settings = EngineReplaySettings(model=str(path), revision="tiny.gguf", precision="bf16", max_new_tokens=MAX_NEW,
                                    chunk_size=3)
    ledger, audit = tmp_path / "engine_llama_cpp.parquet", tmp_path / "engine_llama_cpp_audit.parquet"
    replay_on_llama_cpp(str(tmp_path / "items.parquet"), str(tmp_path / "prefixes.parquet"), str(ledger), settings)
    frame = read_parquet(ledger)
    assert len(frame) == len(QUESTIONS) * len(engine.KV_TYPES) * len(engine.CONSTRUCTIONS) * 2
    assert set(read_provenance(ledger)["engine_contexts"]) == set(engine.KV_TYPES)
    audit_llama_cpp(str(tmp_path / "items.parquet"), str(tmp_path / "prefixes.parquet"), str(ledger), str(audit),
                    settings)
    assert read_parquet(audit)["reproduced"].all()

    # the report counts what the rows hold: one item's prefill suffix made to differ from its live one
    changed = frame.copy()
    at = (changed["construction"] == "prefill") & (changed["item_index"] == 0) & (changed["precision"] == "kv_f16")
    changed.loc[at, "suffix_ids"] = changed.loc[at, "suffix_ids"].map(lambda ids: list(ids[:2]) + [ids[2] + 1])
    counts = split_counts(changed, None).set_index(["precision", "construction_b"])
    assert counts.loc[("kv_f16", "prefill"), ["k", "n"]].tolist() == [1, 2]
    assert counts.loc[("kv_f32", "prefill"), ["k", "n"]].tolist() == [0, 2]
    changed_path = tmp_path / "changed" / "engine_llama_cpp.parquet"
    changed_path.parent.mkdir()
    write_parquet(changed, changed_path, {}, engine.ENGINE_LEDGER_SCHEMA)
    lines, numbers = engine_section(RevisionData("tiny", {"engine_llama_cpp": str(changed_path)}))
    assert "| llama.cpp | kv_f16 | `live` vs `prefill` | 1 / 2 (50.0%, Wilson [9.5%, 90.5%]) |" in lines
    assert numbers["n_rows"] == len(frame)

    # one margin one bit off in the stored rows: the audit names the row and the column
    tampered = frame.copy()
    tampered.at[0, "margins"] = [float(np.nextafter(np.float32(tampered.at[0, "margins"][0]), np.float32(1)))] + \
        list(tampered.at[0, "margins"][1:])
    write_parquet(tampered, ledger, {}, engine.ENGINE_LEDGER_SCHEMA)
    with pytest.raises(AuditFailedError, match=r"1 ledger row\(s\) did not reproduce:(.|\n)*margins"):
        audit_llama_cpp(str(tmp_path / "items.parquet"), str(tmp_path / "prefixes.parquet"), str(ledger),
                        str(tmp_path / "again.parquet"), settings)


def test_without_the_binding_the_error_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(engine.EngineUnavailableError, match=r'pip install -e "\.\[engines\]"'):
        engine.require_binding()


def test_an_architecture_llama_cpp_cannot_run_is_refused_naming_it(tmp_path):
    path = tmp_path / "other.gguf"
    write_gguf(path, dict(TINY), vocabulary=character_vocabulary(), label="notanarch")
    with pytest.raises(engine.EngineRefusedError, match=r"general\.architecture 'notanarch'.*unknown model "
                                                        r"architecture"):
        open_engine(path)


def test_a_gguf_llama_cpp_refuses_is_named_with_its_reason(gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf[0].read_bytes()[:-4096])
    with pytest.raises(engine.EngineRefusedError, match="refuses .*cut.gguf"):
        open_engine(cut)
    missing = tmp_path / "missing.gguf"
    write_gguf(missing, dict(TINY), vocabulary=character_vocabulary(), skip=("blk.1.attn_q.weight",))
    with pytest.raises(engine.EngineRefusedError, match="blk.1.attn_q.weight"):
        open_engine(missing)


def test_logits_that_are_not_exposed_are_refused_before_any_row(gguf, monkeypatch):
    monkeypatch.setattr(llama_cpp, "llama_get_logits_ith", lambda ctx, i: None)
    with pytest.raises(engine.EngineRefusedError, match="exposes no logits"):
        open_engine(gguf[0])


def test_a_model_that_is_not_a_gguf_file_is_refused_by_the_stage():
    settings = EngineReplaySettings(model="data/toy", revision="primary", precision="bf16", max_new_tokens=4,
                                    base_dir=str(os.path.dirname(os.path.dirname(__file__))))
    with pytest.raises(ValueError, match="replays a GGUF file; revision 'primary' .* is a local model"):
        settings.gguf()


@pytest.mark.parametrize("overrides, message", [
    (dict(engines=["vllm"]), "'vllm' is not one of \\['llama_cpp'\\]"),
    (dict(engines=["llama_cpp"], llama_cpp={"kv_types": ["q8_0"]}), "'q8_0' is not one of"),
    (dict(engines=["llama_cpp"]), "engines: \\['llama_cpp'\\] replay GGUF files, and revision 'primary'"),
], ids=["unknown-engine", "unknown-kv-type", "not-a-gguf"])
def test_the_workflow_refuses_a_bad_engine_config_before_any_work(tmp_path, overrides, message):
    from workflow_runner import snakemake, tiny_config

    tiny_config(tmp_path, **overrides)
    proc = snakemake(tmp_path, "-n", "--no-hooks", check=False)
    assert proc.returncode != 0 and re.search(message, proc.stdout + proc.stderr), proc.stdout + proc.stderr


def test_the_workflow_plans_the_engine_rules_on_a_gguf_and_not_by_default(gguf, tmp_path):
    from workflow_runner import snakemake, tiny_config

    tiny_config(tmp_path, model=str(gguf[0]), revisions=["tiny"], engines=["llama_cpp"])
    planned = snakemake(tmp_path, "-n", "--no-hooks").stdout
    assert "replay_on_llama_cpp" in planned and "audit_llama_cpp" in planned
    tiny_config(tmp_path / "off", model=str(gguf[0]), revisions=["tiny"])
    assert "llama_cpp" not in snakemake(tmp_path / "off", "-n", "--no-hooks").stdout


def test_the_workflow_refuses_engines_without_the_binding_naming_the_install_command(gguf, tmp_path, monkeypatch):
    from workflow_runner import snakemake, tiny_config

    shadow = tmp_path / "shadow" / "llama_cpp"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no llama.cpp here')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shadow.parent), os.environ.get("PYTHONPATH")])))
    tiny_config(tmp_path / "run", model=str(gguf[0]), revisions=["tiny"], engines=["llama_cpp"])
    proc = snakemake(tmp_path / "run", "-n", "--no-hooks", check=False)
    assert proc.returncode != 0 and 'install it with pip install -e ".[engines]"' in proc.stdout + proc.stderr
