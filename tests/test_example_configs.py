"""The example configs under config/ (real models on a GPU node) validate and plan; they cannot run here."""

import re
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from stagereplay.config import schema_file
from stagereplay.models.sources import resolve_source
from workflow_runner import snakemake

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "config").glob("*.yaml"))
SCHEMA = schema_file()  # the schema the workflow validates with


def test_there_are_r1_distill_examples():
    names = [p.name for p in EXAMPLES]
    assert "r1-distill-qwen-1.5b-gsm8k.yaml" in names and "r1-distill-qwen-7b-gsm8k.yaml" in names


GGUF_EXAMPLE = REPO / "config/gguf-local-file.yaml"
COMPARE_EXAMPLE = REPO / "config/compare-example.yaml"  # runs by test_compare.py
HUB_EXAMPLES = [p for p in EXAMPLES if p not in (GGUF_EXAMPLE, COMPARE_EXAMPLE)]


@pytest.mark.parametrize("path", HUB_EXAMPLES, ids=lambda p: p.name)
def test_example_validates_against_the_schema(path, tmp_path):
    cfg = yaml.safe_load(path.read_text())
    validate(cfg, SCHEMA, set_default=True)
    assert cfg["boundary"] == {"marker": "</think>", "occurrence": 1, "token_id": None}
    source = resolve_source(cfg["model"], cfg["revisions"][0], base_dir=tmp_path)
    assert source.kind == "hub" and source.path.startswith("deepseek-ai/DeepSeek-R1-Distill-Qwen-")
    assert cfg["dataset"]["source"] in ("hf", "jsonl") and cfg["answer_format"] == "boxed"
    assert cfg["gpus_per_job"] == 1 and cfg["device"] in ("auto", "cuda")
    assert cfg["job_server"] is True  # the default: a GPU node's model jobs start warm


def test_the_one_gpu_example_uses_the_fast_regime_and_its_command_fits_one_gpu():
    path = REPO / "config/r1-distill-qwen-1.5b-one-gpu.yaml"
    cfg = yaml.safe_load(path.read_text())
    assert cfg["decode_regime"] == "cuda_graph" and cfg["gpus_per_job"] == 1 and cfg["device"] == "cuda"
    cores = re.search(r"snakemake --cores (\d+) --resources gpu=1 ", path.read_text())
    assert cores and int(cores.group(1)) >= cfg["threads"]


def test_the_gguf_example_names_one_file_and_one_revision(tmp_path):
    from gguf_fixture import write_tiny_gguf

    cfg = yaml.safe_load(GGUF_EXAMPLE.read_text())
    validate(cfg, SCHEMA, set_default=True)
    (tmp_path / Path(cfg["model"]).parent).mkdir(parents=True)
    write_tiny_gguf(tmp_path / cfg["model"])
    assert cfg["model"].endswith(".gguf") and len(cfg["revisions"]) == 1
    source = resolve_source(cfg["model"], cfg["revisions"][0], base_dir=tmp_path)
    assert source.kind == "gguf" and source.gguf_file == Path(cfg["model"]).name


@pytest.mark.parametrize("path", [p for p in EXAMPLES if "--resources gpu=4" in p.read_text()], ids=lambda p: p.name)
def test_a_multi_gpu_command_has_cores_for_every_gpu_job_at_once(path):
    cfg = yaml.safe_load(path.read_text())
    cores, gpus = map(int, re.search(r"snakemake --cores (\d+) --resources gpu=(\d+)", path.read_text()).groups())
    assert cores >= gpus * cfg["threads"]  # else the jobs, each claiming `threads` cores, run one at a time


@pytest.mark.slow
@pytest.mark.parametrize("path", HUB_EXAMPLES, ids=lambda p: p.name)
def test_example_plans_one_job_per_shard_and_precision(path, tmp_path):
    cfg = yaml.safe_load(path.read_text())
    # --no-hooks: the examples name hub models and datasets that are not on this machine, which the dry run's
    # preflight would (rightly) refuse; this test is about the plan
    proc = snakemake(tmp_path, "--dry-run", "--no-hooks", "--quiet", "rules", check=False, configfile=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", proc.stdout, re.M))
    assert int(counts["reconstruct_prefixes"]) == cfg["shards"] * len(cfg["precisions"])
    assert int(counts["gather_ledger"]) == 1 and int(counts["select_items"]) == 1
