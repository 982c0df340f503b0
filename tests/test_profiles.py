"""The cluster profiles: the cluster-specific part only, partition and account left to the user, and no job
server (each submitted job runs on a node of its own)."""

from pathlib import Path

import pytest
import yaml
from workflow_runner import snakemake

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "profiles/slurm"


@pytest.mark.parametrize("name", ["slurm", "cluster-generic"])
def test_profile_turns_the_job_server_off(name):
    """The server is on by default (the schema's default); a profile's jobs run on other nodes, where a server
    would be started by each job and used by none. Snakemake reads the profile's entry as the boolean false."""
    from snakemake.cli import parse_config

    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    assert schema["properties"]["job_server"]["default"] is True
    profile = yaml.safe_load((REPO / "profiles" / name / "config.yaml").read_text())
    assert parse_config(profile["config"])["job_server"] is False


def test_profile_leaves_partition_and_account_to_the_user():
    profile = yaml.safe_load((PROFILE / "config.yaml").read_text())
    assert profile["executor"] == "slurm"
    flat = yaml.safe_dump(profile)
    assert "slurm_partition" not in flat and "slurm_account" not in flat  # only as comments
    assert profile["set-resources"]["reconstruct_prefixes"]["gpu"] == 1
    assert "# - slurm_account=" in (PROFILE / "config.yaml").read_text()


@pytest.mark.slow
def test_profile_plans_the_example_with_one_gpu_per_generation_job(tmp_path):
    pytest.importorskip("snakemake_executor_plugin_slurm")
    proc = snakemake(tmp_path, "--profile", str(PROFILE), "--dry-run", check=False,
                     configfile=REPO / "config/r1-distill-qwen-1.5b-gsm8k.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.split("rule reconstruct_prefixes:")[1].split("rule ")[0]
    assert "gpu=1" in job and "mem_mb=16000" in job and "runtime=720" in job
