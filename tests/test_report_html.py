"""report.html: report.md's Markdown rendered as one page, every value of the report escaped, and every table cell
escaped so that its table stays a table."""

from html.parser import HTMLParser

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


def test_the_report_markdown_becomes_html_and_values_stay_text():
    page = render_report_html(MARKDOWN, "stagereplay report: run r<1>")
    assert "<h1>stagereplay report: run <code>r&lt;1&gt;</code></h1>" in page
    assert "<blockquote><p><strong>AUDIT FAILED.</strong> Revision <code>primary</code>: 2 rows.</p></blockquote>" \
        in page
    assert ("<table><thead><tr><th>claim</th><th>this run</th></tr></thead><tbody><tr><td>bridge <code>&lt;b&gt;</code>"
            "</td><td>11 / 12 <strong>no</strong></td></tr></tbody></table>") in page
    assert "<code>a_b_c/&lt;script&gt;</code> and <em>a note</em>, <a href=\"items.html\">items.html</a>." in page
    assert '<img src="figures/fig1.png" alt="fig1">' in page
    assert "<script>" not in page and "<b>" not in page


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
