"""The paper figures drawn from the ledger's compared pairs: figures 1, 2, 3 and 6.

(1) the suffix disagreement of each experiment x precision cell, (2) the first-divergence positions, (3) the top-2
margin at the first divergence against the same item's other steps, (6) the paired accuracy differences with their
CIs. Each takes its table, made from the ledger by :mod:`stagereplay.analysis.tables`, and writes PDF and PNG in
the one style of :mod:`stagereplay.analysis.figure_style`, with the reference study's values
(:mod:`stagereplay.analysis.study`) beside the run's. A figure whose table is absent or empty says which input it
waits for.

This module reads no results file (it draws the tables it is given) and knows nothing of torch or Snakemake.
matplotlib runs on the Agg backend.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from stagereplay.analysis import study  # noqa: E402
from stagereplay.analysis import tables as analysis  # noqa: E402
from stagereplay.analysis.figure_style import (COLORS, EXPERIMENT_NAMES, EXPERIMENT_STYLE, STYLE, WIDTH,  # noqa: E402
                                               dodge, drop_coinciding, error_lengths, label_coinciding,
                                               ordered_revisions, panel_title, placeholder_figure, revision_key,
                                               save_figure, stacked_axes, symlog_threshold)


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
