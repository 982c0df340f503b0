"""The workflow's model jobs, read from Snakemake's own DAG of a config: the only list of jobs the projection has.

``model_dag(config)`` plans the workflow (this checkout's ``Snakefile``) on the config through Snakemake's API, as
``snakemake --forceall`` would, in a temporary folder (so no result of an earlier run hides a job), and keeps the
model jobs: the jobs of every rule that declares a ``gpu`` resource (what ``--resources gpu=N`` limits). Of each it
keeps the rule, the wildcards (revision, precision, shard), the threads and resources, the precisions its
``params.snapshots`` names (what it may load) and the model jobs it waits for through the jobs that load no model
(the gathers, the selections). Nothing is run and no hook is called, so the preflight's checks of the model and
the data (``workflow/rules/common/preflight.smk``) are not made; the config's own checks (``config.smk``) are.

The model is not read: the config's ``model`` is replaced by a path that does not exist, so that planning takes
no fingerprint of the weights (a fingerprint only names the snapshots' store keys, which the projection does not
read; the workflow leaves them unknown where a source does not resolve). The jobs depend on the config alone; the
workflow has no checkpoint, so the DAG is whole before any job runs.

What the DAG cannot know is what a job finds in its inputs: which precisions of a dump or an onset have items,
whether a search has a divergent item to search. :mod:`.jobs` counts that from the run's shape.
"""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

SNAKEFILE = Path(__file__).resolve().parents[3] / "Snakefile"
MODEL_STAND_IN = "model-not-read"  # under the temporary folder, never made: the planned fingerprints stay unknown


@dataclass(frozen=True)
class DagJob:
    """One model job of the DAG."""

    rule: str
    wildcards: tuple  # ((name, value), ...) as the DAG's job has them
    threads: int
    resources: tuple  # ((name, value), ...): the rule's declared resources, evaluated for this job
    loads: tuple  # precisions the job may load (its params.snapshots), in the rule's order
    after: frozenset  # the model jobs it waits for (``key``), through the jobs that load no model

    @property
    def key(self) -> tuple:
        return (self.rule, self.wildcards)

    def wildcard(self, name: str, default=None):
        return dict(self.wildcards).get(name, default)


def model_dag(config: dict) -> list[DagJob]:
    """The model jobs of ``config``'s DAG (a copy is planned; the config is not changed), in the DAG's order."""
    return list(_planned(json.dumps(config, sort_keys=True, default=str)))


@functools.lru_cache(maxsize=32)
def _planned(config_json: str) -> tuple:
    config = json.loads(config_json)
    with tempfile.TemporaryDirectory(prefix="stagereplay-dag-") as folder:
        work = Path(folder)
        config["model"] = str(work / MODEL_STAND_IN)
        path = work / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        return tuple(planned_jobs(path, work))


def planned_jobs(configfile: Path, workdir: Path) -> list[DagJob]:
    """Plan the workflow on ``configfile`` in ``workdir`` through Snakemake's API (every job, as ``--forceall``),
    and read its model jobs off the DAG."""
    from snakemake.api import ConfigSettings, DAGSettings, OutputSettings, ResourceSettings, SnakemakeApi
    from snakemake.settings.enums import Quietness

    output = OutputSettings(quiet={Quietness.ALL}, enable_file_logging=False)
    with SnakemakeApi(output) as api:
        workflow_api = api.workflow(ResourceSettings(cores=1024), ConfigSettings(configfiles=[configfile]),
                                    snakefile=SNAKEFILE, workdir=workdir)
        workflow_api.dag(DAGSettings(forceall=True))
        # the API builds a DAG only to run, print or summarise it; this is what its printdag does before printing
        workflow = workflow_api._workflow
        workflow._prepare_dag(forceall=True, ignore_incomplete=True, lock_warn_only=True)
        workflow._build_dag()
        return read_jobs(workflow.dag)


def is_model_job(job) -> bool:
    return "gpu" in job.rule.resources


def read_jobs(dag) -> list[DagJob]:
    """The model jobs of a built Snakemake DAG, each with the model jobs it waits for."""
    upstream = {}

    def models_before(job) -> frozenset:
        if job not in upstream:
            found = set()
            for before in dag.dependencies[job]:
                found |= {before} if is_model_job(before) else models_before(before)
            upstream[job] = frozenset(found)
        return upstream[job]

    out = []
    for job in dag.jobs:
        if not is_model_job(job):
            continue
        declared = [name for name in job.rule.resources if not name.startswith("_") and name != "tmpdir"]
        out.append(DagJob(job.rule.name, tuple(job.wildcards_dict.items()), job.threads,
                          tuple((name, job.resources.get(name)) for name in declared),
                          tuple(job.params.get("snapshots") or ()),
                          frozenset((j.rule.name, tuple(j.wildcards_dict.items())) for j in models_before(job))))
    return out
