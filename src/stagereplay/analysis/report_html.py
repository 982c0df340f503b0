"""report.md as one self-contained HTML page (``report.html``), for ``snakemake --report`` and a browser.

It renders the Markdown that :mod:`stagereplay.analysis.report` writes, and only that: ATX headings, paragraphs,
pipe tables (a ``\\|`` in a cell is a ``|`` of its text), block quotes, images, links, ``**bold**``, ``_emphasis_``
and `` `code` ``. Everything else is text, escaped: a value in the report (a path, a dataset field) can never become
markup.

The page is self-contained: each image report.md links (the figures, relative to it) is read and embedded as a
``data:`` URI, so that the page shows its figures wherever it is opened, also inside ``snakemake --report``, which
shows it in a frame loaded from a ``data:`` URL where no relative path resolves. A link to a file beside the page (the
item browser) cannot be followed from such a frame: there a small script turns it into its text and a note saying
where the file is.
"""

from __future__ import annotations

import base64
import html
import mimetypes
import re
from pathlib import Path

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
.beside { color: #555; }
"""
# Shown from a data: URL (the frame of `snakemake --report`) a relative link resolves to nothing: each becomes its
# text and a note. Opened from its file (results/<run>/report/report.html) the page keeps its links.
EMBEDDED_LINKS = """
if (location.protocol === "data:") {
  for (const link of document.querySelectorAll("a[data-beside]")) {
    const text = document.createElement("code");
    text.textContent = link.getAttribute("href");
    const note = document.createElement("span");
    note.className = "beside";
    note.textContent = " (a file beside report.html in the run's report folder, not inside this embedded copy; " +
      "snakemake --report lists it as an entry of its own)";
    link.replaceWith(text, note);
  }
}
"""
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # data:, https:, file: ...


def embedded_image(src: str, folder: Path | None) -> str:
    """``src`` (a path relative to ``folder``, or absolute) as a ``data:`` URI of the file's bytes; a URI as is."""
    if SCHEME.match(src):
        return src
    if folder is None:
        raise ValueError(f"image {src!r}: no folder to read it from; give render_report_html the page's folder")
    path = folder / src
    if not path.is_file():
        raise FileNotFoundError(f"image {src!r} of the report: {path} does not exist (rule plot_figures writes it)")
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def inline(text: str, folder: Path | None = None) -> str:
    """One line of the report's inline Markdown as HTML; anything not markup is escaped. Images are read from
    ``folder`` (the page's) and embedded."""
    out, at = [], 0
    for match in INLINE.finditer(text):
        out.append(html.escape(text[at:match.start()]))
        code, bold, emphasis, alt, src, label, href = match.groups()
        if code is not None:
            out.append(f"<code>{html.escape(code)}</code>")
        elif bold is not None:
            out.append(f"<strong>{inline(bold, folder)}</strong>")
        elif emphasis is not None:
            out.append(f"<em>{inline(emphasis, folder)}</em>")
        elif src is not None:
            out.append(f'<img src="{html.escape(embedded_image(src, folder))}" alt="{html.escape(alt)}">')
        else:
            beside = "" if SCHEME.match(href) or href.startswith("#") else " data-beside"
            out.append(f'<a href="{html.escape(href)}"{beside}>{inline(label, folder)}</a>')
        at = match.end()
    return "".join(out) + html.escape(text[at:])


def cells(line: str) -> list[str]:
    """A table row's cells: split at each ``|`` but an escaped one (``\\|``, a ``|`` in a value), which reads ``|``."""
    return [c.strip().replace("\\|", "|") for c in CELL_BORDER.split(line.strip())[1:-1]]


def render_report_html(markdown: str, title: str, folder: str | Path | None = None) -> str:
    """The page for ``markdown`` (report.md's text); its images, relative to ``folder`` (report.md's), embedded."""
    base = None if folder is None else Path(folder)
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
            body.append(f"<h{level}>{inline(heading.group(2), base)}</h{level}>")
            i += 1
            continue
        block = []
        while i < len(lines) and lines[i].strip() and not re.match(r"#{1,6} ", lines[i]):
            block.append(lines[i])
            i += 1
        if all(b.startswith("|") for b in block) and len(block) >= 2 and set(block[1]) <= set("|- :"):
            head = "".join(f"<th>{inline(c, base)}</th>" for c in cells(block[0]))
            rows = "".join("<tr>" + "".join(f"<td>{inline(c, base)}</td>" for c in cells(b)) + "</tr>"
                           for b in block[2:])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif all(b.startswith(">") for b in block):
            quote = " ".join(b.lstrip("> ") for b in block)
            body.append(f"<blockquote><p>{inline(quote, base)}</p></blockquote>")
        else:
            body.append("<p>" + inline(" ".join(block), base) + "</p>")
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{html.escape(title)}</title>\n'
            f"<style>{STYLE}</style>\n</head>\n<body>\n" + "\n".join(body) + f"\n<script>{EMBEDDED_LINKS}</script>\n"
            "</body>\n</html>\n")

