"""The paper figures: every figure is written as a real PDF and PNG, from small synthetic results and from nothing."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import matplotlib.text
import pandas as pd
import pytest

from report_data import (synthetic_cache_differences, synthetic_fidelity, synthetic_ledger, synthetic_minimal_transplant,
                         synthetic_onset, synthetic_transplant, write)
from stagereplay.analysis import cache_figures, captions, fidelity_figures, figures, ledger_figures, study
from stagereplay.analysis import tables as analysis

REPO = Path(__file__).resolve().parents[1]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_figure_files(paths):
    for fmt, path in paths.items():
        data = open(path, "rb").read()
        assert len(data) > 1000, path
        assert data.startswith(PNG_MAGIC if fmt == "png" else b"%PDF-"), path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("results")
    kinds = {"ledger": synthetic_ledger, "transplant": synthetic_transplant,
             "cache_differences": synthetic_cache_differences, "minimal_transplant": synthetic_minimal_transplant,
             "divergence_onset": synthetic_onset, "fidelity": synthetic_fidelity}
    return {kind: {rev: write(make(rev), d / f"{rev}_{kind}.parquet") for rev in ("primary", "later")}
            for kind, make in kinds.items()}


@pytest.fixture(scope="module")
def tables(inputs):
    return figures.tables(inputs)


@pytest.mark.parametrize("name", list(figures.FIGURES))
def test_each_figure_is_written_from_data(name, tables, tmp_path):
    paths = {fmt: str(tmp_path / f"{name}.{fmt}") for fmt in figures.FORMATS}
    assert tables[name] is not None and not tables[name].empty
    figures.PLOTTERS[name](tables[name], paths, revision_order=["primary", "later"], coinciding=tables["coinciding"])
    assert_figure_files(paths)


def test_every_figure_says_no_data_yet_when_its_input_is_absent(tmp_path):
    # No input at all: some tables are None (no ledger), others empty frames (no transplant or cache file).
    written = figures.plot_figures({"ledger": {"primary": str(tmp_path / "absent.parquet")}}, str(tmp_path / "figs"))
    assert sorted(p.rsplit("/", 1)[1] for p in written) == sorted(
        f"{name}.{fmt}" for name in figures.FIGURES for fmt in figures.FORMATS)
    for path in written:
        assert_figure_files({path.rsplit(".", 1)[1]: path})


def test_plot_figures_refuses_an_unknown_figure(inputs, tmp_path):
    with pytest.raises(ValueError, match="fig9"):
        figures.plot_figures(inputs, {"fig9_nothing": {"png": str(tmp_path / "x.png")}})


def test_pdf_output_is_reproducible(tables, tmp_path):
    a, b = tmp_path / "a.pdf", tmp_path / "b.pdf"
    ledger_figures.plot_disagreement(tables["fig1_disagreement"], {"pdf": str(a)})
    ledger_figures.plot_disagreement(tables["fig1_disagreement"], {"pdf": str(b)})
    assert a.read_bytes() == b.read_bytes()


def test_figure_tables_hold_what_the_ledger_says(tables):
    cells = tables["fig1_disagreement"]
    # The synthetic ledger never diverges in fp32 and excludes 2 matched items (no boundary; non-finite prefill).
    fp32 = cells[(cells["experiment"] == "fixed_prefix") & (cells["precision"] == "fp32")]
    assert set(fp32["k"]) == {0} and set(fp32["n"]) == {39}
    matched = cells[cells["experiment"] == "matched"]
    assert set(matched["n"]) == {38} and set(matched["precision"]) == {"bf16"}
    matrix = tables["fig5_transplant"]
    full = matrix[(matrix["layer_set"] == "all") & (matrix["component"] == "kv") & (matrix["positions"] == "all")]
    assert set(full["rate"]) == {1.0} and set(full["n"]) == {6}


def test_figures_and_analysis_know_nothing_of_torch():
    code = "import sys, stagereplay.analysis.figures, stagereplay.analysis.tables; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cache_differences_figure_when_no_layer_differs(tmp_path):
    """Under numerics: invariant every cache is bit-identical: the figure says so instead of failing on a log axis."""
    from stagereplay.analysis import tables as analysis

    equal = synthetic_cache_differences().assign(bit_equal=True, max_abs=0.0, rms=0.0, first_position_differs=None)
    paths = {fmt: str(tmp_path / f"fig4.{fmt}") for fmt in figures.FORMATS}
    figures.PLOTTERS["fig4_cache_differences"](analysis.cache_difference_profile(equal), paths)
    assert_figure_files(paths)


# --- ready for a paper --------------------------------------------------------------------------------------------

@pytest.fixture
def drawn(monkeypatch):
    """Call a plotter and get its matplotlib figure back instead of files."""
    kept = []
    for module in (ledger_figures, cache_figures, fidelity_figures):
        monkeypatch.setattr(module, "save_figure", lambda fig, paths: kept.append(fig))

    def draw(name, table, **kw):
        figures.PLOTTERS[name](table, {}, **kw)
        return kept[-1]
    return draw


def texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]


def legend_labels(fig) -> list[str]:
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
    return [t.get_text() for legend in legends for t in legend.get_texts()]


@pytest.mark.parametrize("name", list(figures.FIGURES))
def test_no_figure_number_or_title_is_drawn_and_the_width_is_one_column(name, tables, drawn):
    fig = drawn(name, tables[name], revision_order=["primary", "later"], coinciding=tables["coinciding"])
    assert not [t for t in texts(fig) if re.match(r"Figure \d", t)]
    assert not fig._suptitle
    assert fig.get_size_inches()[0] == pytest.approx(3.4)
    for legend in [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends):
        labels = [t.get_text() for t in legend.get_texts()]
        assert len(labels) == len(set(labels)), labels  # no entry twice in one legend


def test_pdf_embeds_truetype_fonts(tables, tmp_path):
    path = tmp_path / "f.pdf"
    ledger_figures.plot_disagreement(tables["fig1_disagreement"], {"pdf": str(path)})
    data = path.read_bytes()
    assert b"/FontFile2" in data and b"/Type3" not in data


def coinciding_ledger():
    ledger = synthetic_ledger("primary", n_items=20, missing=(), nonfinite=())
    matched = ledger[ledger["experiment"] == "matched"]
    again = matched.assign(experiment="fixed_prefix",
                           construction=matched["construction"].replace({"live": "incremental"}))
    fp32 = ledger[(ledger["experiment"] == "fixed_prefix") & (ledger["precision"] == "fp32")]
    return pd.concat([matched, again, fp32], ignore_index=True)


@pytest.mark.parametrize("name", ["fig2_first_divergence", "fig3_margins"])
def test_a_fixed_prefix_cell_repeating_the_matched_one_is_drawn_once(name, tmp_path, drawn):
    inputs = {"ledger": {"primary": write(coinciding_ledger(), tmp_path / "ledger.parquet")}}
    data = figures.tables(inputs)
    assert set(data["coinciding"]) == {("primary", "bf16")}
    fig = drawn(name, data[name], coinciding=data["coinciding"])
    labels = legend_labels(fig)
    assert not [lab for lab in labels if lab.startswith("fixed-prefix, bf16")], labels
    assert [lab for lab in labels if lab.startswith("matched") and "bf16" in lab], labels


def test_series_of_figures_2_and_3_differ_in_more_than_colour(tables, drawn):
    fig = drawn("fig2_first_divergence", tables["fig2_first_divergence"], revision_order=["primary", "later"])
    lines = [ln for ln in fig.axes[0].get_lines() if not ln.get_label().startswith("_")]
    styles = {(ln.get_linestyle(), ln.get_marker(), ln.get_color()) for ln in lines}
    assert len(styles) == len(lines) >= 2
    fig = drawn("fig3_margins", tables["fig3_margins"], revision_order=["primary", "later"])
    handles = fig.axes[0].get_legend().legend_handles
    assert len({(getattr(h, "get_paths", lambda: None)() and str(h.get_paths()[0].vertices.tolist()),
                 str(h.get_facecolor().tolist() if hasattr(h, "get_facecolor") else h.get_color()))
                for h in handles}) == len(handles)


def test_figure_4_keeps_k_and_v_apart_and_puts_the_band_in_the_legend(drawn):
    # K and V identical: the old figure drew one on top of the other.
    differences = synthetic_cache_differences()
    v = differences[differences["component"] == "v"]
    differences.loc[v.index, ["max_abs", "rms"]] = differences.loc[v.index - 1, ["max_abs", "rms"]].to_numpy()
    fig = drawn("fig4_cache_differences", analysis.cache_difference_profile(differences))
    top = fig.axes[0]
    lines = [ln for ln in top.get_lines()]
    k = [ln for ln in lines if ln.get_marker() == "o"]
    v = [ln for ln in lines if ln.get_marker() == "s"]
    assert k and v
    assert all((kk.get_xdata() != vv.get_xdata()).all() for kk, vv in zip(k, v))  # drawn apart
    labels = legend_labels(fig)
    assert "K cache" in labels and "V cache" in labels and "10th–90th percentile" in labels


def test_figure_1_labels_each_reference_marker_and_names_it_in_the_legend(tables, drawn):
    fig = drawn("fig1_disagreement", tables["fig1_disagreement"], revision_order=["primary", "later"])
    marks = {m for t in texts(fig) for m in re.findall(r"\(study \d+/\d+\)", t)}
    # the study's count beside each cell it gives one for (here: matched bf16, fixed-prefix fp32), and a diamond
    assert marks == {f"(study {c.k}/{c.n})" for c in (study.MATCHED_DISAGREEMENTS["bf16"],
                                                      study.FIXED_PREFIX_DISAGREEMENTS["fp32"])}
    diamonds = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_marker() == "D"]
    assert len(diamonds) == 2 * 2  # two cells, two revisions
    assert "reference study" in legend_labels(fig)
    for ax in fig.axes:
        assert not ax.get_title() or ax.get_title().startswith("revision")


@pytest.mark.parametrize("name", list(captions.CAPTIONS))
def test_rst_captions_are_the_reports_captions(name):
    assert (REPO / "workflow/report" / f"{name}.rst").read_text() == captions.rst_text(name)
    assert "Figure" not in captions.CAPTIONS[name][0]


def test_figure_7_counts_each_part_of_the_minimal_sets(tables):
    coverage = tables["fig7_minimal_transplant"]
    primary = coverage[(coverage["revision"] == "primary")]
    # synthetic sets span the stage positions only (offset >= 0), all layers on even items, one layer on odd ones
    assert (primary.loc[primary["offset"] < 0, "included"] == 0).all()
    k0 = primary[(primary["component"] == "k") & (primary["layer"] == 0) & (primary["offset"] == 0)].iloc[0]
    # items 0, 2, 4 hold all layers; their components kv, v, k: K is in the sets of items 0 and 4, both directions
    assert (k0["n"], k0["included"]) == (10, 4)


def test_figure_7_scales_to_its_shares_and_marks_no_cache_apart_from_zero(tables, drawn):
    coverage = tables["fig7_minimal_transplant"]
    fig = drawn("fig7_minimal_transplant", coverage, revision_order=["primary", "later"])
    images = [image for ax in fig.axes for image in ax.get_images()]
    top = images[0].get_clim()[1]
    assert coverage["share"].max() <= top < coverage["share"].max() + 0.1 or top == 0.1  # the data's scale, not 0-1
    assert any(f"(0 to {top:g})" in ax.get_ylabel() for ax in fig.axes)  # the colour bar names its end
    panel = fig.axes[0]
    assert any(p.get_hatch() == "////" for p in panel.patches)  # no cache: hatched under the transparent NaN cells
    assert images[0].get_cmap().get_bad()[3] == 0  # NaN cells are see-through, a share of 0 is not
    cells = (coverage["layer"].max() + 1) * (coverage["offset"].max() - coverage["offset"].min() + 1)
    gaps = (coverage.groupby(["revision", "precision", "component"]).size() < cells).any()
    assert ("no cache there" in legend_labels(fig)) == gaps  # named where a panel has a cell no cache reaches


def test_figure_5_colour_bar_lies_below_a_single_panel(tables, drawn):
    one = tables["fig5_transplant"]
    one = one[(one["revision"] == "primary") & (one["precision"] == one["precision"].iloc[0])]
    fig = drawn("fig5_transplant", one)
    bar = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bar) == 1 and bar[0].get_xlabel().startswith("share following the donor")
    fig.canvas.draw()
    box = bar[0].xaxis.label.get_window_extent()
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y0 >= 0  # the whole label is on the canvas


def test_figure_5_fits_one_sweep_and_a_long_revision_name(drawn):
    """One sweep (all layers, one row per panel) and a 63-character revision: the figure had a fixed height per row,
    too short for the title, direction names and colour bar, so constrained_layout gave up and left them off the
    canvas; and the revision ran off its panel."""
    revision = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B-checkpoint-step-120000"
    assert len(revision) >= 60
    transplant = synthetic_transplant(revision)
    one_sweep = transplant[(transplant["layer_set"] == "all") & (transplant["component"] == "kv")
                           & (transplant["positions"] == "all")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = drawn("fig5_transplant", analysis.transplant_matrix(one_sweep))
        fig.canvas.draw()
    assert not [w for w in caught if "constrained_layout" in str(w.message)], [str(w.message) for w in caught]
    renderer = fig.canvas.get_renderer()
    for text in fig.findobj(matplotlib.text.Text):
        if text.get_text() and text.get_visible():
            box = text.get_window_extent(renderer)
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height, \
                (text.get_text(), box.bounds, fig.bbox.bounds)
    assert revision in fig.axes[0].get_title(loc="left").replace("\n", "")  # broken into lines, not cut


def test_figure_2_draws_equal_steps_of_two_series_side_by_side(drawn, tmp_path):
    ledger = synthetic_ledger("primary", n_items=20)
    fp32 = ledger[ledger["experiment"] == "matched"].assign(precision="fp32")  # the same divergences again
    data = figures.tables({"ledger": {"primary": write(pd.concat([ledger, fp32]), tmp_path / "l.parquet")}})
    fig = drawn("fig2_first_divergence", data["fig2_first_divergence"])
    lines = {ln.get_label(): ln.get_xdata()[1:] for ln in fig.axes[0].get_lines() if "matched" in ln.get_label()}
    bf16, fp32 = (next(x for label, x in lines.items() if p in label) for p in ("bf16", "fp32"))
    assert len(bf16) == len(fp32) and (bf16 != fp32).all() and abs(bf16 - fp32).max() <= 0.3


def test_layer_labels_read_alike_for_one_layer_and_a_band():
    assert analysis.transplant_label({"layer_set": "L4", "component": "kv"}) == "layer 4 · KV"
    assert analysis.transplant_label({"layer_set": "0-1", "component": "k"}) == "layers 0-1 · K"
    assert analysis.transplant_label({"layer_set": "all", "component": "kv", "positions": "stage"}) == \
        "layers all · KV · stage positions"


def test_figure_7_names_the_hatching_only_where_a_cell_shows_it(drawn):
    """Every item's cache reached every position drawn, yet the legend named a hatching ("no cache there") that
    appeared nowhere."""
    rows = [("primary", "bf16", component, layer, offset, 4, 1, 0.25)
            for component in ("k", "v") for layer in range(2) for offset in range(-2, 3)]
    columns = ["revision", "precision", "component", "layer", "offset", "n", "included", "share"]
    whole = pd.DataFrame(rows, columns=columns)
    assert "no cache there" not in legend_labels(drawn("fig7_minimal_transplant", whole))
    gap = whole[~((whole["component"] == "v") & (whole["layer"] == 1) & (whole["offset"] == -2))]
    assert "no cache there" in legend_labels(drawn("fig7_minimal_transplant", gap))
