"""report.html: report.md's Markdown rendered as one page, every value of the report escaped."""

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
