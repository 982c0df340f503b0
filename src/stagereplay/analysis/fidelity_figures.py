"""The paper figures of the constructions' fidelity to live: figures 9 and 10.

(9) the per-step KL divergence from live along the suffix, (10) what is associated with a split: what items'
boundary states read out at the first suffix step (live's margin against the logit difference), and the share of
items split by each suffix position, one colour, marker and line style per construction. Each takes its table, made by :mod:`stagereplay.analysis.fidelity`, and writes PDF and PNG in the
one style of :mod:`stagereplay.analysis.figure_style`. A figure whose table is absent or empty says which input it
waits for.

This module reads no results file (it draws the tables it is given) and knows nothing of how the KL or the margins
were measured, nor of torch or Snakemake. matplotlib runs on the Agg backend.
"""

from __future__ import annotations

import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from stagereplay import catalogue  # noqa: E402
from stagereplay.analysis import tables as analysis  # noqa: E402
from stagereplay.analysis.fidelity import KL as FIDELITY_KL  # noqa: E402
from stagereplay.analysis.fidelity import SUMMARY_COLUMNS, construction_label, same_constructions  # noqa: E402
from stagereplay.analysis.figure_style import (COLORS, STYLE, WIDTH, ordered_revisions, panel_keys,  # noqa: E402
                                               panel_title, placeholder_figure, save_figure, symlog_threshold)
from stagereplay.analysis.stats import share_by_position  # noqa: E402


# The catalogue's colour, marker and line style of each construction (live, the reference, has none).
CONSTRUCTION_STYLE = {c.name: c.style for c in catalogue.CONSTRUCTIONS if c.style}


def _construction_style(name: str) -> dict:
    return CONSTRUCTION_STYLE.get(name, {"color": "0.4", "marker": "v", "linestyle": (0, (2, 2))})


def plot_fidelity(steps: pd.DataFrame, paths: dict[str, str], revision_order=(), **_) -> None:
    """Figure 9: per revision, one row per precision and construction: the share of suffix steps whose KL from
    live is exactly 0 (left strip) and the distribution of the others on a log axis (right)."""
    if steps is None or steps.empty:
        return placeholder_figure(paths, "No data yet for figure 9: needs fidelity.parquet (rule measure_fidelity) "
                            "with at least one compared suffix step.")
    revisions = ordered_revisions(steps, revision_order)
    rows = [(p, c) for p in analysis.sort_precisions(steps["precision"])
            for c in sorted(steps.loc[steps["precision"] == p, "construction"].unique())]
    positive = steps.loc[steps[FIDELITY_KL] > 0, FIDELITY_KL].to_numpy(dtype=float)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(len(revisions), 2, figsize=(WIDTH, (0.45 + 0.22 * len(rows)) * len(revisions) + 0.2),
                                 gridspec_kw={"width_ratios": [1.3, 3]}, squeeze=False, sharey=True)
        for (zero_ax, ax), revision in zip(axes, revisions):
            sub = steps[steps["revision"] == revision]
            for y, (precision, construction) in enumerate(rows):
                color = COLORS.get(precision, "0.3")
                g = sub[(sub["precision"] == precision) & (sub["construction"] == construction)]
                if g.empty:
                    ax.text(0.02, y, "not run", va="center", color="0.5", fontsize=6, transform=ax.get_yaxis_transform())
                    continue
                kl = g[FIDELITY_KL].to_numpy(dtype=float)
                zeros = int(np.sum(kl == 0))
                zero_ax.barh(y, 100 * zeros / len(kl), 0.6, color=color, alpha=0.85)
                zero_ax.text(104, y, f"{zeros}/{len(kl)}", va="center", ha="left", fontsize=5.5)
                above = kl[kl > 0]
                if not above.size:
                    ax.text(0.02, y, "every step exactly 0", va="center", color=color, fontsize=6,
                            transform=ax.get_yaxis_transform())
                    continue
                ax.boxplot([above], positions=[y], vert=False, whis=(5, 95), showfliers=False, widths=0.55,
                           patch_artist=True, boxprops={"facecolor": "white", "edgecolor": color, "lw": 0.8},
                           medianprops={"color": color, "lw": 1.4}, whiskerprops={"color": color, "lw": 0.7},
                           capprops={"color": color, "lw": 0.7})
                ax.plot(above.max(), y, "o", mfc="white", mec=color, mew=0.8, ms=3.5)
            zero_ax.set_xlim(0, 175)  # room right of the bars for k/n
            zero_ax.set_xticks([0, 100], ["0", "100"])
            zero_ax.spines["bottom"].set_bounds(0, 100)
            zero_ax.set_xlabel("exactly 0\n(% of steps)")
            zero_ax.set_yticks(range(len(rows)), [f"{p} · {c}" for p, c in rows])
            zero_ax.set_ylim(len(rows) - 0.5, -0.5)
            zero_ax.tick_params(axis="y", length=0, pad=4)
            if positive.size:
                ax.set_xscale("log")
                ax.set_xlim(positive.min() / 3, positive.max() * 3)
            ax.tick_params(axis="y", length=0, labelleft=False)
            ax.spines["left"].set_visible(False)
            ax.set_xlabel("KL(live || construction) per step\n(nats; steps above 0)")
            panel_title(zero_ax, f"revision {revision}", len(revisions) > 1)
        save_figure(fig, paths)


def _split_panel(scatter, curve_ax, panel: pd.DataFrame, constructions, positions, precision: str) -> None:
    """One row of figure 10: the boundary scores (left) and the split-by-position curves (right); constructions
    alike on every item drawn once, under one label; a panel with no split says so instead of flat lines at 0."""
    any_split = bool(panel["split"].astype(bool).any())
    by = ["revision", "precision"]
    groups = same_constructions(panel, by, SUMMARY_COLUMNS).get(tuple(panel[by].iloc[0]), [])
    curves = same_constructions(panel, by, ["split", "first_divergence"]).get(tuple(panel[by].iloc[0]), [])
    n = int(panel.groupby("construction").size().max())
    for construction in constructions:
        g = panel[panel["construction"] == construction]
        if g.empty or construction_label(construction, groups) is None:
            continue
        style = _construction_style(construction)
        split = g["split"].astype(bool)
        first = pd.to_numeric(g["first_divergence"], errors="coerce")
        later = split & (first > 0)
        scatter.scatter(g.loc[~split, "logit_diff_boundary"], g.loc[~split, "margin_boundary"], s=10,
                        marker=style["marker"], facecolors="none", edgecolors=style["color"], linewidths=0.6,
                        clip_on=False, zorder=2)
        # split items above every construction's unsplit ones, which would otherwise hide them
        scatter.scatter(g.loc[later, "logit_diff_boundary"], g.loc[later, "margin_boundary"], s=10,
                        marker=style["marker"], color=style["color"], linewidths=0, clip_on=False, zorder=3)
        if not any_split or construction_label(construction, curves) is None:
            continue
        curve = share_by_position(list(g["first_divergence"]), len(g), positions)
        k = np.asarray(curve["positions"])
        curve_ax.fill_between(k, 100 * np.asarray(curve["wilson_low"], dtype=float),
                              100 * np.asarray(curve["wilson_high"], dtype=float), step="post",
                              color=style["color"], alpha=0.12, lw=0)
        curve_ax.step(k, 100 * np.asarray(curve["rate"], dtype=float), where="post", color=style["color"],
                      lw=1.0, ls=style["linestyle"])
    notes = [f"{' = '.join(names)} (alike on all {n} items)" for names in groups]
    if any_split:
        notes += [f"{' = '.join(names)} (same splits on all {n} items)" for names in curves if names not in groups]
    if notes:
        text = "\n".join(textwrap.fill(note, 26) for note in notes) + "\ndrawn once"
        curve_ax.text(0.03, 0.97, text, ha="left", va="top", fontsize=5, color="0.35", transform=curve_ax.transAxes,
                      in_layout=False)
    if not any_split:
        curve_ax.text(0.55, 0.3, f"no splits at {precision}\n0 of {n} items,\nevery construction", ha="center",
                      va="center", fontsize=6.5, color="0.35", transform=curve_ax.transAxes, in_layout=False)
    for axis, column in (("x", "logit_diff_boundary"), ("y", "margin_boundary")):
        values = panel[column].dropna().to_numpy(dtype=float)
        if np.any(values > 0):
            getattr(scatter, f"set_{axis}scale")("symlog", linthresh=symlog_threshold(values), linscale=0.6)
        getattr(scatter, f"set_{axis}lim")(0, 2 * float(np.max(values)) if np.any(values > 0) else 1.0)


def plot_split_predictors(items: pd.DataFrame, paths: dict[str, str], revision_order=(), **_) -> None:
    """Figure 10: per revision and precision (one row of panels each), what the boundary state reads out at the
    first suffix step, live's margin against the logit difference (items split later filled; left), and the share
    of items split within the first k suffix tokens with pointwise Wilson intervals (right). Constructions whose
    items are alike on every item are drawn once, labelled ``a = b``."""
    if items is None or items.empty:
        return placeholder_figure(paths, "No data yet for figure 10: needs fidelity.parquet (rule measure_fidelity) "
                            "with at least one compared item.")
    keys = panel_keys(items, revision_order)
    constructions = sorted(items["construction"].unique())
    revisions = {k[0] for k in keys}
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(len(keys), 2, figsize=(WIDTH, 1.55 * len(keys) + 0.45), squeeze=False)
        for row, (revision, precision) in enumerate(keys):
            scatter, curve_ax = axes[row]
            panel = items[(items["revision"] == revision) & (items["precision"] == precision)]
            positions = int(panel["positions"].max())
            _split_panel(scatter, curve_ax, panel, constructions, positions, precision)
            scatter.set_ylabel("live margin at step 0")
            curve_ax.set_xlim(1, positions)
            curve_ax.set_ylim(0, 100)
            curve_ax.xaxis.get_major_locator().set_params(integer=True)
            curve_ax.set_ylabel("items split within k (%)")
            panel_title(scatter, f"{revision} · {precision}" if len(revisions) > 1 else precision, True)
        axes[-1][0].set_xlabel("max-abs logit diff at step 0")
        axes[-1][1].set_xlabel("suffix position k")
        handles = [Line2D([], [], ls=_construction_style(c)["linestyle"], marker=_construction_style(c)["marker"],
                          color=_construction_style(c)["color"], label=c) for c in constructions]
        handles += [Line2D([], [], ls="", marker="o", color="0.3", label="split after step 0"),
                    Line2D([], [], ls="", marker="o", mfc="none", mec="0.3", label="not split"),
                    Patch(facecolor="0.3", alpha=0.15, label="Wilson 95%")]
        fig.legend(handles=handles, loc="outside lower center", ncol=3, handlelength=1.8, columnspacing=1.0)
        save_figure(fig, paths)
