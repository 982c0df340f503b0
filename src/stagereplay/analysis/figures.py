"""The paper figures, as PDF and PNG, from the tidy tables of :mod:`stagereplay.analysis.tables`.

Ten figures: (1) suffix disagreement per construction x precision cell, (2) first-divergence positions, (3) top-2
margins at the first divergence against the same item's other steps, (4) per-layer differences between
constructions' boundary caches, (5) the transplant outcome matrix, (6) paired accuracy differences with their CIs,
(7) how often each part of the cache is in a minimal sufficient transplant, (8) the growth of the cache difference
with depth in divergent items and the margin at the divergence against the last layer's difference, (9) the
per-step KL divergence from live along the suffix, (10) what predicts a split: items' smallest margin against
their largest logit difference, and the share of items split by each suffix position.
A figure whose input is absent or empty is still written, saying which input it waits for, so the pipeline never
stops on a stage that has not run.

Style, one for all (:mod:`stagereplay.analysis.figure_style`): a single column's width (3.4 in), 7-pt type,
the Okabe-Ito colours (one per precision) with a marker and line style per experiment or component so that series
stay apart in greyscale and where they coincide, every mark in a legend, fonts embedded in the PDF as TrueType
(``pdf.fonttype`` 42), no title or figure number drawn into the image: the captions
(:mod:`stagereplay.analysis.captions`) go beside it, in the report and in ``workflow/report/*.rst``. The reference study's values come from
:mod:`stagereplay.analysis.study`.

This module knows nothing of torch or Snakemake: :func:`plot_figures` takes paths, the figure functions take
DataFrames. matplotlib runs on the Agg backend.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from stagereplay.analysis import captions, study  # noqa: E402
from stagereplay.analysis import tables as analysis  # noqa: E402
from stagereplay.analysis.divergence_location import minimal_coverage, onset_items  # noqa: E402
from stagereplay.analysis.fidelity import KL as FIDELITY_KL, items_of_files  # noqa: E402
from stagereplay.analysis.figure_style import (COLORS, COMPONENT_STYLE, EXPERIMENT_NAMES,  # noqa: E402
                                               EXPERIMENT_STYLE, STYLE, WIDTH, dodge, drop_coinciding,
                                               error_lengths, label_coinciding, line_height, ordered_revisions,
                                               panel_keys, panel_title, revision_key, stacked_axes,
                                               symlog_threshold, text_width, wrap_to_width)
from stagereplay.analysis.inputs import merge_inputs  # noqa: E402
from stagereplay.analysis.stats import share_by_position  # noqa: E402
from stagereplay.io.parquet import atomic_path, read_parquet  # noqa: E402

FIGURES = {name: title for name, (title, _) in captions.CAPTIONS.items()}
FORMATS = ("pdf", "png")


def save_figure(fig, paths: dict[str, str]) -> None:
    """Write ``fig`` to each format's path atomically, at the figure's own size (a fixed width, not a tight box);
    metadata without dates keeps the PDF reproducible."""
    for fmt, path in paths.items():
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt,
                        metadata={"CreationDate": None} if fmt == "pdf" else {"Software": None})
    plt.close(fig)


def placeholder_figure(paths: dict[str, str], message: str) -> None:
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(WIDTH, 1.0))
        ax.set_axis_off()
        ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, color="0.3", transform=ax.transAxes)
        save_figure(fig, paths)


def plot_disagreement(cells: pd.DataFrame, paths: dict[str, str], revision_order=(), **_) -> None:
    """Figure 1: per revision, the rate of suffix disagreement between the constructions of each experiment, one
    bar per precision and experiment, with Wilson 95% intervals and k/n beside each bar; the reference study's
    counts as labelled open diamonds on the cells the study gives a count for."""
    if cells is None or cells.empty:
        return placeholder_figure(paths, "No data yet for figure 1: the ledger holds no compared items "
                                  "(matched or fixed-prefix experiment with status ok on both constructions).")
    revisions = ordered_revisions(cells, revision_order)
    experiments = [e for e in analysis.EXPERIMENTS if e in set(cells["experiment"])]
    precisions = analysis.sort_precisions(cells["precision"])
    fixed = cells[cells["experiment"] == "fixed_prefix"]
    fixed_pair = tuple(fixed[["construction_a", "construction_b"]].iloc[0]) if len(fixed) else None
    reference = {("matched", p): c for p, c in study.MATCHED_DISAGREEMENTS.items() if c is not None}
    if fixed_pair == analysis.STUDY_FIXED_PREFIX:  # the study's count is of its own pair only
        reference.update({("fixed_prefix", p): c for p, c in study.FIXED_PREFIX_DISAGREEMENTS.items()
                          if c is not None})
    rows = [(p, e) for p in precisions for e in experiments]
    with plt.rc_context(STYLE):
        fig, axes = stacked_axes(len(revisions), 0.35 + 0.2 * len(rows), sharex=True)
        fig.set_figheight(fig.get_figheight() + 0.55)  # room for the legend below
        for ax, revision in zip(axes, revisions):
            sub = cells[cells["revision"] == revision]
            for y, (precision, experiment) in enumerate(rows):
                color = COLORS.get(precision, "0.5")
                row = sub[(sub["experiment"] == experiment) & (sub["precision"] == precision)]
                if row.empty:
                    ax.text(1, y, "not run", va="center", color="0.5", fontsize=6)
                    continue
                r = row.iloc[0]
                rate = 100 * r["rate"]
                ax.barh(y, rate, 0.72, color=color if experiment == "matched" else "white",
                        hatch=EXPERIMENT_STYLE[experiment]["hatch"], edgecolor=color, lw=0.8)
                ax.errorbar(rate, y, xerr=error_lengths(rate, 100 * r["wilson_low"], 100 * r["wilson_high"]),
                            color="0.15", lw=0.7, capsize=1.5)
                count = reference.get((experiment, precision))
                # counts in a column right of the axes, where no bar or interval can run into them
                ax.text(1.02, y, f"{int(r['k'])}/{int(r['n'])}" + (f"  (study {count.k}/{count.n})" if count else ""),
                        transform=ax.get_yaxis_transform(), va="center", ha="left", fontsize=6, clip_on=False)
                if count is not None:
                    ax.plot(100 * count.rate, y, "D", mfc="white", mec=COLORS["reference"], mew=0.9, ms=4.5,
                            zorder=5, clip_on=False)
            ax.set_yticks(range(len(rows)), [f"{p} · {EXPERIMENT_NAMES[e]}" for p, e in rows])
            ax.set_ylim(len(rows) - 0.5, -0.5)
            ax.tick_params(axis="y", length=0, pad=5)
            ax.set_xlim(0, 100)
            panel_title(ax, f"revision {revision}", len(revisions) > 1)
        axes[-1].set_xlabel("items whose suffixes differ (%)")
        handles = [Patch(facecolor="0.45", edgecolor="0.45", label="live vs prefill")]
        if "fixed_prefix" in experiments:
            handles.append(Patch(facecolor="white", edgecolor="0.45", hatch="////",
                                 label=f"{fixed_pair[0]} vs {fixed_pair[1]}"))
        handles.append(Line2D([], [], color="0.15", lw=0.7, marker="|", ms=4, label="Wilson 95% CI"))
        handles.append(Line2D([], [], ls="", marker="D", mfc="white", mec="black", ms=4.5,
                              label="reference study"))
        fig.legend(handles=handles, loc="outside lower center", ncol=2, handlelength=1.6, columnspacing=1.0)
        save_figure(fig, paths)


def plot_first_divergence(pairs: pd.DataFrame, paths: dict[str, str], revision_order=(), coinciding=(), **_) -> None:
    """Figure 2: ECDF of first-divergence positions among disagreeing items, per experiment (line style, marker)
    and precision (colour), one panel per revision; a fixed-prefix cell repeating the matched one is drawn once."""
    div = pairs[pairs["disagree"].astype(bool)] if pairs is not None and not pairs.empty else None
    if div is None or div.empty:
        return placeholder_figure(paths, "No data yet for figure 2: no compared pair of suffixes disagrees "
                                  "(needs a ledger with disagreeing constructions).")
    div = drop_coinciding(div, coinciding)
    revisions = ordered_revisions(div, revision_order)
    with plt.rc_context(STYLE):
        fig, axes = stacked_axes(len(revisions), 2.0)
        for ax, revision in zip(axes, revisions):
            sub = div[div["revision"] == revision]
            series = [(e, p) for e in analysis.EXPERIMENTS for p in analysis.sort_precisions(sub["precision"])
                      if ((sub["experiment"] == e) & (sub["precision"] == p)).any()]
            for index, (experiment, precision) in enumerate(series):
                g = sub[(sub["experiment"] == experiment) & (sub["precision"] == precision)]
                # positions are integers: each series a little apart, so equal steps do not hide each other
                x = np.sort(g["first_divergence"].to_numpy(dtype=float)) + dodge(index, len(series))
                y = np.arange(1, x.size + 1) / x.size
                style = EXPERIMENT_STYLE[experiment]
                merged = (revision, precision) in set(coinciding) and experiment == "matched"
                label = (f"{EXPERIMENT_NAMES[experiment]}{' (= fixed-prefix)' if merged else ''}, {precision} "
                         f"(n={x.size})")
                ax.step(np.concatenate([[0], x]), np.concatenate([[0], y]), where="post",
                        color=COLORS.get(precision, "0.3"), ls=style["ls"], marker=style["marker"],
                        mfc="white" if experiment == "fixed_prefix" else COLORS.get(precision, "0.3"),
                        markevery=list(range(1, x.size + 1)), label=label)
            ax.set_ylim(0, 1.03)
            # The axis spans the whole suffix, so early and late divergences read at their place in it.
            longest = pairs.loc[pairs["revision"] == revision, ["suffix_length_a", "suffix_length_b"]].to_numpy().max()
            ax.set_xlim(-0.5, max(float(longest), float(sub["first_divergence"].max()) + 1))
            ax.set_xlabel("first-divergence position (suffix token)")
            ax.set_ylabel("share of disagreeing items")
            panel_title(ax, f"revision {revision}", len(revisions) > 1)
            ax.legend(loc="lower right", handlelength=2.4)
        save_figure(fig, paths)


def plot_margins(margins: pd.DataFrame, paths: dict[str, str], revision_order=(), **_) -> None:
    """Figure 3: per disagreeing item, the margin at the first divergence (y) against the median margin of the same
    suffix's other steps (x), with the diagonal; symmetric-log axes; one panel per revision."""
    if margins is None or margins.empty:
        return placeholder_figure(paths, "No data yet for figure 3: no first divergence with a margin "
                                  "(needs disagreeing suffixes in the ledger).")
    margins = margins[margins["median_other"].notna()]
    if margins.empty:
        return placeholder_figure(paths, "No data yet for figure 3: no disagreeing suffix has a decode step besides "
                                  "its first divergence.")
    revisions = ordered_revisions(margins, revision_order)
    values = margins[["margin_divergence", "median_other"]].to_numpy(dtype=float)
    linthresh = symlog_threshold(values)
    top = float(np.nanmax(values)) * 2 if np.isfinite(values).any() else 1.0
    with plt.rc_context(STYLE):
        fig, axes = stacked_axes(len(revisions), 2.9)
        for ax, revision in zip(axes, revisions):
            sub = margins[margins["revision"] == revision]
            ax.plot([0, top], [0, top], color="0.6", lw=0.7, ls=":", zorder=0, label="equal margins")
            for experiment in analysis.EXPERIMENTS:
                for precision in analysis.sort_precisions(sub["precision"]):
                    g = sub[(sub["experiment"] == experiment) & (sub["precision"] == precision)]
                    if g.empty:
                        continue
                    below = int((g["margin_divergence"] < g["median_other"]).sum())
                    color = COLORS.get(precision, "0.3")
                    # Open markers: points that fall on one another stay visible as overlapping rings.
                    ax.scatter(g["median_other"], g["margin_divergence"], s=14,
                               marker=EXPERIMENT_STYLE[experiment]["marker"], facecolors="none", edgecolors=color,
                               linewidths=0.8, alpha=0.8, clip_on=False,
                               label=f"{EXPERIMENT_NAMES[experiment]}, {precision}: {below} of {len(g)} below")
                    label_coinciding(ax, g, "median_other", "margin_divergence", color)
            for axis in (ax.set_xscale, ax.set_yscale):
                axis("symlog", linthresh=linthresh, linscale=0.5)
            ax.set_xlim(0, top)
            ax.set_ylim(0, top)
            ax.set_aspect("equal", adjustable="box")
            ties = int((sub["margin_divergence"] == 0).sum())
            if ties:  # exact ties sit on the axis, where points are hardest to count
                # left, away from the points (their medians are large) and their ×k counts
                ax.annotate(f"{ties} of {len(sub)} at an exact tie (margin 0)", (0.06, 0), xycoords="axes fraction",
                            xytext=(0, 4), textcoords="offset points", ha="left", va="bottom", fontsize=6)
            ax.set_xlabel("median margin at the item's other steps")
            ax.set_ylabel("margin at the first divergence")
            panel_title(ax, f"revision {revision}", len(revisions) > 1)
            ax.legend(loc="upper left", handletextpad=0.3)
        save_figure(fig, paths)


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
    positions (rows) and direction (columns), one panel per revision and precision, with k/n in each cell."""
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
            grid = np.full((len(labels), len(directions)), np.nan)
            for r in sub.itertuples(index=False):
                i, j = labels.index(r.label), directions.index(r.direction)
                grid[i, j] = np.nan if r.rate is None else r.rate
                ax.text(j, i, f"{r.donor}/{r.n}", ha="center", va="center", fontsize=5.5,
                        color="white" if (r.rate or 0) > 0.6 else "black")
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="Blues", aspect="auto")
            ax.set_xticks(range(len(directions)), [d.replace("->", "\n→ ") for d in directions])
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


def plot_accuracy(differences: pd.DataFrame, paths: dict[str, str], revision_order=(), coinciding=(), **_) -> None:
    """Figure 6: accuracy of the baseline construction minus the other's, in points, with the paired bootstrap 95%
    CI, one row per revision x experiment x precision; the reference study's matched bf16 result on top."""
    if differences is None or differences.empty:
        return placeholder_figure(paths, "No data yet for figure 6: no compared items with correctness labels "
                                  "in the ledger.")
    known = list(analysis.EXPERIMENTS)
    precisions = analysis.sort_precisions(differences["precision"])
    rows = differences.assign(
        _r=differences["revision"].map(revision_key(revision_order)),
        _e=differences["experiment"].map(lambda e: known.index(e) if e in known else 99),
        _p=differences["precision"].map(precisions.index),
    ).sort_values(["_r", "_e", "_p"]).reset_index(drop=True)
    many = rows["revision"].nunique() > 1
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(WIDTH, 0.75 + 0.2 * (len(rows) + 1)))
        ref = study.MATCHED_ACCURACY["bf16"]
        labels = [f"reference study · matched · bf16 · n={ref['n']}"]
        ax.errorbar(100 * ref["difference"], 0,
                    xerr=error_lengths(100 * ref["difference"], 100 * ref["low"], 100 * ref["high"]),
                    fmt="D", mfc="white", color=COLORS["reference"], capsize=2, lw=0.8, ms=4)
        for i, r in enumerate(rows.itertuples(index=False), start=1):
            color = COLORS.get(r.precision, "0.3")
            ax.errorbar(100 * r.difference, i, xerr=error_lengths(100 * r.difference, 100 * r.bootstrap_low,
                                                         100 * r.bootstrap_high),
                        fmt=EXPERIMENT_STYLE.get(r.experiment, {"marker": "o"})["marker"], color=color,
                        mfc=color if r.experiment == "matched" else "white", capsize=2, lw=0.8, ms=4)
            same = r.experiment == "fixed_prefix" and (r.revision, r.precision) in set(coinciding)
            labels.append(f"{r.revision} · " * many + f"{EXPERIMENT_NAMES.get(r.experiment, r.experiment)}"
                          f"{' (= matched)' if same else ''} · {r.precision} · n={r.n}")
        ax.axvline(0, color="0.6", lw=0.6, zorder=0)
        ax.set_yticks(range(len(labels)), labels)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        ax.tick_params(axis="y", length=0)
        ax.set_xlabel("baseline − other construction (points, 95% CI)", loc="right")
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
        image = None
        for ax, (revision, precision, component) in zip(axes, panels):
            sub = coverage[(coverage["revision"] == revision) & (coverage["precision"] == precision)
                           & (coverage["component"] == component)]
            grid = np.full((num_layers, hi - lo + 1), np.nan)  # (layers, offsets); NaN: no cache reaches there
            for r in sub.itertuples(index=False):
                grid[int(r.layer), int(r.offset) - lo] = r.share
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


CONSTRUCTION_STYLE = {"prefill": {"color": "#CC79A7", "marker": "o"}, "chunked": {"color": "#009E73", "marker": "s"},
                      "prefix_cached": {"color": "#E69F00", "marker": "^"},
                      "incremental": {"color": "#56B4E9", "marker": "D"}}


def _construction_style(name: str) -> dict:
    return CONSTRUCTION_STYLE.get(name, {"color": "0.4", "marker": "v"})


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


def plot_split_predictors(items: pd.DataFrame, paths: dict[str, str], revision_order=(), **_) -> None:
    """Figure 10: per revision and precision (one row of panels each), items' smallest live margin against their
    largest logit difference (split items filled; left), and the share of items split within the first k suffix
    tokens with pointwise Wilson intervals (right)."""
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
            for construction in constructions:
                style = _construction_style(construction)
                g = panel[panel["construction"] == construction]
                if g.empty:
                    continue
                split = g["split"].astype(bool)
                scatter.scatter(g.loc[~split, "max_logit_diff"], g.loc[~split, "min_margin_reference"], s=10,
                                marker=style["marker"], facecolors="none", edgecolors=style["color"],
                                linewidths=0.6, clip_on=False, zorder=2)
                # split items above every construction's unsplit ones, which would otherwise hide them
                scatter.scatter(g.loc[split, "max_logit_diff"], g.loc[split, "min_margin_reference"], s=10,
                                marker=style["marker"], color=style["color"], linewidths=0, clip_on=False, zorder=3)
                curve = share_by_position(list(g["first_divergence"]), len(g), positions)
                k = np.asarray(curve["positions"])
                curve_ax.fill_between(k, 100 * np.asarray(curve["wilson_low"], dtype=float),
                                      100 * np.asarray(curve["wilson_high"], dtype=float), step="post",
                                      color=style["color"], alpha=0.15, lw=0)
                curve_ax.step(k, 100 * np.asarray(curve["rate"], dtype=float), where="post", color=style["color"],
                              lw=1.0)
            for axis, column in (("x", "max_logit_diff"), ("y", "min_margin_reference")):
                values = panel[column].to_numpy(dtype=float)
                if np.any(values > 0):
                    getattr(scatter, f"set_{axis}scale")("symlog", linthresh=symlog_threshold(values), linscale=0.6)
                getattr(scatter, f"set_{axis}lim")(0, 2 * float(np.max(values)) if np.any(values > 0) else 1.0)
            scatter.set_ylabel("smallest live margin")
            curve_ax.set_xlim(1, positions)
            curve_ax.set_ylim(0, 100)
            curve_ax.xaxis.get_major_locator().set_params(integer=True)
            curve_ax.set_ylabel("items split within k (%)")
            panel_title(scatter, f"{revision} · {precision}" if len(revisions) > 1 else precision, True)
        axes[-1][0].set_xlabel("largest max-abs logit diff")
        axes[-1][1].set_xlabel("suffix position k")
        handles = [Line2D([], [], ls="", marker=_construction_style(c)["marker"], color=_construction_style(c)["color"],
                          label=c) for c in constructions]
        handles += [Line2D([], [], ls="", marker="o", color="0.3", label="split"),
                    Line2D([], [], ls="", marker="o", mfc="none", mec="0.3", label="not split"),
                    Patch(facecolor="0.3", alpha=0.15, label="Wilson 95%")]
        fig.legend(handles=handles, loc="outside lower center", ncol=3, handlelength=1.2, columnspacing=1.0)
        save_figure(fig, paths)


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
    fidelity = _read_all(inputs.get("fidelity"))
    return {
        "fig1_disagreement": analysis.disagreement_cells(pairs) if pairs is not None else None,
        "fig2_first_divergence": pairs,
        "fig3_margins": analysis.margin_pairs(ledger, pairs, skip=skip) if pairs is not None else None,
        "fig4_cache_differences": analysis.cache_difference_profile(differences),
        "fig5_transplant": analysis.transplant_matrix(transplant),
        "fig6_accuracy": analysis.accuracy_differences(pairs, seed=seed) if pairs is not None else None,
        "fig7_minimal_transplant": minimal_coverage(_read_all(inputs.get("minimal_transplant"))),
        "fig8_divergence_onset": _read_all(inputs.get("divergence_onset")),
        "fig9_fidelity": fidelity,
        "fig10_split_predictors": items_of_files(inputs.get("fidelity")),
        "coinciding": coinciding,
    }


PLOTTERS = {
    "fig1_disagreement": plot_disagreement,
    "fig2_first_divergence": plot_first_divergence,
    "fig3_margins": plot_margins,
    "fig4_cache_differences": plot_cache_differences,
    "fig5_transplant": plot_transplant,
    "fig6_accuracy": plot_accuracy,
    "fig7_minimal_transplant": plot_minimal_transplant,
    "fig8_divergence_onset": plot_divergence_onset,
    "fig9_fidelity": plot_fidelity,
    "fig10_split_predictors": plot_split_predictors,
}


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
