"""Tiny models built in code: a few-layer random Qwen2 with the toy's character tokenizer."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# The test processes of one pytest run (every xdist worker) and the workflows they run share one model store of their
# own, never the user's (~/.cache/stagereplay/models): runs compared byte for byte record the same store entries in
# their provenance wherever a worker ran them. A test that needs an empty store names its own.
RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
os.environ.setdefault("STAGEREPLAY_MODEL_STORE", os.path.join(tempfile.gettempdir(), f"stagereplay-test-store-{RUN_ID}"))
# ... and job servers of their own (configs with job_server: true), never the user's.
os.environ.setdefault("STAGEREPLAY_JOB_SERVER_DIR", os.path.join(tempfile.gettempdir(), f"stagereplay-test-jobs-{RUN_ID}"))

# The slowest test files, longest first (as measured under two xdist workers). With --dist loadfile and
# --no-loadscope-reorder (pyproject.toml) the workers take files in collection order, so these start first and the
# many short files fill in behind them: no long file starts last and keeps one worker busy while the other idles.
# (xdist's own reordering, by number of tests per file, would send these one-test files last.)
SLOWEST_FIRST = ["test_cluster_executor.py", "test_batched_workflow.py", "test_invariant_triton.py",
                 "test_workflow.py", "test_turnaround_bench.py", "test_replay_constructions_workflow.py", "test_controls_workflow.py",
                 "test_divergence_location_workflow.py",
                 "test_crash.py", "test_results_safety.py", "test_transplant_workflow.py", "test_compare.py",
                 "test_sharding.py",
                 "test_bad_inputs.py", "test_input_fingerprints.py", "test_readme_commands.py"]


def pytest_sessionfinish(session, exitstatus):
    """The job servers this process's workflows started exit with it, not after their idle time (under xdist a
    worker that finishes first may stop a server another worker's run still uses: that run's next jobs start in
    their own processes, or start a server again)."""
    from stagereplay.runtime.hand_over import stop_servers

    stop_servers(os.environ["STAGEREPLAY_JOB_SERVER_DIR"])


def pytest_collection_modifyitems(config, items):
    """The files of SLOWEST_FIRST first, in its order; every other file after them, in collection order."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def make_tiny_model(folder: Path, seed: int = 0, layers: int = 3, vocab_extra: int = 0) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stagereplay.data.toy import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tokenizer) + vocab_extra, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0,
                      bos_token_id=None)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # biases start at zero and norms at one: randomise them so they are exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def loaded_fp32(tiny_model_dir):
    from stagereplay.models.loading import load_model, set_determinism
    from stagereplay.models.sources import ModelSource

    set_determinism(1)
    return load_model(ModelSource("local", str(tiny_model_dir)), "fp32", "cpu")


@pytest.fixture(scope="module")
def fp32_model(tiny_model_dir):
    """The tiny model as a user of the library brings it: transformers' own loading, fp32, with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def loaded_bf16(tiny_model_dir):
    from stagereplay.models.loading import load_model, set_determinism
    from stagereplay.models.sources import ModelSource

    set_determinism(1)
    return load_model(ModelSource("local", str(tiny_model_dir)), "bf16", "cpu")


@pytest.fixture(scope="session")
def shared_tiny_run(tmp_path_factory) -> Path:
    """The completed run of workflow_runner.SHARED_TINY, shared by the test files (and xdist workers) that read it."""
    from workflow_runner import SHARED_TINY, shared_run

    return shared_run(tmp_path_factory, "tiny", SHARED_TINY)
