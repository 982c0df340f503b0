"""The example configs under config/ (real models on a GPU node) validate and plan; they cannot run here."""

import re
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from stagereplay.models.sources import resolve_source
from workflow_runner import snakemake

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "config").glob("*.yaml"))
SCHEMA = str(REPO / "workflow/schemas/config.schema.yaml")


def test_there_are_r1_distill_examples():
    names = [p.name for p in EXAMPLES]
    assert "r1-distill-qwen-1.5b-gsm8k.yaml" in names and "r1-distill-qwen-7b-gsm8k.yaml" in names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_against_the_schema(path, tmp_path):
    cfg = yaml.safe_load(path.read_text())
    validate(cfg, SCHEMA, set_default=True)
    assert cfg["boundary"] == {"marker": "</think>", "occurrence": 1, "token_id": None}
    source = resolve_source(cfg["model"], cfg["revisions"][0], base_dir=tmp_path)
    assert source.kind == "hub" and source.path.startswith("deepseek-ai/DeepSeek-R1-Distill-Qwen-")
    assert cfg["dataset"]["source"] in ("hf", "jsonl") and cfg["answer_format"] == "boxed"
    assert cfg["gpus_per_job"] == 1 and cfg["device"] == "auto"


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_plans_one_job_per_shard_and_precision(path, tmp_path):
    cfg = yaml.safe_load(path.read_text())
    # --no-hooks: the examples name hub models and datasets that are not on this machine, which the dry run's
    # preflight would (rightly) refuse; this test is about the plan
    proc = snakemake(tmp_path, "--dry-run", "--no-hooks", "--quiet", "rules", check=False, configfile=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", proc.stdout, re.M))
    assert int(counts["reconstruct_prefixes"]) == cfg["shards"] * len(cfg["precisions"])
    assert int(counts["gather_ledger"]) == 1 and int(counts["select_items"]) == 1
