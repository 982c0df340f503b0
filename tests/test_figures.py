"""The paper figures: every figure is written as a real PDF and PNG, from small synthetic results and from nothing."""

import subprocess
import sys

import pytest

from report_data import synthetic_cache_differences, synthetic_ledger, synthetic_transplant, write
from stagereplay.analysis import figures

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
             "cache_differences": synthetic_cache_differences}
    return {kind: {rev: write(make(rev), d / f"{rev}_{kind}.parquet") for rev in ("primary", "later")}
            for kind, make in kinds.items()}


@pytest.fixture(scope="module")
def tables(inputs):
    return figures.tables(inputs)


@pytest.mark.parametrize("name", list(figures.FIGURES))
def test_each_figure_is_written_from_data(name, tables, tmp_path):
    paths = {fmt: str(tmp_path / f"{name}.{fmt}") for fmt in figures.FORMATS}
    assert tables[name] is not None and not tables[name].empty
    figures.PLOTTERS[name](tables[name], paths, revision_order=["primary", "later"])
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
    figures.plot_disagreement(tables["fig1_disagreement"], {"pdf": str(a)})
    figures.plot_disagreement(tables["fig1_disagreement"], {"pdf": str(b)})
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
