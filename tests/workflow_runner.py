"""The one way the tests run the workflow: Snakemake in a subprocess, in a work folder, on a tiny config."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def snakemake_command(workdir, *args, configfile=None) -> list[str]:
    """The command line: this repository's Snakefile, run in ``workdir`` on ``configfile`` (its config.yaml)."""
    return [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
            "--configfile", str(configfile or Path(workdir) / "config.yaml"), *args]


def snakemake(workdir, *args, check=True, configfile=None) -> subprocess.CompletedProcess:
    """Run the workflow; with ``check`` a failure raises with the end of its output."""
    proc = subprocess.run(snakemake_command(workdir, *args, configfile=configfile), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


# The tiny runs test the workflow's mechanics and cut the stage at the first ';' (about 9 stage tokens, not the
# default's 17); the effect itself is the default run's, and tests that need divergent items ask
# tests/toy_divergence.py, at the default config's boundary (its DEFAULT_BOUNDARY).
TINY_BOUNDARY = {"marker": ";", "occurrence": 1}


def tiny_config(workdir, **overrides) -> dict:
    """The default config, cut to a few items and tokens on the CPU, with ``overrides``; written to workdir."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(run="tiny", n_items=6, max_new_tokens=12, device="cpu", boundary=TINY_BOUNDARY,
               dataset={"source": "synthetic", "size": 100, "seed": 0}, cache_differences={"n_items": 2})
    cfg.update(overrides)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    (Path(workdir) / "config.yaml").write_text(yaml.safe_dump(cfg))
    return cfg


# The one tiny run that several test files read (the controls, the transplants): four items at both precisions, a
# three-row bridge, every item's caches dumped, transplants of two sampled items in two sweeps.
SHARED_TINY = dict(n_items=4, max_new_tokens=8, precisions=["bf16", "fp32"], reference_precision="bf16",
                   bridge={"n_rows": 3, "seed": 0}, transplant={"select": "sample:2", "sweeps": ["all", "k_only"]},
                   dump={"items": "all"})


def shared_run(tmp_path_factory, name, overrides) -> Path:
    """A completed run (every target, ``--cores 2``) of ``tiny_config(**overrides)``, made once per pytest run and
    read by every test that asks for ``name``: under pytest-xdist the workers share it (the first to ask runs it, a
    lock holds the others until it is done). Its readers must not change it: a test that reruns copies it first."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder above the workers' own: one per pytest run
    workdir = root / f"shared_{name}"
    with open(root / f"shared_{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / f"shared_{name}.done"
        if not done.exists():
            shutil.rmtree(workdir, ignore_errors=True)  # what a failed attempt left
            tiny_config(workdir, **overrides)
            snakemake(workdir, "--cores", "2")
            done.write_text("done\n")
    return workdir
