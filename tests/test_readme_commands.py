"""Every command the README documents for a CPU machine runs in the suite: each is mapped here to the test that
runs it (a README command with no entry fails the inventory test), and the ones no other test runs are run here."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workflow_runner import snakemake, tiny_config

REPO = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:snakemake|bash scripts/|stagereplay-store|python -m pytest|sha256sum|pip )")

# README command, exactly as written (or its first words, where the key ends in a space) -> the test that runs it,
# as "file::function".
RUN_BY = {
    "pip install ": "the suite's own installation (.ci/run)",
    "python -m pytest -q": "the suite itself",
    "snakemake --cores all": "test_workflow.py::test_default_workflow_end_to_end",
    "snakemake -n": "test_workflow.py::test_default_workflow_end_to_end",
    "snakemake --cores all --config 'transplant={revisions: [primary, later]}'":
        "test_transplant_workflow.py::test_transplant_stage_reruns_alone_and_at_a_later_revision",
    "snakemake --report report.html":
        "test_transplant_workflow.py::test_transplant_stage_reruns_alone_and_at_a_later_revision",
    "stagereplay-store ": "test_model_store.py::test_the_command_lists_and_removes_entries",
    "snakemake --unlock": "test_crash.py::test_killed_in_the_middle_of_generation_then_rerun_incomplete",
    "snakemake --cores all --rerun-incomplete":
        "test_crash.py::test_killed_in_the_middle_of_generation_then_rerun_incomplete",
    "sha256sum -c": "test_results_safety.py::test_every_atomic_write_records_the_sha256_of_its_bytes",
    "SHAPE=tiny bash scripts/multigpu_demo.sh": "test_readme_commands.py::test_the_multigpu_demo_runs_on_the_cpu",
    "snakemake --cores all --config numerics=invariant run=invariant":
        "test_compare.py::test_the_readme_command_compares_two_runs_naming_the_one_factor_that_differs",
    "snakemake --cores 1 compare --configfile config/compare-example.yaml":
        "test_compare.py::test_the_readme_command_compares_two_runs_naming_the_one_factor_that_differs",
    "snakemake --cores 2 results/toy_training/primary/fingerprint_check.json":
        "test_readme_commands.py::test_the_toy_retrain_target_plans_and_training_is_bit_reproducible",
}
# Commands for a GPU machine or a cluster: not run here (their CPU stand-ins are above).
NEEDS_A_GPU_OR_CLUSTER = ("snakemake --cores C --resources gpu=N", "snakemake --cores 16 --resources gpu=4 ",
                          "snakemake --cores 4 --resources gpu=1 ",
                          "snakemake --profile profiles/slurm ", "bash scripts/multigpu_demo.sh")


def readme_commands() -> list[str]:
    """Every shell command of the README: lines of its bash blocks and inline code spans that start like one."""
    text = (REPO / "README.md").read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        found += [line.split("  #")[0].strip() for line in block.splitlines() if line and not line.startswith("#")]
    spans = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    found += [" ".join(span.split()) for span in spans]  # a span wrapped over two lines is one command
    commands = []
    for command in found:
        for part in command.split(" && "):
            if COMMAND.match(part.strip()):
                commands.append(part.strip())
    return commands


def test_every_readme_command_is_run_by_a_named_test():
    commands = readme_commands()
    assert any(c.startswith("SHAPE=tiny bash scripts/multigpu_demo.sh") for c in commands)  # the parser finds them
    known = (*RUN_BY, *NEEDS_A_GPU_OR_CLUSTER)
    unmapped = [c for c in commands if not any(c == k or (k.endswith(" ") and c.startswith(k)) for k in known)]
    assert not unmapped, f"README commands that no test runs: {unmapped}"
    for where in RUN_BY.values():
        if "::" in where:
            file, function = where.split("::")
            assert f"def {function}(" in (REPO / "tests" / file).read_text(), where


@pytest.mark.slow
def test_the_multigpu_demo_runs_on_the_cpu(tmp_path):
    env = {**os.environ, "SHAPE": "tiny", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(["bash", str(REPO / "scripts/multigpu_demo.sh"), str(tmp_path / "demo")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for shard in (0, 1):
        assert re.search(rf"^shard {shard}: .* 4 items, 16 ledger rows, statuses \{{'ok': 16\}}", proc.stdout, re.M)
    assert "nothing to allocate" in proc.stdout or "OK: each running job had a GPU of its own" in proc.stdout


@pytest.mark.slow
def test_the_toy_retrain_target_plans_and_training_is_bit_reproducible(tmp_path):
    # The documented retrain itself takes several CPU-minutes per revision (README): here its target plans, and a
    # short training of the same code gives the same bytes twice; the check's verdicts are test_toy_training.py's.
    from stagereplay.data.toy import ToyTrainingSpec, train_toy

    tiny_config(tmp_path)
    proc = snakemake(tmp_path, "-n", "results/toy_training/primary/fingerprint_check.json", "--no-hooks",
                     "--quiet", "rules")
    assert re.search(r"^train_toy_model\s+1$", proc.stdout, re.M), proc.stdout
    spec = ToyTrainingSpec(steps=3, batch_size=4, warmup=1, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1)
    first = train_toy(tmp_path / "a", spec, progress=False)
    second = train_toy(tmp_path / "b", spec, progress=False)
    digest = hashlib.sha256((tmp_path / "a/model.safetensors").read_bytes()).hexdigest()
    assert first["model_safetensors_sha256"] == second["model_safetensors_sha256"] == digest
    assert first["cpu_capability"] == second["cpu_capability"] != ""


def readme_library_example() -> str:
    """The Python block of the README's "As a library" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## As a library\n", 1)[1].split("\n## ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_the_library_example_runs_on_the_toy_model():
    proc = subprocess.run([sys.executable, "-c", readme_library_example()], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines[:2]] == ["live", "prefill"]
    assert all("exact replicas: True cache " in line for line in lines[:2])
    # with every layer's K/V the live cache holds prefill's whole boundary state: it must continue as prefill does
    live_text, prefill_text = (re.search(r"^\w+ +('.*') exact", line).group(1) for line in lines[:2])
    outcome = "agree" if live_text == prefill_text else "donor"  # agree: donor and recipient continue alike
    assert lines[-1] == f"prefill K/V in the live cache: {outcome} {prefill_text}"
