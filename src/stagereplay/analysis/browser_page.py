"""The item browser: one self-contained HTML page per run (``results/<run>/report/items.html``) to look at items.

One row per item (per revision with a ledger) with its status and labels: the correctness label of each
construction and whether the two constructions' suffixes diverge, per experiment and precision, filterable to the
divergent items. Selecting an item shows, per experiment and precision, the two constructions' suffixes side by
side as tokens with the first divergent token marked, the top-2 margin along each suffix as a small inline SVG
plot, and the item's transplant outcomes.

The page embeds its data (:func:`stagereplay.analysis.browser_data.browser_data`) as JSON and its script and style
inline: it opens from a file with no network. This module knows nothing of the ledger's columns (the data says
what the page shows) and no tokenizer: the caller passes, per revision, the text each token id decodes to alone
(:mod:`stagereplay.stages.token_texts` makes it with the run's tokenizer). It knows nothing of torch or Snakemake.
"""

from __future__ import annotations

import html
import json

import pandas as pd

from stagereplay.analysis.browser_data import browser_data
from stagereplay.io.parquet import write_text_atomic


def _json_for_script(data: dict) -> str:
    """JSON that cannot end the <script> element holding it nor open a comment there."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def render_item_browser(data: dict) -> str:
    """The page: HTML with the data as JSON, the style and the script inline (no network, nothing external)."""
    title = f"stagereplay items: run {data['run']}" if data.get("run") else "stagereplay items"
    return (PAGE.replace("__TITLE__", html.escape(title))
            .replace("__DATA__", _json_for_script(data))
            .replace("__STYLE__", STYLE).replace("__SCRIPT__", SCRIPT))


def write_item_browser(out_html: str, ledgers: dict[str, pd.DataFrame], token_texts: dict[str, dict[int, str]],
                       transplants: dict[str, pd.DataFrame] | None = None, selection: pd.DataFrame | None = None,
                       run: str = "") -> dict:
    """Write the page (arguments as :func:`browser_data`'s) and return its data."""
    data = browser_data(ledgers, token_texts, transplants, selection, run)
    write_text_atomic(out_html, render_item_browser(data))
    return data


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>__STYLE__</style>
</head>
<body>
<header>
<h1>__TITLE__</h1>
<p id="summary"></p>
<div id="controls">
<label><input type="checkbox" id="divergent-only"> divergent items only</label>
<label>in <select id="cell-filter"><option value="">any comparison</option></select></label>
<span id="shown-count"></span>
<span class="hint">↑/↓: previous/next item shown</span>
</div>
<p id="legend" class="hint">Each comparison column: the correctness label of its two constructions (✓ right,
✗ wrong, – none, ! a status other than ok), then ≠ and the first divergent decode step, or = for
identical suffixes; hover a cell for it in words.</p>
</header>
<main>
<div id="list"><table id="items"><thead></thead><tbody></tbody></table></div>
<div id="detail"><p class="hint">Select an item to see its suffixes, margins and transplants.</p></div>
</main>
<script type="application/json" id="browser-data">__DATA__</script>
<script>__SCRIPT__</script>
</body>
</html>
"""

STYLE = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 0; color: #222; }
header { padding: 8px 14px; border-bottom: 1px solid #ccc; }
h1 { font-size: 17px; margin: 0 0 4px; }
h2 { font-size: 15px; margin: 0 0 6px; }
h3 { font-size: 13px; margin: 12px 0 4px; }
#controls label { margin-right: 14px; }
#legend { margin: 4px 0 0; }
main { display: flex; height: calc(100vh - 112px); }
/* The list is as wide as its compact columns (up to 60%); the detail pane takes the rest. Narrow windows (the
   iframe of snakemake --report, about 960 px at a 1280 px window) stack the two. */
#list { flex: 0 0 auto; max-width: 60%; overflow: auto; border-right: 1px solid #ccc; }
#detail { flex: 1 1 0; min-width: 0; overflow: auto; padding: 8px 14px; }
@media (max-width: 1100px) {
  main { flex-direction: column; height: auto; }
  #list { max-width: none; max-height: 45vh; border-right: 0; border-bottom: 1px solid #ccc; }
  #detail { flex: none; overflow: visible; }
}
table { border-collapse: collapse; }
#items th, #items td { padding: 3px 6px; border-bottom: 1px solid #eee; text-align: left; white-space: nowrap; }
#items td.item-id { max-width: 11em; overflow: hidden; text-overflow: ellipsis; }
#items td.status-bad { white-space: normal; overflow-wrap: anywhere; max-width: 8em; }
#items thead th { position: sticky; top: 0; background: #f6f6f6; vertical-align: bottom; white-space: normal; }
#items thead th .sub { display: block; font-weight: normal; color: #666; font-size: 11px; white-space: nowrap; }
#items td.comparison { text-align: center; }
#items tbody tr { cursor: pointer; }
#items tbody tr:hover { background: #f0f5ff; }
#items tbody tr.selected { background: #dde8ff; }
.ok { color: #1a7f37; } .wrong { color: #b42318; } .na { color: #888; }
.diverges { font-weight: 600; color: #8a4b00; }
.status-bad { color: #b42318; font-weight: 600; }
.pair { display: flex; gap: 12px; }
.suffix { flex: 1; min-width: 0; }
.suffix-head { font-weight: 600; margin-bottom: 2px; }
.tokens { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; background: #fafafa;
  border: 1px solid #e4e4e4; padding: 4px; }
.tok { border-right: 1px dotted #ccc; }
.tok.after { color: #999; }
.tok.first-divergence { background: #ffd54f; color: #000; outline: 2px solid #e65100; }
.tok.ended { font-style: italic; }
svg.margins { display: block; margin-top: 4px; }
svg.margins .line-a { stroke: #0072b2; } svg.margins .line-b { stroke: #e69f00; }
svg.margins polyline { fill: none; stroke-width: 1.5; }
svg.margins text { font-size: 10px; fill: #555; }
svg.margins text.key-a { fill: #0072b2; } svg.margins text.key-b { fill: #e69f00; }
.suffix:nth-child(1) .suffix-head { border-left: 4px solid #0072b2; padding-left: 4px; }
.suffix:nth-child(2) .suffix-head { border-left: 4px solid #e69f00; padding-left: 4px; }
.note { color: #555; font-style: italic; }
details > summary { cursor: pointer; }
.transplants th, .transplants td { padding: 2px 6px; border-bottom: 1px solid #eee; text-align: left; }
.hint { color: #777; }
"""

SCRIPT = r"""
"use strict";
const DATA = JSON.parse(document.getElementById("browser-data").textContent);
const CELLS = DATA.cells;
const SVG_NS = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}
function tokenText(revision, id) {
  const text = (DATA.tokens[revision] || {})[String(id)];
  return text === undefined ? "\u27e8" + id + "\u27e9" : text;
}
function label(correct) {
  if (correct === true) return el("span", {class: "ok"}, "\u2713");
  if (correct === false) return el("span", {class: "wrong"}, "\u2717");
  return el("span", {class: "na"}, "\u2013");
}
function cellTitle(cell) {
  return cell.experiment + " " + cell.precision + " (" + cell.a + " / " + cell.b + ")" +
    (manyRevisions() ? " \u00b7 " + cell.revision : "");
}
function manyRevisions() {
  return DATA.items.some(it => it.revision !== CELLS[0].revision);
}
function cellHeader(cell) {
  const name = cell.experiment === "fixed_prefix" ? "fixed-prefix" : cell.experiment;
  return el("th", {title: cellTitle(cell) + (cell.note ? "; " + cell.note : ""), "data-cell": cell.key},
    name, el("span", {class: "sub"}, cell.precision), el("span", {class: "sub"}, cell.a + " \u00b7 " + cell.b),
    ...(manyRevisions() ? [el("span", {class: "sub"}, cell.revision)] : []));
}
function sideWords(c, side) {
  if (!side) return c + ": no row";
  if (side.status !== "ok") return c + ": " + side.status;
  return c + ": " + (side.correct === true ? "right" : side.correct === false ? "wrong" : "no label");
}
// One comparison as a compact status: a label per construction, then whether and where the suffixes diverge.
function comparisonCell(cell, entry) {
  const td = el("td", {"data-cell": cell.key, class: "comparison"});
  if (!entry) return td;
  const words = [];
  for (const c of [cell.a, cell.b]) {
    const side = entry.sides[c];
    // a status other than ok is one mark here (the row's status column and the cell's title name it)
    td.append(side ? (side.status === "ok" ? label(side.correct) : el("span", {class: "status-bad"}, "!"))
                   : el("span", {class: "na"}, "\u2013"));
    words.push(sideWords(c, side));
  }
  td.append(" ");
  if (entry.divergent) {
    td.append(el("span", {class: "diverges"}, "\u2260" + entry.first_divergence));
    words.push("suffixes diverge at decode step " + entry.first_divergence);
  } else if (entry.compared) {
    td.append(el("span", {class: "na"}, "="));
    words.push("identical suffixes");
  } else {
    words.push("not compared");
  }
  td.title = words.join("; ");
  return td;
}

function buildTable() {
  const head = el("tr", {}, el("th", {}, "#"), el("th", {}, "item"), el("th", {}, "status"), el("th", {}, "gold"));
  const select = document.getElementById("cell-filter");
  for (const cell of CELLS) {
    head.append(cellHeader(cell));
    select.append(el("option", {value: cell.key}, cellTitle(cell)));
  }
  document.querySelector("#items thead").append(head);
  const body = document.querySelector("#items tbody");
  DATA.items.forEach((item, index) => {
    const row = el("tr", {"data-index": index, "data-item-index": item.item_index, "data-revision": item.revision,
                          "data-divergent": item.divergent ? "true" : "false", tabindex: 0},
      el("td", {}, item.item_index), el("td", {class: "item-id", title: item.item_id}, item.item_id),
      el("td", {class: item.status === "ok" ? "" : "status-bad"}, item.status),
      el("td", {}, item.gold_answer === null ? "" : item.gold_answer));
    for (const cell of CELLS) row.append(comparisonCell(cell, item.cells[cell.key]));
    row.addEventListener("click", () => selectItem(index));
    row.addEventListener("keydown", ev => { if (ev.key === "Enter") selectItem(index); });
    body.append(row);
  });
}

// Up and down move the selection to the previous or next row the filter shows (not while a form control has the
// keys: the comparison menu uses them itself).
function step(delta) {
  const rows = Array.from(document.querySelectorAll("#items tbody tr")).filter(r => !r.hidden);
  if (!rows.length) return;
  const at = rows.findIndex(r => r.classList.contains("selected"));
  const next = at < 0 ? (delta > 0 ? 0 : rows.length - 1) : Math.min(rows.length - 1, Math.max(0, at + delta));
  selectItem(Number(rows[next].dataset.index));
  rows[next].focus({preventScroll: true});
  rows[next].scrollIntoView({block: "nearest"});
}
document.addEventListener("keydown", ev => {
  if (ev.key !== "ArrowDown" && ev.key !== "ArrowUp") return;
  if (ev.target.closest && ev.target.closest("select, input, textarea")) return;
  ev.preventDefault();
  step(ev.key === "ArrowDown" ? 1 : -1);
});

function isDivergent(item, cellKey) {
  if (!cellKey) return item.divergent;
  const entry = item.cells[cellKey];
  return Boolean(entry && entry.divergent);
}

function applyFilter() {
  const only = document.getElementById("divergent-only").checked;
  const cellKey = document.getElementById("cell-filter").value;
  let shown = 0;
  document.querySelectorAll("#items tbody tr").forEach(row => {
    const item = DATA.items[Number(row.dataset.index)];
    const visible = !only || isDivergent(item, cellKey);
    row.hidden = !visible;
    shown += visible ? 1 : 0;
  });
  document.getElementById("shown-count").textContent = shown + " of " + DATA.items.length + " items shown";
}

function suffixTokens(revision, side, divergence) {
  const box = el("div", {class: "tokens"});
  side.ids.forEach((id, step) => {
    const margin = side.margins[step];
    let cls = "tok";
    if (divergence !== null && step === divergence) cls += " first-divergence";
    else if (divergence !== null && step > divergence) cls += " after";
    box.append(el("span", {class: cls, "data-step": step, "data-id": id,
                           title: "step " + step + " \u00b7 id " + id +
                                  (margin === null || margin === undefined ? "" : " \u00b7 margin " + margin)},
                  tokenText(revision, id)));
  });
  if (divergence !== null && divergence >= side.ids.length) {
    box.append(el("span", {class: "tok first-divergence ended", "data-step": divergence}, "[suffix ended]"));
  }
  return box;
}

function marginPlot(entry, cell) {
  const width = 400, height = 90, left = 30, bottom = 14, top = 6;
  const sides = [cell.a, cell.b].map(c => entry.sides[c]).filter(s => s && s.status === "ok");
  const steps = Math.max(1, ...sides.map(s => s.margins.length));
  const values = sides.flatMap(s => s.margins).filter(m => m !== null);
  const high = Math.max(1e-9, ...values);
  const x = step => left + (steps > 1 ? step / (steps - 1) : 0) * (width - left - 4);
  const y = m => top + (1 - m / high) * (height - top - bottom);
  const plot = svg("svg", {class: "margins", width: width, height: height, viewBox: "0 0 " + width + " " + height,
                           role: "img", "aria-label": "top-2 margin per decode step"});
  plot.append(svg("line", {x1: left, y1: y(0), x2: width - 4, y2: y(0), stroke: "#aaa"}));
  plot.append(svg("line", {x1: left, y1: top, x2: left, y2: y(0), stroke: "#aaa"}));
  const yHigh = svg("text", {x: 2, y: top + 8}); yHigh.textContent = high.toFixed(1); plot.append(yHigh);
  const yLow = svg("text", {x: 2, y: y(0)}); yLow.textContent = "0"; plot.append(yLow);
  const xLabel = svg("text", {x: left, y: height - 2});
  xLabel.textContent = "decode step 0\u2013" + (steps - 1) + "; top-2 logit margin"; plot.append(xLabel);
  if (entry.divergent) {
    plot.append(svg("line", {class: "divergence", x1: x(entry.first_divergence), x2: x(entry.first_divergence),
                             y1: top, y2: y(0), stroke: "#e65100", "stroke-dasharray": "3 2"}));
  }
  [cell.a, cell.b].forEach((c, i) => {
    const side = entry.sides[c];
    const key = svg("text", {x: width - 170 + 85 * i, y: height - 2, class: i === 0 ? "key-a" : "key-b"});
    key.textContent = "\u2014 " + c; plot.append(key);
    if (!side || side.status !== "ok") return;
    const points = side.margins.map((m, step) => x(step).toFixed(1) + "," + y(m === null ? 0 : m).toFixed(1));
    const line = svg("polyline", {class: i === 0 ? "line-a" : "line-b", "data-construction": c,
                                  points: points.join(" ")});
    const name = svg("title", {}); name.textContent = c; line.append(name);
    plot.append(line);
  });
  return plot;
}

function comparisonSection(item, cell) {
  const entry = item.cells[cell.key];
  const section = el("details", {class: "comparison", "data-cell": cell.key,
                                 "data-divergent": entry.divergent ? "true" : "false"});
  if (entry.divergent || !item.divergent) section.open = true;
  const what = entry.divergent ? "diverge at decode step " + entry.first_divergence :
    (entry.compared ? "identical suffixes" : "not compared (a construction's status is not ok)");
  section.append(el("summary", {}, el("strong", {}, cellTitle(cell)), ": " + what));
  if (cell.note) section.append(el("p", {class: "note"}, "Note: " + cell.note + "."));
  const pair = el("div", {class: "pair"});
  for (const c of [cell.a, cell.b]) {
    const side = entry.sides[c];
    const box = el("div", {class: "suffix", "data-construction": c});
    if (!side) {
      box.append(el("div", {class: "suffix-head"}, c), el("p", {class: "na"}, "no row"));
    } else {
      box.append(el("div", {class: "suffix-head"}, c + ": answer " + (side.answer === null ? "none" : side.answer) + " ",
                    label(side.correct), " \u00b7 " + side.ids.length + " tokens \u00b7 " +
                    (side.status === "ok" ? side.stop_reason : side.status)));
      box.append(suffixTokens(item.revision, side, entry.divergent ? entry.first_divergence : null));
    }
    pair.append(box);
  }
  section.append(pair, marginPlot(entry, cell));
  return section;
}

function transplantTable(item) {
  if (!item.transplants.length) return el("p", {class: "na"}, "No transplant of this item.");
  const table = el("table", {class: "transplants"},
    el("tr", {}, ...["revision", "precision", "direction", "layers \u00b7 component \u00b7 positions", "divergent",
                     "outcome", "first divergence vs donor", "vs recipient"].map(h => el("th", {}, h))));
  for (const t of item.transplants) {
    const dash = v => (v === null ? "\u2013" : v);
    table.append(el("tr", {"data-outcome": t.outcome},
      ...[t.revision, t.precision, t.direction, t.label, t.divergent === null ? "\u2013" : (t.divergent ? "yes" : "no"),
          t.outcome, dash(t.first_divergence_donor), dash(t.first_divergence_recipient)].map(v => el("td", {}, v))));
  }
  return table;
}

function selectItem(index) {
  const item = DATA.items[index];
  document.querySelectorAll("#items tbody tr.selected").forEach(r => r.classList.remove("selected"));
  const row = document.querySelector('#items tbody tr[data-index="' + index + '"]');
  if (row) row.classList.add("selected");
  const detail = document.getElementById("detail");
  detail.replaceChildren();
  detail.dataset.itemIndex = item.item_index;
  detail.append(el("h2", {}, "Item " + item.item_index + " \u00b7 " + item.item_id +
                   (manyRevisions() ? " \u00b7 revision " + item.revision : "")));
  if (item.question !== null) detail.append(el("p", {}, el("strong", {}, "Question: "), item.question));
  detail.append(el("p", {}, el("strong", {}, "Gold answer: "), item.gold_answer === null ? "none" : item.gold_answer,
                   " \u00b7 ", el("strong", {}, "status: "), item.status));
  detail.append(el("p", {}, el("strong", {}, "Stage (the prefix after the prompt): "),
                   el("span", {class: "tokens"}, item.stage_ids.map(id => tokenText(item.revision, id)).join(""))));
  detail.append(el("p", {class: "note"}, "Each token is shown as it decodes alone; hover a token for its step, id " +
                   "and top-2 margin. The first divergent token is marked on both sides."));
  for (const cell of CELLS) if (cell.revision === item.revision && item.cells[cell.key]) {
    detail.append(comparisonSection(item, cell));
  }
  detail.append(el("h3", {}, "Transplants"), transplantTable(item));
  history.replaceState(null, "", "#item=" + item.revision + "/" + item.item_index);
}

function summary() {
  const parts = [DATA.items.length + " items"];
  for (const cell of CELLS) {
    const divergent = DATA.items.filter(it => it.cells[cell.key] && it.cells[cell.key].divergent).length;
    const compared = DATA.items.filter(it => it.cells[cell.key] && it.cells[cell.key].compared).length;
    parts.push(cellTitle(cell) + ": " + divergent + "/" + compared + " divergent");
  }
  document.getElementById("summary").textContent = parts.join(" \u00b7 ");
}

buildTable();
summary();
document.getElementById("divergent-only").addEventListener("change", applyFilter);
document.getElementById("cell-filter").addEventListener("change", applyFilter);
applyFilter();
const wanted = /^#item=(.+)\/(\d+)$/.exec(location.hash);
if (wanted) {
  const index = DATA.items.findIndex(it => it.revision === wanted[1] && String(it.item_index) === wanted[2]);
  if (index >= 0) selectItem(index);
}
"""
