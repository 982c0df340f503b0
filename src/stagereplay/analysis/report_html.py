"""report.md as one self-contained HTML page (``report.html``), for ``snakemake --report`` and a browser.

It renders the Markdown that :mod:`stagereplay.analysis.report` writes, and only that: ATX headings, paragraphs,
pipe tables (a ``\\|`` in a cell is a ``|`` of its text), block quotes, images, links, ``**bold**``, ``_emphasis_``
and `` `code` ``. Everything else is text, escaped: a value in the report (a path, a dataset field) can never become
markup. The report's figures are linked relative to the page, as in report.md; inside ``snakemake --report`` they
are its own entries.
"""

from __future__ import annotations

import html
import re

INLINE = re.compile(r"`([^`]+)`|\*\*(.+?)\*\*|(?<![\w*])_(.+?)_(?!\w)"  # code, bold, emphasis
                    r"|!\[([^\]]*)\]\(([^)\s]+)\)|\[([^\]]+)\]\(([^)\s]+)\)")  # image, link
CELL_BORDER = re.compile(r"(?<!\\)\|")  # a ``|`` that a backslash does not escape
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1100px; padding: 12px 20px; color: #222; }
table { border-collapse: collapse; margin: 8px 0 14px; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
blockquote { border-left: 4px solid #b42318; margin: 8px 0; padding: 4px 12px; background: #fff4f2; }
code { font-family: ui-monospace, monospace; font-size: 12px; background: #f4f4f4; padding: 0 2px;
  overflow-wrap: anywhere; }
img { max-width: 100%; }
"""


def inline(text: str) -> str:
    """One line of the report's inline Markdown as HTML; anything not markup is escaped."""
    out, at = [], 0
    for match in INLINE.finditer(text):
        out.append(html.escape(text[at:match.start()]))
        code, bold, emphasis, alt, src, label, href = match.groups()
        if code is not None:
            out.append(f"<code>{html.escape(code)}</code>")
        elif bold is not None:
            out.append(f"<strong>{inline(bold)}</strong>")
        elif emphasis is not None:
            out.append(f"<em>{inline(emphasis)}</em>")
        elif src is not None:
            out.append(f'<img src="{html.escape(src)}" alt="{html.escape(alt)}">')
        else:
            out.append(f'<a href="{html.escape(href)}">{inline(label)}</a>')
        at = match.end()
    return "".join(out) + html.escape(text[at:])


def cells(line: str) -> list[str]:
    """A table row's cells: split at each ``|`` but an escaped one (``\\|``, a ``|`` in a value), which reads ``|``."""
    return [c.strip().replace("\\|", "|") for c in CELL_BORDER.split(line.strip())[1:-1]]


def render_report_html(markdown: str, title: str) -> str:
    """The page for ``markdown`` (report.md's text)."""
    body: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        heading = re.match(r"(#{1,6}) (.*)", line)
        if heading:
            level = len(heading.group(1))
            body.append(f"<h{level}>{inline(heading.group(2))}</h{level}>")
            i += 1
            continue
        block = []
        while i < len(lines) and lines[i].strip() and not re.match(r"#{1,6} ", lines[i]):
            block.append(lines[i])
            i += 1
        if all(b.startswith("|") for b in block) and len(block) >= 2 and set(block[1]) <= set("|- :"):
            head = "".join(f"<th>{inline(c)}</th>" for c in cells(block[0]))
            rows = "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in cells(b)) + "</tr>" for b in block[2:])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif all(b.startswith(">") for b in block):
            body.append("<blockquote><p>" + inline(" ".join(b.lstrip("> ") for b in block)) + "</p></blockquote>")
        else:
            body.append("<p>" + inline(" ".join(block)) + "</p>")
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{html.escape(title)}</title>\n'
            f"<style>{STYLE}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n")

