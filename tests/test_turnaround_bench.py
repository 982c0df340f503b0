"""bench/turnaround.py: the random GGUF source it writes is a quantised llama.cpp-style Qwen2 file with a
byte-level tokenizer, its configs are ones the workflow accepts, and (slow) its tiny CPU try-out runs the workflow
cold and warm on one model store, the warm run preparing nothing."""

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from bench_scripts import load_bench
from stagereplay.config import schema_file
from stagereplay.testing.gguf import filler_vocabulary

REPO = Path(__file__).resolve().parents[1]
turnaround = load_bench("turnaround")


def test_the_source_is_a_quantised_qwen2_gguf_with_a_byte_level_vocabulary(tmp_path):
    import gguf

    path = tmp_path / "random.gguf"
    info = turnaround.write_random_gguf(path, "tiny", "Q8_0")
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["token_embd.weight"] == types["output.weight"] == "Q8_0"  # untied: output.weight is there
    assert types["blk.1.ffn_down.weight"] == types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["blk.0.attn_q.bias"] == types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    assert len(reader.tensors) == 3 + 2 * 12
    vocabulary = filler_vocabulary(512)
    tokens, kinds = vocabulary.tokens, vocabulary.types
    assert len(tokens) == info["vocab_size"] == 512
    assert "\u0120" in tokens and "\u010a" in tokens and " " not in tokens  # a space is Ġ, a newline Ċ
    assert tokens[-1] == f"~{info['fillers'] - 1}" and info["fillers"] > 400
    assert kinds[tokens.index("<|im_end|>")] == gguf.TokenType.CONTROL
    field = reader.get_field("tokenizer.ggml.pre")
    assert bytes(field.parts[field.data[0]]).decode() == "qwen2"
    assert info["tensor_types"]["2-D weights"] == "Q8_0" and "random" in info["weights"]


def test_the_configs_name_the_gguf_file_and_the_shared_store(tmp_path):
    args = argparse.Namespace(items=48, stage=256, suffix=128, precisions=["bf16", "fp32"], shards=1,
                              numerics="default", batch_size=16, regime="cuda_graph", transplant_select=None,
                              minimal_budget=None, device="cuda")
    gguf_file = tmp_path / "model" / "x.gguf"
    cold = yaml.safe_load(turnaround.run_config(tmp_path, args, gguf_file, "cold").read_text())
    warm = yaml.safe_load(turnaround.run_config(tmp_path, args, gguf_file, "warm").read_text())
    validate(copy.deepcopy(cold), schema_file(), set_default=True)
    assert cold["model"] == str(gguf_file) and cold["model_store"] == str(tmp_path / "store")
    assert cold["boundary"] == {"marker": "~", "occurrence": 256} and cold["batch_size"] == 16
    assert (cold["run"], warm["run"]) == ("cold", "warm")
    assert {k: v for k, v in cold.items() if k != "run"} == {k: v for k, v in warm.items() if k != "run"}


@pytest.mark.slow
def test_the_tiny_try_out_runs_cold_then_warm_and_the_warm_run_prepares_nothing(tmp_path):
    work = tmp_path / "ta"
    proc = subprocess.run([sys.executable, str(REPO / "bench/turnaround.py"), "--work", str(work), "--shape", "tiny",
                           "--device", "cpu", "--items", "2", "--stage", "8", "--suffix", "4", "--precisions", "bf16"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads((work / "turnaround.json").read_text())
    assert report["status"] == "complete" and "random" in report["weights"]
    assert {"date", "device", "versions", "source", "config"} <= report.keys()
    assert report["versions"]["gguf"] and report["versions"]["transformers"]
    check = report["source"]["check"]
    assert check["loads"] and check["unknown_characters"] == [] and not check["tied_embeddings"]
    assert report["source"]["tensor_types"]["2-D weights"] == "Q8_0"
    cold, warm = report["runs"]["cold"], report["runs"]["warm"]
    for run in (cold, warm):
        assert run["status"] == "complete" and run["wall_s"] > 0
        assert "prepare_model" in run["rules"] and run["rules"]["prepare_model"]["jobs"] == 1
        assert all(j["job"].startswith(("cold/", "warm/")) for j in run["job_times"])
        assert {j["rule"] for j in run["log_jobs"]} >= {"prepare_model", "generate_fixed_prefix", "audit_ledger"}
        assert all(0 <= j["start_s"] <= j["end_s"] for j in run["log_jobs"])
        assert "gpu" in run and run["ledger"]["items_at_boundary"] >= 1  # the random model reached the boundary
    assert {j["job"].split("/")[0] for j in cold["job_times"]} == {"cold"}
    assert {j["job"].split("/")[0] for j in warm["job_times"]} == {"warm"}
    # the cold run found an empty store and converted the GGUF file; the warm run found its entry there
    cold_log = (work / "logs/cold/local/prepare_model.log").read_text()
    warm_log = (work / "logs/warm/local/prepare_model.log").read_text()
    assert "already in the store" not in cold_log and "prepared now" in cold_log
    assert "already in the store" in warm_log and "prepared now" not in warm_log
    assert cold["prepare_model"]["prepared_now"] and not cold["prepare_model"]["already_in_store"]
    assert warm["prepare_model"]["already_in_store"] and not warm["prepare_model"]["prepared_now"]
    assert cold["store_before"] == [] and len(cold["store_after"]) == 1  # one precision, one entry
    assert warm["store_before"] == warm["store_after"] == cold["store_after"]  # nothing new prepared
    cold_keys = {p: s["key"] for p, s in cold["prepare_model"]["record"]["snapshots"].items()}
    assert cold_keys == {p: s["key"] for p, s in warm["prepare_model"]["record"]["snapshots"].items()}
    # no conversion in the warm run: its prepare_model job spent a small part of the cold one's CPU time (the
    # cold one imports torch and converts; the warm one only checks the entry by stat)
    assert warm["rules"]["prepare_model"]["cpu_s"] < 0.5 * cold["rules"]["prepare_model"]["cpu_s"]
    ratios = report["warm_over_cold"]
    assert ratios["wall"] is not None and ratios["prepare_model"]["ratio_cpu_s"] < 0.5
    # the warm run's inputs are the cold run's (the snapshots made since cannot change the verdict): not read again
    assert "not read again" in warm["preflight"] and "not read again" not in cold["preflight"]
