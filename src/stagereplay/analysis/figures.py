"""The paper figures, as PDF and PNG, from the tidy tables of :mod:`stagereplay.analysis`.

Six figures (issue 5): (1) suffix disagreement rate per construction x precision cell, (2) first-divergence
positions, (3) top-2 margins at the first divergence against all decode steps, (4) per-layer differences between
constructions' boundary caches, (5) the transplant outcome matrix, (6) paired accuracy differences with their CIs.
A figure whose input is absent or empty is still written, saying which input it waits for, so the pipeline never
stops on a stage that has not run.

This module knows nothing of torch or Snakemake: :func:`plot_figures` takes paths, the figure functions take
DataFrames. matplotlib runs on the Agg backend.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from stagereplay.analysis import tables as analysis  # noqa: E402
from stagereplay.io.parquet import atomic_path, read_parquet  # noqa: E402

FIGURES = {
    "fig1_disagreement": "suffix disagreement per construction x precision cell",
    "fig2_first_divergence": "first-divergence positions",
    "fig3_margins": "top-2 logit margins at the first divergence",
    "fig4_cache_differences": "per-layer cache differences at the boundary",
    "fig5_transplant": "transplant outcome matrix",
    "fig6_accuracy": "paired accuracy differences",
}
FORMATS = ("pdf", "png")

# Okabe-Ito: tells apart in colour-blind reading and stays distinct in greyscale print through the markers.
COLORS = {"bf16": "#0072B2", "fp32": "#D55E00", "fp16": "#009E73", "k": "#0072B2", "v": "#D55E00",
          "matched": "#0072B2", "fixed_prefix": "#E69F00", "reference": "#000000"}
MARKERS = {"matched": "o", "fixed_prefix": "s", "bf16": "o", "fp32": "s", "fp16": "^"}
# The reference study's numbers that have a place on a figure (DESIGN.md's table).
REFERENCE_DISAGREEMENT = {("matched", "bf16"): (166, 200), ("fixed_prefix", "fp32"): (0, 200)}
REFERENCE_ACCURACY = {"difference": 0.01, "low": -0.035, "high": 0.055}

STYLE = {
    "font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "xtick.labelsize": 7, "ytick.labelsize": 7,
    "legend.fontsize": 7, "axes.spines.top": False, "axes.spines.right": False, "savefig.dpi": 200,
    "pdf.fonttype": 42, "figure.constrained_layout.use": True,
}
WIDTH = 6.75  # inches: a two-column paper's full text width


def _save(fig, paths: dict[str, str]) -> None:
    """Write ``fig`` to each format's path atomically. A tight bounding box keeps a long title on a narrow figure;
    metadata without dates keeps the PDF reproducible."""
    for fmt, path in paths.items():
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt, bbox_inches="tight", pad_inches=0.05, metadata={"CreationDate": None} if fmt == "pdf" else {"Software": None})
    plt.close(fig)


def _err(centre: float, low: float, high: float) -> list[list[float]]:
    """Error-bar lengths; clipped at 0 because a clipped interval end can sit a rounding error inside the point."""
    return [[max(0.0, centre - low)], [max(0.0, high - centre)]]


def _placeholder(paths: dict[str, str], title: str, message: str) -> None:
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(WIDTH, 1.6))
        ax.set_axis_off()
        ax.set_title(title, loc="left", fontweight="bold")
        ax.text(0.5, 0.45, message, ha="center", va="center", wrap=True, fontsize=9, color="0.3",
                transform=ax.transAxes)
        _save(fig, paths)


def _revision_key(order):
    """Sort key of revisions: the config's ``order`` first, any other after it by name."""
    order = list(order)
    return lambda revision: (order.index(revision), "") if revision in order else (len(order), revision)


def _revisions(frame: pd.DataFrame, order) -> list[str]:
    return sorted(frame["revision"].unique(), key=_revision_key(order))


def _panel_keys(frame: pd.DataFrame, order) -> list[tuple[str, str]]:
    """(revision, precision) panels in the config's revision order and bf16, fp16, fp32 order."""
    keys = frame[["revision", "precision"]].drop_duplicates().itertuples(index=False, name=None)
    precisions = analysis.sort_precisions(frame["precision"])
    by_revision = _revision_key(order)
    return sorted(keys, key=lambda k: (by_revision(k[0]), precisions.index(k[1])))


def _panels(n: int, height: float, width: float = WIDTH, sharey: bool = True, max_columns: int = 3):
    """``n`` panels, at most ``max_columns`` to a row; ``height`` is per row. Unused grid cells are hidden."""
    columns = min(n, max_columns)
    rows = -(-n // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(width, height * rows), sharey=sharey, squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _width(n: int, per_panel: float = 2.8, extra: float = 1.2) -> float:
    """Figure width for ``n`` panels in rows of at most three: at least 4.8 in, at most the text width."""
    return max(4.8, min(WIDTH, extra + per_panel * min(n, 3)))


def plot_disagreement(cells: pd.DataFrame, paths: dict[str, str], revision_order=()) -> None:
    """Figure 1: per revision, the rate of suffix disagreement between the constructions of each experiment, per
    precision, with Wilson 95% intervals and k/n on each bar; the reference study's values as open markers."""
    title = "Figure 1. Suffix disagreement between constructions"
    if cells is None or cells.empty:
        return _placeholder(paths, title, "No data yet for figure 1: the ledger holds no compared items "
                            "(matched or fixed-prefix experiment with status ok on both constructions).")
    revisions = _revisions(cells, revision_order)
    experiments = [e for e, *_ in analysis.COMPARISONS if e in set(cells["experiment"])]
    precisions = analysis.sort_precisions(cells["precision"])
    with plt.rc_context(STYLE):
        fig, axes = _panels(len(revisions), 2.6, width=_width(len(revisions)))
        width = min(0.35, 0.8 / len(experiments))
        for ax, revision in zip(axes, revisions):
            sub = cells[cells["revision"] == revision]
            for j, experiment in enumerate(experiments):
                for i, precision in enumerate(precisions):
                    x = i + (j - (len(experiments) - 1) / 2) * width
                    row = sub[(sub["experiment"] == experiment) & (sub["precision"] == precision)]
                    ref = REFERENCE_DISAGREEMENT.get((experiment, precision))
                    if ref is not None:
                        ax.plot(x, ref[0] / ref[1], marker="D", mfc="none", mec=COLORS["reference"], ms=6, ls="none",
                                zorder=4, label="reference study")
                    if row.empty:
                        ax.text(x, 0.01, "not run", rotation=90, ha="center", va="bottom", fontsize=6, color="0.5")
                        continue
                    r = row.iloc[0]
                    ax.bar(x, r["rate"], width * 0.9, color=COLORS[experiment], alpha=0.85,
                           label=analysis.COMPARISON_LABELS[experiment])
                    ax.errorbar(x, r["rate"], yerr=_err(r["rate"], r["wilson_low"], r["wilson_high"]),
                                color="black", capsize=3, lw=0.8)
                    ax.text(x, -0.02, f"{r['k']}/{r['n']}", ha="center", va="top", fontsize=6.5,
                            transform=ax.get_xaxis_transform())
            ax.set_xticks(range(len(precisions)), precisions)
            ax.tick_params(axis="x", length=0, pad=12)
            ax.set_xlim(-0.6, len(precisions) - 0.4)
            ax.set_ylim(0, 1.08)
            ax.set_title(f"revision {revision}", loc="left")
            ax.set_xlabel("precision")
        axes[0].set_ylabel("suffixes that differ (share of items)")
        handles, labels = axes[0].get_legend_handles_labels()
        for ax in axes[1:]:
            h, l_ = ax.get_legend_handles_labels()
            handles, labels = handles + h, labels + l_
        unique = dict(zip(labels, handles))
        labels = {("this run, " + k if k != "reference study" else k): v for k, v in unique.items()}
        fig.legend(labels.values(), labels.keys(), loc="outside lower center", ncol=min(2, len(labels)),
                   frameon=False)
        fig.suptitle(title, x=0.01, ha="left",
                     fontweight="bold", fontsize=8)
        _save(fig, paths)


def plot_first_divergence(pairs: pd.DataFrame, paths: dict[str, str], revision_order=()) -> None:
    """Figure 2: ECDF of the first-divergence position (suffix token index) among disagreeing items, per precision
    (colour) and experiment (line style), one panel per revision; the x axis spans the longest compared suffix."""
    title = "Figure 2. Where suffixes first diverge"
    div = pairs[pairs["disagree"]] if pairs is not None and not pairs.empty else None
    if div is None or div.empty:
        return _placeholder(paths, title, "No data yet for figure 2: no compared pair of suffixes disagrees "
                            "(needs a ledger with disagreeing constructions).")
    revisions = _revisions(div, revision_order)
    styles = {"matched": "-", "fixed_prefix": "--"}
    with plt.rc_context(STYLE):
        fig, axes = _panels(len(revisions), 2.5, width=_width(len(revisions)))
        for ax, revision in zip(axes, revisions):
            sub = div[div["revision"] == revision]
            for (experiment, precision), g in sub.groupby(["experiment", "precision"], sort=True):
                x = np.sort(g["first_divergence"].to_numpy(dtype=float))
                y = np.arange(1, x.size + 1) / x.size
                ax.step(np.concatenate([[0], x]), np.concatenate([[0], y]), where="post",
                        color=COLORS.get(precision, "0.3"), ls=styles.get(experiment, ":"), marker="o", ms=2.5,
                        markevery=list(range(1, x.size + 1)),
                        label=f"{analysis.COMPARISON_LABELS.get(experiment, experiment)}, {precision} (n={x.size})")
            ax.set_title(f"revision {revision}", loc="left")
            ax.set_xlabel("first-divergence position (suffix token)")
            ax.set_ylim(0, 1.02)
            # The axis spans the whole suffix, so early and late divergences read at their place in it.
            longest = pairs.loc[pairs["revision"] == revision, ["suffix_length_a", "suffix_length_b"]].to_numpy().max()
            ax.set_xlim(0, max(float(longest), float(sub["first_divergence"].max()) + 1))
            ax.legend(frameon=False, loc="lower right")
        axes[0].set_ylabel("share of disagreeing items (ECDF)")
        fig.suptitle(title, x=0.01, ha="left", fontweight="bold", fontsize=8)
        _save(fig, paths)


def plot_margins(margins: pd.DataFrame, paths: dict[str, str], revision_order=()) -> None:
    """Figure 3: ECDF of the reference construction's top-2 logit margin at every decode step against the margin at
    each first divergence (symmetric-log axis, so exact ties at 0 stay visible), one panel per revision x precision."""
    title = "Figure 3. Are divergences near-ties? Top-2 logit margins"
    if margins is None or margins.empty or not (margins["kind"] == "divergence").any():
        return _placeholder(paths, title, "No data yet for figure 3: no first divergence to place among the "
                            "decode-step margins (needs disagreeing suffixes in the ledger).")
    panels = _panel_keys(margins[margins["kind"] == "divergence"], revision_order)
    positive = margins["margin"][margins["margin"] > 0]
    linthresh = float(10 ** np.floor(np.log10(positive.min()))) if len(positive) else 1e-3
    with plt.rc_context(STYLE):
        fig, axes = _panels(len(panels), 2.5, width=_width(len(panels)))
        for ax, (revision, precision) in zip(axes, panels):
            sub = margins[(margins["revision"] == revision) & (margins["precision"] == precision)]
            for (experiment, kind), g in sub.groupby(["experiment", "kind"], sort=True):
                x = np.sort(g["margin"].to_numpy(dtype=float))
                if not x.size:
                    continue
                y = np.arange(1, x.size + 1) / x.size
                label = (f"{'first divergence' if kind == 'divergence' else 'all decode steps'}, "
                         f"{experiment.replace('_', '-')} (n={x.size})")
                divergence = kind == "divergence"
                # Each divergence is also drawn as a point: there are few, and a jump at 0 would hide on the spine.
                ax.step(x, y, where="post", lw=1.6 if divergence else 1.0, color=COLORS["v"] if divergence else "0.45",
                        ls="-" if experiment == "matched" else "--", marker="o" if divergence else None, ms=3,
                        clip_on=False, label=label)
            ax.set_xscale("symlog", linthresh=linthresh)
            ax.set_xlim(left=0)
            ax.set_ylim(0, 1.02)
            ax.set_title(f"revision {revision}, {precision}", loc="left")
            ax.set_xlabel("top-2 logit margin (reference construction)")
            ax.legend(frameon=False, loc="upper left")
        axes[0].set_ylabel("cumulative share")
        fig.suptitle(title, x=0.01, ha="left", fontweight="bold", fontsize=8)
        _save(fig, paths)


def plot_cache_differences(profile: pd.DataFrame, paths: dict[str, str], revision_order=()) -> None:
    """Figure 4: per layer, the share of items whose boundary-cache bytes differ between the constructions (top) and,
    among those items, the max-abs difference (bottom: median line, 10th-90th percentile band), K solid and V dashed,
    one colour per precision, one column per revision."""
    title = "Figure 4. Per-layer cache differences, incremental vs prefill"
    if profile is None or profile.empty:
        return _placeholder(paths, title, "No data yet for figure 4: cache_differences.parquet is absent or empty "
                            "(rule measure_cache_differences).")
    revisions = _revisions(profile, revision_order)
    precisions = analysis.sort_precisions(profile["precision"])
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, len(revisions), figsize=(max(4.8, min(WIDTH, 1.4 + 3.0 * len(revisions))), 4.4),
                                 sharex=True, sharey="row", squeeze=False)
        for col, revision in enumerate(revisions):
            sub = profile[profile["revision"] == revision]
            top, bottom = axes[0][col], axes[1][col]
            for precision in precisions:
                for component, style in (("k", "-"), ("v", "--")):
                    g = sub[(sub["precision"] == precision) & (sub["component"] == component)].sort_values("layer")
                    if g.empty:
                        continue
                    color = COLORS.get(precision, "0.3")
                    kw = dict(ls=style, marker=MARKERS.get(precision, "o"), color=color, ms=3.5,
                              mfc=color if component == "k" else "white")
                    top.plot(g["layer"], g["share_differ"], label=f"{precision} {component.upper()} "
                             f"(n={int(g['n'].max())} items)", **kw)
                    med = g["max_abs_median"].to_numpy(dtype=float)  # NaN where no item differs
                    bottom.plot(g["layer"], med, **kw)
                    bottom.fill_between(g["layer"], g["max_abs_p10"].to_numpy(dtype=float),
                                        g["max_abs_p90"].to_numpy(dtype=float), color=color, alpha=0.12, lw=0)
            top.set_ylim(-0.03, 1.03)
            top.set_title(f"revision {revision}", loc="left")
            spread = sub[["max_abs_median", "max_abs_p10", "max_abs_p90"]].to_numpy(dtype=float)
            if np.any(np.isfinite(spread) & (spread > 0)):
                bottom.set_yscale("log")
            else:  # no layer differs in any item (numerics: invariant): nothing to put on a log axis
                bottom.text(0.5, 0.5, "no layer differs", transform=bottom.transAxes, ha="center", va="center")
            bottom.set_xlabel("layer")
            bottom.xaxis.get_major_locator().set_params(integer=True)
        axes[0][0].set_ylabel("share of items whose\nlayer bytes differ")
        axes[1][0].set_ylabel("max |Δ| among those items")
        handles, labels = axes[0][0].get_legend_handles_labels()
        for ax in axes[0][1:]:
            h, l_ = ax.get_legend_handles_labels()
            handles, labels = handles + h, labels + l_
        unique = dict(zip(labels, handles))
        fig.legend(unique.values(), unique.keys(), loc="outside lower center", ncol=2, frameon=False,
                   handlelength=3)
        fig.suptitle(title, x=0.01, ha="left", fontweight="bold", fontsize=8)
        _save(fig, paths)


def plot_transplant(matrix: pd.DataFrame, paths: dict[str, str], revision_order=()) -> None:
    """Figure 5: share of transplanted continuations that follow their cache donor, per layer set / component /
    positions (rows) and direction (columns), one panel per revision and precision, with k/n in each cell."""
    title = "Figure 5. Transplants: share of continuations following the cache donor"
    if matrix is None or matrix.empty:
        return _placeholder(paths, title, "No data yet for figure 5: transplant.parquet is absent or empty "
                            "(the transplant stage has not run).")
    panels = _panel_keys(matrix, revision_order)
    n_rows = matrix["label"].nunique()
    with plt.rc_context(STYLE):
        fig, axes = _panels(len(panels), 0.9 + 0.22 * n_rows, width=_width(len(panels), 2.4, 2.2),
                            sharey=False)
        image = None
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
                ax.text(j, i, f"{r.donor}/{r.n}", ha="center", va="center", fontsize=6.5,
                        color="white" if (r.rate or 0) > 0.6 else "black")
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="Blues", aspect="auto")
            ax.set_xticks(range(len(directions)), directions, rotation=20, ha="right")
            ax.set_yticks(range(len(labels)), labels)
            ax.set_title(f"revision {revision}, {precision}", loc="left")
            ax.spines[:].set_visible(False)
        fig.colorbar(image, ax=axes, label="share following donor", shrink=0.8)
        fig.suptitle(title, x=0.01, ha="left", fontweight="bold", fontsize=8)
        _save(fig, paths)


def plot_accuracy(differences: pd.DataFrame, paths: dict[str, str], revision_order=()) -> None:
    """Figure 6: accuracy of the reference construction minus the other's, in points, with the paired bootstrap 95%
    CI, one row per revision x experiment x precision; the reference study's matched bf16 result on top."""
    title = "Figure 6. Paired accuracy difference between constructions"
    if differences is None or differences.empty:
        return _placeholder(paths, title, "No data yet for figure 6: no compared items with correctness labels "
                            "in the ledger.")
    rows = differences.assign(
        _r=differences["revision"].map(_revision_key(revision_order)),
        _e=differences["experiment"].map(lambda e: [c[0] for c in analysis.COMPARISONS].index(e)
                                         if e in [c[0] for c in analysis.COMPARISONS] else 99),
        _p=differences["precision"].map(lambda p: analysis.sort_precisions(differences["precision"]).index(p)),
    ).sort_values(["_r", "_e", "_p"]).reset_index(drop=True)
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(WIDTH, 0.9 + 0.28 * (len(rows) + 1)))
        labels = ["reference study · live − prefill · bf16 (n=200)"]
        ref = REFERENCE_ACCURACY
        ax.errorbar(100 * ref["difference"], 0, xerr=_err(100 * ref["difference"], 100 * ref["low"], 100 * ref["high"]),
                    fmt="D", mfc="none", color=COLORS["reference"], capsize=3, lw=1)
        for i, r in enumerate(rows.itertuples(index=False), start=1):
            ax.errorbar(100 * r.difference, i, xerr=_err(100 * r.difference, 100 * r.bootstrap_low, 100 * r.bootstrap_high),
                        fmt=MARKERS.get(r.experiment, "o"), color=COLORS.get(r.precision, "0.3"), capsize=3, lw=1)
            labels.append(f"{r.revision} · {analysis.SHORT_LABELS.get(r.experiment, r.experiment)} · {r.precision} "
                          f"(n={r.n})")
        ax.axvline(0, color="0.6", lw=0.8, zorder=0)
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlabel("accuracy difference (points) with paired bootstrap 95% CI")
        fig.suptitle(title, x=0.01, ha="left", fontweight="bold", fontsize=8)
        _save(fig, paths)


def _read_all(paths: dict[str, str] | None) -> pd.DataFrame | None:
    """Concatenate the existing files of one kind (revision -> path, in the config's order); None when none exists."""
    frames = [read_parquet(p) for p in (paths or {}).values() if p and Path(p).is_file()]
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else None


def tables(inputs: dict[str, dict[str, str]], seed: int = 0) -> dict[str, pd.DataFrame | None]:
    """The figures' tables from ``inputs`` (kind -> revision -> path; absent kinds and files are fine)."""
    ledger = _read_all(inputs.get("ledger"))
    pairs = analysis.all_pairs(ledger) if ledger is not None else None
    differences = _read_all(inputs.get("cache_differences"))
    transplant = _read_all(inputs.get("transplant"))
    return {
        "fig1_disagreement": analysis.disagreement_cells(pairs) if pairs is not None else None,
        "fig2_first_divergence": pairs,
        "fig3_margins": analysis.margin_samples(ledger, pairs) if pairs is not None else None,
        "fig4_cache_differences": analysis.cache_difference_profile(differences),
        "fig5_transplant": analysis.transplant_matrix(transplant),
        "fig6_accuracy": analysis.accuracy_differences(pairs, seed=seed) if pairs is not None else None,
    }


PLOTTERS = {
    "fig1_disagreement": plot_disagreement,
    "fig2_first_divergence": plot_first_divergence,
    "fig3_margins": plot_margins,
    "fig4_cache_differences": plot_cache_differences,
    "fig5_transplant": plot_transplant,
    "fig6_accuracy": plot_accuracy,
}


def plot_figures(inputs: dict[str, dict[str, str]], outputs: dict[str, dict[str, str]] | str, seed: int = 0) -> list[str]:
    """Write the figures. ``outputs`` maps a figure's name (a key of :data:`FIGURES`) to {format: path}, or is a
    folder where every figure goes as ``<name>.pdf`` and ``<name>.png``. Returns the paths written."""
    if isinstance(outputs, (str, Path)):
        outputs = {name: {fmt: str(Path(outputs) / f"{name}.{fmt}") for fmt in FORMATS} for name in FIGURES}
    unknown = sorted(set(outputs) - set(FIGURES))
    if unknown:
        raise ValueError(f"unknown figures {unknown}; the figures are {sorted(FIGURES)}")
    data = tables(inputs, seed)
    order = list((inputs.get("ledger") or {}).keys())
    written = []
    for name, paths in outputs.items():
        PLOTTERS[name](data[name], paths, revision_order=order)
        written += paths.values()
    return written
