"""The one style of the paper figures (and the comparison's), the layout helpers they share and how they are written.

A single column's width (:data:`WIDTH`, 3.4 in), 7-pt type (:data:`STYLE`, used as an ``rc_context``), the
Okabe-Ito colours (one per precision, :data:`COLORS`) with a marker and line style per experiment
(:data:`EXPERIMENT_STYLE`) or cache component (:data:`COMPONENT_STYLE`) so that series stay apart in greyscale and
where they coincide, fonts embedded in the PDF as TrueType (``pdf.fonttype`` 42). The helpers order revisions and
panels the same way in every figure, stack panels at the column's width and break a long name into lines that fit
the room it has; :func:`save_figure` writes a figure reproducibly, :func:`placeholder_figure` writes one that says
which input it waits for. This module draws no figure of its own: the figure modules do.
matplotlib runs on the Agg backend.
"""

from __future__ import annotations

import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402

from stagereplay.analysis import tables as analysis  # noqa: E402
from stagereplay.io.parquet import atomic_path  # noqa: E402

# Okabe-Ito: apart in colour-blind reading; markers and line styles keep series apart in greyscale.
COLORS = {"bf16": "#0072B2", "fp32": "#D55E00", "fp16": "#009E73", "reference": "#000000"}
EXPERIMENT_STYLE = {"matched": {"marker": "o", "ls": "-", "hatch": None},
                    "fixed_prefix": {"marker": "s", "ls": "--", "hatch": "////"}}
EXPERIMENT_NAMES = {"matched": "matched", "fixed_prefix": "fixed-prefix"}
COMPONENT_STYLE = {"k": {"marker": "o", "ls": "-", "filled": True, "dx": -0.12},
                   "v": {"marker": "s", "ls": "--", "filled": False, "dx": 0.12}}

WIDTH = 3.4  # inches: one column of a two-column paper
STYLE = {
    "font.size": 7, "axes.titlesize": 7, "axes.labelsize": 7, "xtick.labelsize": 6.5, "ytick.labelsize": 6.5,
    "legend.fontsize": 6.5, "axes.spines.top": False, "axes.spines.right": False, "axes.linewidth": 0.6,
    "xtick.major.width": 0.6, "ytick.major.width": 0.6, "lines.linewidth": 1.0, "lines.markersize": 3.5,
    "savefig.dpi": 300, "pdf.fonttype": 42, "ps.fonttype": 42, "figure.constrained_layout.use": True,
    "legend.frameon": False, "font.family": "DejaVu Sans", "hatch.linewidth": 0.6,
}


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


def error_lengths(centre: float, low: float, high: float) -> list[list[float]]:
    """Error-bar lengths; clipped at 0 because a clipped interval end can sit a rounding error inside the point."""
    return [[max(0.0, centre - low)], [max(0.0, high - centre)]]


def revision_key(order):
    """Sort key of revisions: the config's ``order`` first, any other after it by name."""
    order = list(order)
    return lambda revision: (order.index(revision), "") if revision in order else (len(order), revision)


def ordered_revisions(frame: pd.DataFrame, order) -> list[str]:
    return sorted(frame["revision"].unique(), key=revision_key(order))


def panel_keys(frame: pd.DataFrame, order) -> list[tuple[str, str]]:
    """(revision, precision) panels in the config's revision order and bf16, fp16, fp32 order."""
    keys = frame[["revision", "precision"]].drop_duplicates().itertuples(index=False, name=None)
    precisions = analysis.sort_precisions(frame["precision"])
    by_revision = revision_key(order)
    return sorted(keys, key=lambda k: (by_revision(k[0]), precisions.index(k[1])))


def stacked_axes(n: int, height: float, sharex: bool = False):
    """``n`` panels stacked in one column at the column's width; ``height`` is per panel."""
    fig, axes = plt.subplots(n, 1, figsize=(WIDTH, height * n), sharex=sharex, squeeze=False)
    return fig, [row[0] for row in axes]


def text_width(fig, text: str, size: float) -> float:
    """Inches that ``text`` (one line) takes in ``fig`` at ``size`` points, in the figures' font."""
    prop = FontProperties(family=STYLE["font.family"], size=size)
    return fig.canvas.get_renderer().get_text_width_height_descent(text, prop, ismath=False)[0] / fig.dpi


def line_height(fig, size: float) -> float:
    """Inches that one more line of text takes in ``fig`` at ``size`` points (matplotlib's line spacing, 1.2)."""
    prop = FontProperties(family=STYLE["font.family"], size=size)
    return 1.2 * fig.canvas.get_renderer().get_text_width_height_descent("lp", prop, ismath=False)[1] / fig.dpi


def wrap_to_width(fig, text: str, inches: float, size: float) -> str:
    """``text`` in as few lines as keep each within ``inches`` at ``size`` points: broken at spaces and hyphens,
    and inside a word (a long revision name) only where a word alone is wider."""
    for chars in range(len(text), 0, -1):
        lines = textwrap.wrap(text, chars)
        if all(text_width(fig, line, size) <= inches for line in lines):
            return "\n".join(lines)
    return "\n".join(lines)


def panel_title(ax, text: str, many: bool) -> None:
    """A panel's name (revision, precision), only where there is more than one panel to tell apart."""
    if many:
        ax.set_title(text, loc="left")


def drop_coinciding(frame: pd.DataFrame, coinciding) -> pd.DataFrame:
    """Rows of fixed-prefix cells that repeat the matched cells (shown once, as matched)."""
    if frame is None or frame.empty or not coinciding:
        return frame
    keep = [not (r.experiment == "fixed_prefix" and (r.revision, r.precision) in coinciding)
            for r in frame[["experiment", "revision", "precision"]].itertuples(index=False)]
    return frame[keep]


def symlog_threshold(values: np.ndarray) -> float:
    positive = values[np.isfinite(values) & (values > 0)]
    return float(10 ** np.floor(np.log10(positive.min()))) if positive.size else 1e-3


def label_coinciding(ax, points: pd.DataFrame, x: str, y: str, color) -> None:
    """Write ``×k`` beside a point on which k > 1 rows of ``points`` fall (bf16 values are coarse: items coincide)."""
    for (px, py), n in points.groupby([x, y]).size().items():
        if n > 1:
            ax.annotate(f"×{n}", (px, py), xytext=(4, 3), textcoords="offset points", fontsize=5.5, color=color)


def dodge(index: int, count: int, width: float = 0.3) -> float:
    """Horizontal offset of series ``index`` of ``count`` drawn on integer positions, centred on 0 and at most
    ``width`` apart end to end, so that series with equal values stay visible side by side."""
    return 0.0 if count < 2 else (index / (count - 1) - 0.5) * width
