"""The paper figures of what the caches hold and do: figures 4, 5, 7 and 8.

(4) the per-layer differences between the constructions' boundary caches, (5) the transplant outcome matrix,
(7) how often each part of the cache is in a minimal sufficient transplant, (8) the growth of the cache difference
with depth in divergent items and the margin at the divergence against the last layer's difference. Each takes its
table, made from the stages' results by :mod:`stagereplay.analysis.tables` and
:mod:`stagereplay.analysis.divergence_location`, and writes PDF and PNG in the one style of
:mod:`stagereplay.analysis.figure_style`. A figure whose table is absent or empty says which input it waits for.

This module reads no results file and no cache (the stages measured them; it draws the tables it is given), and
knows nothing of torch or Snakemake. matplotlib runs on the Agg backend.
"""

from __future__ import annotations

import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from stagereplay.analysis import tables as analysis  # noqa: E402
from stagereplay.analysis.divergence_location import onset_items  # noqa: E402
from stagereplay.analysis.figure_style import (COLORS, COMPONENT_STYLE, STYLE, WIDTH, label_coinciding,  # noqa: E402
                                               line_height, ordered_revisions, panel_keys, panel_title,
                                               placeholder_figure, save_figure, stacked_axes, symlog_threshold,
                                               text_width, wrap_to_width)


def plot_cache_differences(profile: pd.DataFrame, paths: dict[str, str], revision_order=(), **_) -> None:
    """Figure 4: per layer, the share of items whose boundary-cache bytes differ between the constructions (top) and,
    among those items, the max-abs difference (bottom: median line, 10th-90th percentile band); K and V drawn
    apart (line style, marker, a small offset), one colour per precision, one column per revision."""
    if profile is None or profile.empty:
        return placeholder_figure(paths, "No data yet for figure 4: cache_differences.parquet is absent or empty "
                                  "(rule measure_cache_differences).")
    revisions = ordered_revisions(profile, revision_order)
    precisions = analysis.sort_precisions(profile["precision"])
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, len(revisions), figsize=(WIDTH, 3.5), sharex=True, sharey="row", squeeze=False)
        for col, revision in enumerate(revisions):
            sub = profile[profile["revision"] == revision]
            upper, lower = axes[0][col], axes[1][col]
            for precision in precisions:
                color = COLORS.get(precision, "0.3")
                for component, style in COMPONENT_STYLE.items():
                    g = sub[(sub["precision"] == precision) & (sub["component"] == component)].sort_values("layer")
                    if g.empty:
                        continue
                    x = g["layer"].to_numpy(dtype=float) + style["dx"]
                    kw = dict(ls=style["ls"], marker=style["marker"], color=color, ms=3,
                              mfc=color if style["filled"] else "white", mew=0.8)
                    upper.plot(x, g["share_differ"], **kw)
                    lower.plot(x, g["max_abs_median"].to_numpy(dtype=float), **kw)  # NaN where no item differs
                    lower.fill_between(x, g["max_abs_p10"].to_numpy(dtype=float),
                                       g["max_abs_p90"].to_numpy(dtype=float), color=color, alpha=0.15, lw=0)
            upper.set_ylim(-0.04, 1.04)
            panel_title(upper, f"revision {revision}", len(revisions) > 1)
            spread = sub[["max_abs_median", "max_abs_p10", "max_abs_p90"]].to_numpy(dtype=float)
            if np.any(np.isfinite(spread) & (spread > 0)):
                lower.set_yscale("log")
            else:  # no layer differs in any item (numerics: invariant): nothing to put on a log axis
                lower.text(0.5, 0.5, "no layer differs", transform=lower.transAxes, ha="center", va="center")
            lower.set_xlabel("layer")
            lower.xaxis.get_major_locator().set_params(integer=True)
        axes[0][0].set_ylabel("share of items whose\nlayer bytes differ")
        axes[1][0].set_ylabel("max |Δ| among those items")
        n_items = int(profile["n"].max())
        handles = [Line2D([], [], color=COLORS.get(p, "0.3"), lw=2.5, label=f"{p}") for p in precisions]
        handles += [Line2D([], [], color="0.3", ls=s["ls"], marker=s["marker"], ms=3,
                           mfc="0.3" if s["filled"] else "white", label=f"{c.upper()} cache")
                    for c, s in COMPONENT_STYLE.items()]
        handles.append(Patch(facecolor="0.3", alpha=0.15, lw=0, label="10th–90th percentile"))
        fig.legend(handles=handles, loc="outside lower center", ncol=3, handlelength=2.4, columnspacing=1.0,
                   title=f"n = {n_items} items per precision", title_fontsize=6.5)
        save_figure(fig, paths)


# Figure 5's heights (inches): a panel's title line, direction names and margins; each row of the matrix; the
# colour bar below the panels with its ticks and label. Its side margin: the axis label left of the row names and
# the pads either side.
TRANSPLANT_PANEL_HEIGHT = 0.55
TRANSPLANT_ROW_HEIGHT = 0.17
TRANSPLANT_COLORBAR_HEIGHT = 0.45
TRANSPLANT_SIDE_MARGIN = 0.45


def plot_transplant(matrix: pd.DataFrame, paths: dict[str, str], revision_order=(), **_) -> None:
    """Figure 5: share of transplanted continuations that follow their cache donor, per layer set / component /
    positions (rows) and direction (columns), each direction's column beside its placebo's (where the file has the
    controls), one panel per revision and precision, with k/n in each cell (no-op items left out; "no-op" where
    every item was one)."""
    if matrix is None or matrix.empty:
        return placeholder_figure(paths, "No data yet for figure 5: transplant.parquet is absent or empty "
                                  "(the transplant stage has not run).")
    panels = panel_keys(matrix, revision_order)
    n_rows = max(matrix[(matrix["revision"] == r) & (matrix["precision"] == p)]["label"].nunique() for r, p in panels)
    with plt.rc_context(STYLE):
        fig, axes = stacked_axes(len(panels), 1.0)  # the height is set below, from what the panels hold
        image, height = None, TRANSPLANT_COLORBAR_HEIGHT
        for ax, (revision, precision) in zip(axes, panels):
            sub = matrix[(matrix["revision"] == revision) & (matrix["precision"] == precision)]
            order = sorted(sub[["label", "layer_set", "component", "positions"]].drop_duplicates()
                           .itertuples(index=False), key=analysis.transplant_row_key)
            labels = list(dict.fromkeys(r.label for r in order))
            directions = sorted(sub["direction"].unique())
            controlled = sub["placebo"].notna().any() if "placebo" in sub.columns else False
            arms = ("donor", "placebo") if controlled else ("donor",)
            columns = [(d, arm) for d in directions for arm in arms]
            grid = np.full((len(labels), len(columns)), np.nan)
            for r in sub.itertuples(index=False):
                for arm in arms:
                    i, j = labels.index(r.label), columns.index((r.direction, arm))
                    k = r.donor if arm == "donor" else r.placebo
                    rate = None if not r.n else k / r.n
                    grid[i, j] = np.nan if rate is None else rate
                    ax.text(j, i, f"{int(k)}/{r.n}" if r.n else "no-op", ha="center", va="center", fontsize=5.5,
                            color="white" if (rate or 0) > 0.6 else "black")
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="Blues", aspect="auto")
            ax.set_xticks(range(len(columns)), [d.replace("->", "\n→ ") + ("" if arm == "donor" else "\nplacebo")
                                                for d, arm in columns])
            ax.xaxis.tick_top()
            ax.tick_params(axis="x", length=0)
            names = [re.sub(r"^layers? ", "", lab) + (" (whole state)" if lab == "layers all · KV" else "")
                     for lab in labels]
            ax.set_yticks(range(len(labels)), names)
            ax.tick_params(axis="y", length=0)
            if labels and labels[0].startswith("layers all · KV") and len(labels) > 1:
                ax.axhline(0.5, color="white", lw=2)
            # the title starts above the image, right of the row names: a long revision name is broken to fit there
            room = WIDTH - max(text_width(fig, n, STYLE["ytick.labelsize"]) for n in names) - TRANSPLANT_SIDE_MARGIN
            title = wrap_to_width(fig, f"revision {revision}, {precision}", room, STYLE["axes.titlesize"])
            ax.set_title(title, loc="left", pad=3)
            ax.spines[:].set_visible(False)
            height += (TRANSPLANT_PANEL_HEIGHT + TRANSPLANT_ROW_HEIGHT * n_rows
                       + title.count("\n") * line_height(fig, STYLE["axes.titlesize"]))
        fig.set_figheight(height)
        fig.supylabel(wrap_to_width(fig, "layers · component · positions", height - TRANSPLANT_COLORBAR_HEIGHT, 7),
                      fontsize=7)
        # below the panels: a vertical bar's label is longer than one short panel is tall
        fig.colorbar(image, ax=axes, label="share following the donor", shrink=0.8, aspect=40,
                     pad=0.02, orientation="horizontal", location="bottom")
        save_figure(fig, paths)


def plot_minimal_transplant(coverage: pd.DataFrame, paths: dict[str, str], revision_order=(), **_) -> None:
    """Figure 7: per layer (rows) and cache position relative to the first stage token (columns), the share of
    minimal sufficient transplants that include that part, K and V apart; one pair of panels per revision and
    precision, both directions pooled."""
    if coverage is None or coverage.empty:
        return placeholder_figure(paths, "No data yet for figure 7: minimal_transplant.parquet is absent, empty or "
                                  "holds no minimal set (rule find_minimal_transplants; transplant.minimal.budget 0 "
                                  "is off).")
    panels = [(r, p, c) for r, p in panel_keys(coverage, revision_order) for c in ("k", "v")]
    num_layers = int(coverage["layer"].max()) + 1
    with plt.rc_context(STYLE):
        fig, axes = stacked_axes(len(panels), 0.45 + 0.16 * num_layers, sharex=True)
        lo, hi = int(coverage["offset"].min()), int(coverage["offset"].max())
        # the colour scale ends at the largest share drawn (a tenth up): minimal sets are small, so a 0-1 scale
        # leaves every cell pale
        top = max(0.1, float(np.ceil(coverage["share"].max() * 10) / 10))
        image, gaps = None, False
        for ax, (revision, precision, component) in zip(axes, panels):
            sub = coverage[(coverage["revision"] == revision) & (coverage["precision"] == precision)
                           & (coverage["component"] == component)]
            grid = np.full((num_layers, hi - lo + 1), np.nan)  # (layers, offsets); NaN: no cache reaches there
            for r in sub.itertuples(index=False):
                grid[int(r.layer), int(r.offset) - lo] = r.share
            gaps = gaps or bool(np.isnan(grid).any())
            # where no cache reaches (NaN, left transparent) the hatched grey background shows: never a share of 0
            ax.add_patch(Rectangle((lo - 0.5, -0.5), hi - lo + 1, num_layers, facecolor="0.85", edgecolor="0.6",
                                   hatch="////", lw=0, zorder=0))
            image = ax.imshow(grid, vmin=0, vmax=top, cmap="Blues", aspect="auto", origin="lower",
                              extent=(lo - 0.5, hi + 0.5, -0.5, num_layers - 0.5), interpolation="nearest",
                              zorder=1)
            ax.axvline(-0.5, color=COLORS["reference"], lw=0.8, ls=":")
            ax.set_yticks(range(num_layers))
            ax.set_ylabel(f"{component.upper()} · layer")
            n = int(sub.groupby(["layer", "offset"])["n"].max().max())
            many = len(panels) > 2
            ax.set_title(f"{component.upper()} cache" + (f" · revision {revision}, {precision}" if many else "")
                         + f" · n = {n}", loc="left", pad=3)
            ax.spines[:].set_visible(False)
        axes[-1].set_xlabel("cache position − prompt length (< 0: prompt; ≥ 0: stage)")
        if gaps:  # the hatching is named only where some cell shows it
            axes[0].legend(handles=[Patch(facecolor="0.85", edgecolor="0.6", hatch="////", label="no cache there")],
                           loc="lower left", bbox_to_anchor=(0, 1.12), borderaxespad=0, handlelength=1.4)
        fig.colorbar(image, ax=axes, label=f"share of minimal sets including the part (0 to {top:g})", shrink=0.8,
                     aspect=25, pad=0.02)
        save_figure(fig, paths)


def plot_divergence_onset(onset: pd.DataFrame, paths: dict[str, str], revision_order=(), **_) -> None:
    """Figure 8, from the onset table: top, per divergent item, the RMS difference between the two constructions'
    caches per layer (the larger of K and V; median over items as a thick line); bottom, the margin at the first
    divergence against the max-abs difference at the last layer. Colour: precision; one column per revision."""
    items = onset_items(onset)
    if items.empty:
        return placeholder_figure(paths, "No data yet for figure 8: divergence_onset.parquet is absent or empty "
                                  "(rule measure_divergence_onset; needs divergent items).")
    revisions = ordered_revisions(items, revision_order)
    precisions = analysis.sort_precisions(items["precision"])
    per_layer = onset.groupby(["revision", "precision", "item_index", "layer"], as_index=False)["rms"].max()
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, len(revisions), figsize=(WIDTH, 4.2), squeeze=False)
        for col, revision in enumerate(revisions):
            upper, lower = axes[0][col], axes[1][col]
            for precision in precisions:
                color = COLORS.get(precision, "0.3")
                lines = per_layer[(per_layer["revision"] == revision) & (per_layer["precision"] == precision)]
                for _, g in lines.groupby("item_index"):
                    upper.plot(g["layer"], g["rms"], color=color, lw=0.5, alpha=0.35)
                if len(lines):
                    median = lines.groupby("layer")["rms"].median()
                    upper.plot(median.index, median.to_numpy(), color=color, lw=1.8, marker="o", ms=3,
                               label=f"{precision}: median (n={lines['item_index'].nunique()})")
                pts = items[(items["revision"] == revision) & (items["precision"] == precision)
                            & items["margin_a"].notna()]
                lower.scatter(pts["last_max_abs"], pts["margin_a"], s=14, facecolors="none", edgecolors=color,
                              linewidths=0.8, clip_on=False, label=f"{precision} (n={len(pts)})")
                label_coinciding(lower, pts, "last_max_abs", "margin_a", color)
            values = per_layer.loc[per_layer["revision"] == revision, "rms"].to_numpy(dtype=float)
            if np.any(values > 0):
                upper.set_yscale("symlog", linthresh=symlog_threshold(values), linscale=0.5)
            upper.set_ylim(bottom=0)
            upper.set_xlabel("layer")
            upper.xaxis.get_major_locator().set_params(integer=True)
            x = items.loc[items["revision"] == revision, "last_max_abs"].to_numpy(dtype=float)
            if np.any(x > 0):
                lower.set_xscale("symlog", linthresh=symlog_threshold(x), linscale=0.5)
            lower.set_xlim(0, 2 * float(np.max(x)) if np.any(x > 0) else 1.0)
            lower.set_ylim(bottom=0)
            lower.set_xlabel("max |Δ| at the last layer")
            panel_title(upper, f"revision {revision}", len(revisions) > 1)
        axes[0][0].set_ylabel("RMS |Δ| of the caches")
        axes[1][0].set_ylabel("top-2 margin at the first divergence")
        axes[0][0].legend(loc="upper left", handlelength=1.6)
        axes[1][0].legend(loc="best", handletextpad=0.3)
        save_figure(fig, paths)
