"""report.html: report.md's Markdown rendered as one page, every value of the report escaped, and every table cell
escaped so that its table stays a table; its figures embedded, so that it shows them also where `snakemake --report`
shows it (a frame loaded from a data: URL), checked in a headless Chromium."""

import base64
import re
from html.parser import HTMLParser

import pytest

from headless_chromium import launched_chromium
from report_data import part_provenance, synthetic_ledger, write_with
from stagereplay.analysis.report import build_report
from stagereplay.analysis.report_format import table_head, table_row
from stagereplay.analysis.report_html import render_report_html

MARKDOWN = """# stagereplay report: run `r<1>`

> **AUDIT FAILED.** Revision `primary`: 2 rows.

## Findings

| claim | this run |
| --- | --- |
| bridge `<b>` | 11 / 12 **no** |

A path `a_b_c/<script>` and _a note_, [items.html](items.html).

![fig1](figures/fig1.png)
"""


# The smallest PNG: one transparent pixel.
PIXEL = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII=")


@pytest.fixture
def figure_folder(tmp_path):
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures/fig1.png").write_bytes(PIXEL)
    return tmp_path


def test_the_report_markdown_becomes_html_and_values_stay_text(figure_folder):
    page = render_report_html(MARKDOWN, "stagereplay report: run r<1>", figure_folder)
    assert "<h1>stagereplay report: run <code>r&lt;1&gt;</code></h1>" in page
    assert "<blockquote><p><strong>AUDIT FAILED.</strong> Revision <code>primary</code>: 2 rows.</p></blockquote>" \
        in page
    assert ("<table><thead><tr><th>claim</th><th>this run</th></tr></thead><tbody><tr><td>bridge <code>&lt;b&gt;</code>"
            "</td><td>11 / 12 <strong>no</strong></td></tr></tbody></table>") in page
    assert "<code>a_b_c/&lt;script&gt;</code> and <em>a note</em>, <a href=\"items.html\" data-beside>items.html</a>." \
        in page
    assert f'<img src="data:image/png;base64,{base64.b64encode(PIXEL).decode()}" alt="fig1">' in page
    assert "<script>" not in page.split("<body>")[1].split("\n<script>")[0] and "<b>" not in page


def test_each_figure_is_embedded_and_a_missing_one_is_named(tmp_path, figure_folder):
    page = render_report_html(MARKDOWN, "t", figure_folder)
    src = re.search(r'<img src="data:image/png;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(src) == PIXEL  # the file's bytes, whole
    assert "figures/fig1.png" not in page  # nothing left to resolve against the page's folder
    with pytest.raises(FileNotFoundError, match=r"image 'figures/fig1.png' of the report: .*fig1.png does not exist"):
        render_report_html(MARKDOWN, "t", tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="no folder to read it from"):
        render_report_html(MARKDOWN, "t")


class Tables(HTMLParser):
    """The page's tables as lists of rows of cell texts (header row first)."""

    def __init__(self, page: str):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.in_cell = False
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.tables[-1][-1].append("")
            self.in_cell = True

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.in_cell = False

    def handle_data(self, data):
        if self.in_cell:
            self.tables[-1][-1][-1] += data


def test_a_value_in_a_table_cell_can_neither_end_its_row_nor_add_a_cell():
    markdown = "\n".join([*table_head("a", "", "b"), table_row("x|y", "tab\there\x1b", "`\n\n`"), ""])
    assert markdown.count("\n") == 3  # header, rule, one row
    assert Tables(render_report_html(markdown, "t")).tables == [[["a", "", "b"], ["x|y", "tab\\there\\x1b", "\\n\\n"]]]


def test_a_boundary_marker_with_newlines_keeps_the_identity_table_whole(tmp_path):
    """A real run's marker "\\n\\n" was written raw into "What produced this run": the table ended at its boundary
    row and the rows after it became one paragraph."""
    provenance = part_provenance("bf16")
    provenance["config"]["boundary"]["marker"] = "\n\n"
    ledger = write_with(synthetic_ledger("primary", n_items=4), tmp_path / "ledger.parquet", provenance)
    stats = build_report({"primary": ledger}, str(tmp_path / "report.md"), str(tmp_path / "stats.json"), "t",
                         out_html=str(tmp_path / "report.html"))
    markdown = (tmp_path / "report.md").read_text()
    table = markdown.split("## What produced this run\n")[1].split("| | recorded |")[1].split("\n\n")[0]
    block = ("| | recorded |" + table).splitlines()
    assert len(block) == 2 + len(stats["identity"]) and all(line.startswith("| ") for line in block)
    assert "| boundary | marker `\\n\\n`, " in markdown
    page = (tmp_path / "report.html").read_text()
    identity = next(t for t in Tables(page).tables if t[0] == ["", "recorded"])
    assert len(identity) == 1 + len(stats["identity"]) and all(len(row) == 2 for row in identity)
    boundary = next(row for row in identity if row[0] == "boundary")
    assert boundary[1].startswith("marker \\n\\n, ")
    assert "<code>\\n\\n</code>" in page


@pytest.fixture(scope="module")
def chromium():
    yield from launched_chromium()


IMAGES = "() => Array.from(document.images, i => [i.alt, i.complete, i.naturalWidth])"
LINKS = "() => Array.from(document.links, a => a.href)"


def test_the_page_shows_its_figures_from_its_file_and_from_a_data_url(chromium, tmp_path):
    """`snakemake --report` shows report.html in a frame loaded from a data: URL: its figures, linked relative to the
    page, were broken images there, and its link to items.html led nowhere."""
    ledger = write_with(synthetic_ledger("primary", n_items=4), tmp_path / "ledger.parquet", part_provenance("bf16"))
    folder = tmp_path / "report"
    (folder / "figures").mkdir(parents=True)
    figures = {}
    for name in ("fig1_disagreement", "fig10_split_predictors"):
        figures[name] = str(folder / f"figures/{name}.png")
        (folder / f"figures/{name}.png").write_bytes(PIXEL)
    (folder / "items.html").write_text("<!DOCTYPE html><title>items</title>")
    build_report({"primary": ledger}, str(folder / "report.md"), str(folder / "stats.json"), "t", figures=figures,
                 item_browser=str(folder / "items.html"), out_html=str(folder / "report.html"))
    (folder / "figures").rename(tmp_path / "moved")  # the page must not need them any more
    page = (folder / "report.html").read_bytes()
    tab = chromium.new_page()
    errors = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.goto((folder / "report.html").as_uri())
    assert tab.evaluate(IMAGES) == [[name, True, 1] for name in figures]
    assert tab.evaluate(LINKS) == [(folder / "items.html").as_uri()]  # from its file: the item browser beside it
    # as snakemake --report shows it: an iframe whose src is the page as a data: URL
    tab.set_content(f'<iframe src="data:text/html;charset=utf8;base64,{base64.b64encode(page).decode()}"></iframe>')
    frame = tab.frames[1]
    frame.wait_for_load_state()
    assert frame.evaluate("() => location.protocol") == "data:"
    assert frame.evaluate(IMAGES) == [[name, True, 1] for name in figures]
    assert frame.evaluate(LINKS) == []  # no link that resolves to nothing
    text = frame.evaluate("() => document.body.innerText")
    assert "items.html (a file beside report.html in the run's report folder, not inside this embedded copy" in text
    tab.close()
    assert not errors, errors
