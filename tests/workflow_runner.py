"""The one way the tests run the workflow: Snakemake in a subprocess, in a work folder, on a tiny config."""

from __future__ import annotations

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


def tiny_config(workdir, **overrides) -> dict:
    """The default config, cut to a few items and tokens on the CPU, with ``overrides``; written to workdir."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(run="tiny", n_items=6, max_new_tokens=12, device="cpu",
               dataset={"source": "synthetic", "size": 100, "seed": 0}, cache_differences={"n_items": 2})
    cfg.update(overrides)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    (Path(workdir) / "config.yaml").write_text(yaml.safe_dump(cfg))
    return cfg
