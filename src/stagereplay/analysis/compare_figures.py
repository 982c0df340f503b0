"""The comparison's figures (:mod:`stagereplay.analysis.compare`), in the paper figures' style: the divergence rate
per run and construction pair with Wilson intervals, and the per-step symmetric KL of each run's fidelity table
side by side, on a log axis with exact zeros in a bin of their own.

Runs are told apart by colour (Okabe-Ito, in the order the comparison lists them) and by marker or line style, so
that they stay apart in greyscale. This module knows nothing of torch or Snakemake; it takes DataFrames.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from stagereplay.analysis import tables as analysis  # noqa: E402
from stagereplay.analysis.figure_style import (EXPERIMENT_NAMES, STYLE, WIDTH, dodge, error_lengths,  # noqa: E402
                                               placeholder_figure, save_figure)

# Okabe-Ito without the precisions' blue and vermillion, which the paper figures use for bf16 and fp32.
RUN_COLORS = ("#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#000000", "#F0E442", "#0072B2", "#D55E00")
RUN_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
RUN_LINES = ("-", "--", ":", "-.")


def run_style(index: int) -> dict:
    return {"color": RUN_COLORS[index % len(RUN_COLORS)], "marker": RUN_MARKERS[index % len(RUN_MARKERS)],
            "ls": RUN_LINES[index % len(RUN_LINES)]}


def plot_divergence(cells: pd.DataFrame, runs: list[str], paths: dict[str, str]) -> None:
    """One row per (revision, experiment, precision, construction pair), one point per run with its Wilson 95%
    interval: the share of items whose suffixes differ."""
    if cells is None or cells.empty:
        return placeholder_figure(paths, "No run holds compared items: no divergence rate to draw.")
    keys = ["revision", "experiment", "precision", "construction_a", "construction_b"]
    rows = list(dict.fromkeys(tuple(k) for k in cells[keys].itertuples(index=False, name=None)))
    order = {p: i for i, p in enumerate(analysis.sort_precisions(cells["precision"]))}
    rows.sort(key=lambda k: (k[0], analysis.EXPERIMENTS.index(k[1]) if k[1] in analysis.EXPERIMENTS else 9,
                             order[k[2]]))
    revisions = len({k[0] for k in rows})
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(WIDTH, 0.9 + 0.32 * len(rows)))
        for index, run in enumerate(runs):
            style = run_style(index)
            sub = cells[cells["run"] == run]
            for y, key in enumerate(rows):
                match = sub[(sub[keys] == pd.Series(key, index=keys)).all(axis=1)]
                if match.empty:
                    continue
                r = match.iloc[0]
                rate = 100 * r["rate"]
                ax.errorbar(rate, y + dodge(index, len(runs)), color=style["color"], marker=style["marker"],
                            ms=3.5, mfc="white" if index % 2 else style["color"], lw=0.8, capsize=1.5,
                            xerr=error_lengths(rate, 100 * r["wilson_low"], 100 * r["wilson_high"]), clip_on=False)
        labels = [(f"{revision} · " if revisions > 1 else "")
                  + f"{precision} · {EXPERIMENT_NAMES.get(e, e)}\n{a} vs {b}" for revision, e, precision, a, b in rows]
        ax.set_yticks(range(len(rows)), labels)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.tick_params(axis="y", length=0, pad=4)
        ax.set_xlim(0, 100)
        ax.set_xlabel("items whose suffixes differ (%)")
        handles = [Line2D([], [], color=run_style(i)["color"], marker=run_style(i)["marker"], ls="",
                          mfc="white" if i % 2 else run_style(i)["color"], label=run) for i, run in enumerate(runs)]
        handles.append(Line2D([], [], color="0.15", lw=0.7, marker="|", ms=4, label="Wilson 95% CI"))
        fig.legend(handles=handles, loc="outside lower center", ncol=min(3, len(handles)))
        save_figure(fig, paths)


def log_bins(values: np.ndarray) -> np.ndarray:
    """Bin edges in log10, two per decade, over the positive values (one decade where they all lie in one)."""
    low, high = np.floor(2 * np.log10(values.min())) / 2, np.ceil(2 * np.log10(values.max())) / 2
    if high <= low:
        high = low + 1
    return np.arange(low, high + 0.25, 0.5)


def plot_fidelity(tables: dict[tuple[str, str], pd.DataFrame], runs: list[str], paths: dict[str, str]) -> None:
    """Per (revision, precision, pair) a panel: each run's per-step ``kl_sym`` as the share of its steps per bin,
    positive values on a log axis (right) and steps with a KL of exactly 0 in a bin of their own (left)."""
    if not tables:
        return placeholder_figure(paths, "The runs have no fidelity table (<revision>/fidelity.parquet): no "
                                  "fidelity to draw.")
    frames = [t.assign(run=run, revision=revision) for (run, revision), t in tables.items()]
    steps = pd.concat(frames, ignore_index=True)
    steps = steps[np.isfinite(steps["kl_sym"].astype(float))]
    keys = ["revision", "precision", "reference", "construction"]
    panels = list(dict.fromkeys(tuple(k) for k in steps[keys].itertuples(index=False, name=None)))
    positive = steps["kl_sym"].astype(float)
    positive = positive[positive > 0].to_numpy()
    edges = log_bins(positive) if len(positive) else np.array([-1.0, 0.0])
    revisions = len({p[0] for p in panels})
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(len(panels), 2, figsize=(WIDTH, 0.6 + 1.25 * len(panels)), squeeze=False,
                                 sharey="row", gridspec_kw={"width_ratios": [1, 5]})
        for (zero_ax, log_ax), panel in zip(axes, panels):
            sub = steps[(steps[keys] == pd.Series(panel, index=keys)).all(axis=1)]
            for index, run in enumerate(runs):
                g = sub[sub["run"] == run]["kl_sym"].astype(float).to_numpy()
                if not len(g):
                    continue
                style = run_style(index)
                zero_ax.bar(dodge(index, len(runs), 0.6), np.mean(g == 0), width=0.6 / max(len(runs), 1),
                            color="white" if index % 2 else style["color"], edgecolor=style["color"], lw=0.6,
                            hatch="////" if index % 2 else None)
                counts, _ = np.histogram(np.log10(g[g > 0]), bins=edges)
                log_ax.stairs(counts / len(g), 10.0 ** edges, color=style["color"], ls=style["ls"], lw=1.0,
                              baseline=None)
            zero_ax.set_xticks([0], ["exactly 0"])
            zero_ax.set_xlim(-0.6, 0.6)
            zero_ax.set_ylim(0, 1)
            zero_ax.set_ylabel("share of steps")
            log_ax.set_xscale("log")
            log_ax.set_xlim(10.0 ** edges[0], 10.0 ** edges[-1])
            log_ax.tick_params(axis="y", left=False, labelleft=False)
            revision, precision, reference, construction = panel
            log_ax.set_title((f"{revision} · " if revisions > 1 else "") + f"{precision}: {reference} vs "
                             f"{construction}", loc="left")
        axes[-1][1].set_xlabel("symmetric KL per step, nats (kl_sym)")
        handles = [Line2D([], [], color=run_style(i)["color"], ls=run_style(i)["ls"], label=run)
                   for i, run in enumerate(runs)]
        fig.legend(handles=handles, loc="outside lower center", ncol=min(3, len(runs)))
        save_figure(fig, paths)
