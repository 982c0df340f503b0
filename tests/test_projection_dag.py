"""The projection's jobs are the workflow's: Snakemake's own DAG of the config (stagereplay.projection.dag), each
model job priced by its rule (projection.jobs.WORK); a model rule the projection does not count is refused."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from stagereplay.projection.dag import model_dag
from stagereplay.projection.jobs import NOT_PRICED, WORK, UnpricedRuleError, model_jobs
from stagereplay.projection.shape import config_run, load_config, run_shape

REPO = Path(__file__).resolve().parents[1]
KV = {"bf16": 1e-6, "fp32": 2e-6}
SMALL = {"run": "small", "n_items": 8, "model": "/nonexistent", "revisions": ["local"], "precisions": ["bf16", "fp32"],
         "max_stage_tokens": 24, "max_new_tokens": 8, "batch_size": 4, "decode_regime": "static", "gpus_per_job": 1,
         "fidelity": {"constructions": []}}


def _shape(tmp_path, overrides=(), config=SMALL):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return run_shape(config_run(load_config(str(path), list(overrides)), 10, 20, 8, {"bf16": 1.0, "fp32": 0.0}, 28))


def _keys(jobs):
    return sorted((job.rule, dict(job.wildcards).get("precision"), dict(job.wildcards).get("shard"))
                  for job in jobs)


def test_the_projected_jobs_are_the_model_jobs_of_the_workflow_s_dag(tmp_path):
    """Every model job of the DAG is projected, and no other: a rule's jobs per precision and shard as the DAG has
    them, the controls the workflow leaves out (batch invariance at batch 1) left out too."""
    for overrides in ([], ["shards=2"], ["batch_size=1"], ["fidelity.constructions=[prefill]", "shards=3"]):
        shape = _shape(tmp_path, overrides)
        planned = model_dag(shape.config)
        projected = model_jobs(shape, KV)
        assert projected
        assert _keys(planned) == sorted((j.rule, j.precision, str(j.shard)) for j in projected), overrides
        assert len({j.name for j in projected}) == len(projected)  # the scheduler's names: one a job
    assert "check_batch_invariance" not in {j.rule for j in model_jobs(_shape(tmp_path, ["batch_size=1"]), KV)}
    assert "measure_fidelity" not in {j.rule for j in model_jobs(_shape(tmp_path), KV)}  # no constructions


def test_the_dag_is_planned_from_the_config_alone():
    """No model and no data are read: the paper-scale config's model is a hub id never downloaded here, and the
    config given is left as it was."""
    config = load_config(str(REPO / "config/paper-scale-14b.yaml"), ["shards=2"])
    before = yaml.safe_dump(config)
    planned = model_dag(config)
    assert yaml.safe_dump(config) == before
    assert len(planned) == 2 * 14
    ledger = {job.key for job in planned if job.rule in ("reconstruct_prefixes", "generate_fixed_prefix")}
    audit = next(job for job in planned if job.rule == "audit_ledger")
    assert audit.after == ledger  # the audit reads the ledger that gather_ledger joins from every ledger job
    assert dict(audit.resources)["gpu"] == 1 and audit.threads == config["threads"]


def test_a_model_rule_the_projection_does_not_count_is_refused(tmp_path):
    """A rule with a gpu resource that WORK does not price stops the projection, naming it; one known and left out
    (NOT_PRICED) is noted in the report."""
    shape = _shape(tmp_path)
    planned = model_dag(shape.config)
    new = dataclasses.replace(planned[0], rule="measure_something_new")
    with pytest.raises(UnpricedRuleError, match="measure_something_new"):
        model_jobs(shape, KV, planned=[*planned, new])
    assert len(model_jobs(shape, KV, planned=planned)) == len(planned)
    other = _shape(tmp_path, ["transplant.revisions=[local, other]"])
    jobs = model_jobs(other, KV)
    assert "replay_fixed_prefixes" not in {j.rule for j in jobs}
    assert any(note.startswith("replay_fixed_prefixes: 1 model job") for note in other.warnings)
    assert {j.name for j in jobs if j.rule == "transplant_caches"} == {"transplant_caches_local",
                                                                      "transplant_caches_other"}


def test_every_rule_with_a_gpu_resource_is_priced_or_named_as_not_priced():
    """The rules of workflow/rules/*.smk that claim a GPU, whatever config puts them in the DAG."""
    claiming = set()
    for path in sorted((REPO / "workflow/rules").glob("*.smk")):
        for block in re.split(r"^(?=rule |checkpoint )", path.read_text(), flags=re.M):
            name = re.match(r"(?:rule|checkpoint) (\w+):", block)
            if name and re.search(r"^\s+gpu=", block, re.M):
                claiming.add(name.group(1))
    assert "reconstruct_prefixes" in claiming and "replay_on_engine" in claiming
    assert claiming == set(WORK) | set(NOT_PRICED)
