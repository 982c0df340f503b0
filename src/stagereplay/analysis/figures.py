"""The paper figures, as PDF and PNG, from the tidy tables of :mod:`stagereplay.analysis.tables`.

The figures are the catalogue's (:data:`stagereplay.catalogue.FIGURES`: name, title, caption, inputs and plotter,
in the order that numbers them): (1) suffix disagreement per construction x precision cell, (2) first-divergence
positions, (3) top-2 margins at the first divergence against the same item's other steps, (4) per-layer differences
between constructions' boundary caches, (5) the transplant outcome matrix, (6) paired accuracy differences with their
CIs, (7) how often each part of the cache is in a minimal sufficient transplant, (8) the growth of the cache
difference with depth in divergent items and the margin at the divergence against the last layer's difference, (9)
the per-step KL divergence from live along the suffix, (10) what is associated with a split: items' live margin
against the logit difference at the first suffix step, and the share of items split by each suffix position.
A figure whose input is absent or empty is still written, saying which input it waits for, so the pipeline never
stops on a stage that has not run.

This module reads the results files into each figure's table (:func:`tables`: a figure that draws its one input file
as read needs no entry there) and hands each table to its figure's plotter (:data:`PLOTTERS`, imported from the
catalogue's dotted paths); it draws nothing itself. The figures drawn from the ledger (1, 2, 3, 6) live in
:mod:`stagereplay.analysis.ledger_figures`, those of the caches (4, 5, 7, 8) in
:mod:`stagereplay.analysis.cache_figures`, those of fidelity (9, 10) in :mod:`stagereplay.analysis.fidelity_figures`,
all in the one style of :mod:`stagereplay.analysis.figure_style`: no title or figure number drawn into the image,
the captions (:mod:`stagereplay.analysis.captions`) go beside it, in the report and in ``workflow/report/*.rst``.

This module knows nothing of torch or Snakemake: :func:`plot_figures` takes paths, the figure functions take
DataFrames.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pandas as pd

from stagereplay import catalogue
from stagereplay.analysis import captions
from stagereplay.analysis import tables as analysis
from stagereplay.analysis.divergence_location import minimal_coverage
from stagereplay.analysis.fidelity import items_of_files
from stagereplay.analysis.inputs import merge_inputs
from stagereplay.io.parquet import read_parquet

FIGURES = {name: title for name, (title, _) in captions.CAPTIONS.items()}
FORMATS = ("pdf", "png")


def _read_all(paths: dict[str, str] | None) -> pd.DataFrame | None:
    """Concatenate the existing files of one kind (revision -> path, in the config's order); None when none exists."""
    frames = [read_parquet(p) for p in (paths or {}).values() if p and Path(p).is_file()]
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else None


def tables(inputs: dict[str, dict[str, str]], seed: int = 0) -> dict[str, pd.DataFrame | None]:
    """The figures' tables from ``inputs`` (kind -> revision -> path; absent kinds and files are fine), and under
    ``"coinciding"`` the fixed-prefix cells that repeat the matched ones."""
    ledger = _read_all(inputs.get("ledger"))
    pairs = analysis.all_pairs(ledger) if ledger is not None else None
    coinciding = analysis.coinciding_comparisons(ledger)
    skip = {(revision, "fixed_prefix", precision) for revision, precision in coinciding}
    differences = _read_all(inputs.get("cache_differences"))
    transplant = _read_all(inputs.get("transplant"))
    built = {
        "fig1_disagreement": analysis.disagreement_cells(pairs) if pairs is not None else None,
        "fig2_first_divergence": pairs,
        "fig3_margins": analysis.margin_pairs(ledger, pairs, skip=skip) if pairs is not None else None,
        "fig4_cache_differences": analysis.cache_difference_profile(differences),
        "fig5_transplant": analysis.transplant_matrix(transplant),
        "fig6_accuracy": analysis.accuracy_differences(pairs, seed=seed) if pairs is not None else None,
        "fig7_minimal_transplant": minimal_coverage(_read_all(inputs.get("minimal_transplant"))),
        "fig10_split_predictors": items_of_files(inputs.get("fidelity")),
    }
    # every other figure draws its one input file as read
    read = {f.name: _read_all(inputs.get(f.inputs[0])) for f in catalogue.FIGURES if f.name not in built}
    return {**built, **read, "coinciding": coinciding}


def plotter(dotted: str):
    """The function a dotted path (``package.module.function``) names."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


PLOTTERS = {figure.name: plotter(figure.plotter) for figure in catalogue.FIGURES}


def plot_figures(inputs: dict[str, dict[str, str]], outputs: dict[str, dict[str, str]] | str, seed: int = 0,
                 results_dir: str | None = None) -> list[str]:
    """Write the figures. ``outputs`` maps a figure's name (a key of :data:`FIGURES`) to {format: path}, or is a
    folder where every figure goes as ``<name>.pdf`` and ``<name>.png``. With ``results_dir`` (``results/<run>``),
    every results file of the run found on disk is drawn as well as the declared ones. Returns the paths written."""
    if isinstance(outputs, (str, Path)):
        outputs = {name: {fmt: str(Path(outputs) / f"{name}.{fmt}") for fmt in FORMATS} for name in FIGURES}
    unknown = sorted(set(outputs) - set(FIGURES))
    if unknown:
        raise ValueError(f"unknown figures {unknown}; the figures are {sorted(FIGURES)}")
    order = list((inputs.get("ledger") or {}).keys()) + [r for p in inputs.values() for r in p]
    inputs, _ = merge_inputs(inputs, results_dir)
    data = tables(inputs, seed)
    written = []
    for name, paths in outputs.items():
        PLOTTERS[name](data[name], paths, revision_order=list(dict.fromkeys(order)), coinciding=data["coinciding"])
        written += paths.values()
    return written
