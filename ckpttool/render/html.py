"""The HTML page of `inspect --html` and `validate --html`: one self-contained file drawing a
`shard_map.ShardMap` (no network: inline CSS, JS and SVG, and a Content-Security-Policy that
forbids anything else).

The data is embedded once as JSON (a tensor's chunks as one flat array of ints); the page
aggregates it into tables and draws a tensor's boxes only when its row is opened, so a
checkpoint of 100k+ chunks opens as fast as a small one. Every name from the checkpoint
reaches the page as text (`textContent`), never as markup.

Example:
    >>> write_page(shard_map.build(inspect("ckpt")), "report.html", force=False)
"""

from __future__ import annotations

import html
import json
import os
from typing import Any

from ckpttool.commands.inspect import GROUPS
from ckpttool.outputs import atomic_output
from ckpttool.render.shard_map import ShardMap

SCHEMA = "ckpttool.shard-map/1"  # the embedded document; its rows are described in `document`
# the page may run only its own inline script and style: no network, no plugins, no frames
CONTENT_SECURITY_POLICY = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"


def document(shard_map: ShardMap) -> dict[str, Any]:
    """Return the JSON document the page embeds.

    Rows are arrays, named by the page's `T`/`F`/`M`/`P` constants:
    - files: [file, rank, size, referenced_bytes, model_bytes, optimizer_bytes, other_bytes]
    - modules: [group, module, tensors, bytes, stored_bytes]
    - tensors: [fqn, group, dtype, shape, bytes, stored_bytes, sharding, uneven, axes, copies,
      duplicate_bytes, ranks, chunk_count, problem indices]
    - chunks: per tensor, its chunks flattened: offsets, sizes, file number (-1: none)
    - problems: [severity, code, message, file, fqn]
    """
    s = shard_map.summary
    return {
        "schema": SCHEMA,
        "path": shard_map.path,
        "layout": shard_map.layout,
        "validated": shard_map.validated,
        "filters": list(shard_map.filters),
        "summary": None if s is None else {
            "dcp_version": s.dcp_version, "tensors": s.tensors, "objects": s.objects, "chunks": s.chunks,
            "tensor_bytes": s.tensor_bytes, "file_bytes": s.file_bytes, "files": s.files,
            "ranks": len(s.ranks), "parameters": s.parameters,
        },
        "stored_bytes": shard_map.stored_bytes,
        "duplicate_bytes": shard_map.duplicate_bytes,
        "groups": {name: {"tensors": g.tensors, "objects": g.objects, "numel": g.numel, "bytes": g.nbytes}
                   for name, g in shard_map.groups.items()},
        "files": [[f.file, f.rank, f.size, f.referenced_bytes, *(f.tensor_bytes.get(g, 0) for g in GROUPS)]
                  for f in shard_map.files],
        "modules": [[m.group, m.module, m.tensors, m.nbytes, m.stored_bytes] for m in shard_map.modules],
        "tensors": [[t.fqn, t.group, t.dtype, list(t.shape), t.nbytes, t.stored_bytes, t.sharding, t.uneven,
                     list(t.axes), t.copies, t.duplicate_bytes, t.ranks, len(t.chunks), list(t.problems)]
                    for t in shard_map.tensors],
        "chunks": [t.chunks.reshape(-1).tolist() for t in shard_map.tensors],
        "problems": [[p.severity, p.code, p.message, p.file, p.fqn] for p in shard_map.problems],
    }


def embedded_json(value: Any) -> str:
    """Return `value` as JSON that is inert inside a <script> element: ASCII only, and no `<`,
    `>` or `&` (so no `</script>` or `<!--` can end or change it)."""
    text = json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def page(shard_map: ShardMap) -> str:
    """Return the whole page: byte-identical for the same checkpoint and problems."""
    title = html.escape(f"ckpttool shard map: {shard_map.path}", quote=True)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CONTENT_SECURITY_POLICY}\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{title}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        "<noscript>This page draws the shard map with JavaScript; turn it on to see it.</noscript>\n"
        "<main id=\"page\"></main>\n"
        f"<script type=\"application/json\" id=\"shard-map-data\">{embedded_json(document(shard_map))}</script>\n"
        f"<script>{_SCRIPT}</script>\n</body>\n</html>\n"
    )


def write_page(shard_map: ShardMap, path: str | os.PathLike, force: bool) -> int:
    """Write the page to `path` atomically (a local path or a storage URL); return its bytes.
    Raises OutputExists when `path` exists and `force` is off."""
    data = page(shard_map).encode("ascii")
    with atomic_output(path, force=force) as handle:
        handle.write(data)
    return len(data)


def written_line(shard_map: ShardMap, path: str | os.PathLike, size: int) -> str:
    """Return the note that the page was written."""
    chunks = sum(len(t.chunks) for t in shard_map.tensors)
    return (f"wrote {os.fspath(path)} ({size:,} bytes): the shard map of {len(shard_map.tensors)} tensors, "
            f"{chunks} chunks" + (f", {len(shard_map.problems)} problems" if shard_map.validated else ""))


_STYLE = """
:root { --fg: #1d232b; --muted: #5d6874; --line: #d9dee4; --bg: #fff; --soft: #f4f6f8; --bad: #c62828; --warn: #b26a00; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg); background: var(--bg); }
main { max-width: 1180px; margin: 0 auto; padding: 18px 22px 60px; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 26px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
.muted { color: var(--muted); }
.path { font-family: ui-monospace, Menlo, Consolas, monospace; word-break: break-all; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: var(--soft); font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.name { font-family: ui-monospace, Menlo, Consolas, monospace; word-break: break-all; }
tr.tensor { cursor: pointer; }
tr.tensor:hover { background: #eef4fb; }
tr.tensor.open { background: #e3eefa; }
tr.detail > td { background: #fafbfc; padding: 10px 14px 16px; }
.bar { height: 12px; background: #5b8def; border-radius: 2px; min-width: 1px; }
.stack { display: flex; height: 14px; width: 100%; background: var(--soft); border-radius: 2px; overflow: hidden; }
.stack > span { display: block; height: 100%; }
.g-model { background: #4e79a7; } .g-optimizer { background: #f28e2b; } .g-other { background: #9c9c9c; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin: 0 4px -1px 10px; border: 1px solid #0003; }
.badge { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 12px; margin-left: 4px; white-space: nowrap; }
.badge.error { background: #fde3e3; color: var(--bad); } .badge.warning { background: #fff1d6; color: var(--warn); }
.badge.info { background: #e6eefc; color: #1e4ea8; } .badge.copies { background: #efe6fb; color: #5b2ca0; }
.controls { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; margin: 6px 0 10px; }
.controls input[type=search] { width: 340px; padding: 4px 6px; }
button { font: inherit; padding: 2px 10px; cursor: pointer; }
button.link { border: none; background: none; color: #1e5bb8; padding: 0; text-decoration: underline; }
ul.problems { margin: 4px 0; padding-left: 18px; }
ul.problems li { margin: 2px 0; }
.map { margin: 6px 0 10px; }
.map svg { display: block; outline: 1px solid #9aa4af; background: #fff; overflow: visible; }
.map .axis { font-size: 12px; color: var(--muted); }
.copies-row { display: flex; flex-wrap: wrap; gap: 14px; }
rect.chunk { stroke: #1d232b; stroke-width: 1; }
rect.chunk.bad { stroke: var(--bad); stroke-width: 3; stroke-dasharray: 4 2; }
.ok { color: #2e7d32; font-weight: 600; } .fail { color: var(--bad); font-weight: 600; }
.summary-line span { margin-right: 14px; white-space: nowrap; }
"""

_SCRIPT = r"""
"use strict";
(function () {
const D = JSON.parse(document.getElementById("shard-map-data").textContent);
const GROUPS = ["model", "optimizer", "other"];
// row layouts of the embedded document (render/html.py: document)
const T = {fqn: 0, group: 1, dtype: 2, shape: 3, bytes: 4, stored: 5, sharding: 6, uneven: 7, axes: 8,
           copies: 9, duplicate: 10, ranks: 11, chunks: 12, problems: 13};
const F = {file: 0, rank: 1, size: 2, referenced: 3, groups: 4};
const M = {group: 0, module: 1, tensors: 2, bytes: 3, stored: 4};
const P = {severity: 0, code: 1, message: 2, file: 3, fqn: 4};
const PAGE = 200;          // table rows added at a time
const DRAW_LIMIT = 20000;  // boxes drawn for one tensor; the chunk list says how many exist
const LIST_LIMIT = 200;    // chunks listed under a drawing
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) if (child !== null && child !== undefined)
    node.appendChild(typeof child === "string" || typeof child === "number" ? document.createTextNode(String(child)) : child);
  return node;
}
function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}
function bytes(count) {  // decimal units, as render.human_bytes
  if (count === null || count === undefined) return "-";
  let value = count;
  for (const unit of ["B", "kB", "MB", "GB", "TB"]) {
    if (Math.abs(value) < 1000 || unit === "TB") return unit === "B" ? value.toFixed(0) + " B" : value.toFixed(1) + " " + unit;
    value /= 1000;
  }
}
function count(n) { return n.toLocaleString("en-US"); }
function pct(part, whole) { return whole > 0 ? Math.max(0, Math.min(100, 100 * part / whole)) : 0; }

// who holds a file's chunks: its rank, else the file itself numbered after the ranks (shard_map.build)
const firstUnranked = D.files.reduce((m, f) => f[F.rank] === null ? m : Math.max(m, f[F.rank] + 1), 0);
const holders = D.files.map((f, i) => f[F.rank] !== null ? f[F.rank] : firstUnranked + i);
function holderName(file) {
  if (file < 0) return "no file";
  const f = D.files[file];
  return (f[F.rank] !== null ? "rank " + f[F.rank] : "file") + " \u00b7 " + f[F.file];
}
function colour(holder) { return holder < 0 ? "#ffffff" : "hsl(" + ((holder * 137.508) % 360).toFixed(1) + ", 62%, 62%)"; }

// problems by data file: their chunks are marked in every drawing
const fileProblems = new Map();
D.problems.forEach((p, i) => { if (p[P.file] !== null) {
  if (!fileProblems.has(p[P.file])) fileProblems.set(p[P.file], []);
  fileProblems.get(p[P.file]).push(i);
}});
const badFile = D.files.map(f => fileProblems.has(f[F.file]));

const page = document.getElementById("page");

function header() {
  page.appendChild(el("h1", {}, "Shard map"));
  page.appendChild(el("div", {class: "path"}, D.path));
  const s = D.summary;
  if (!s) { page.appendChild(el("p", {class: "fail"}, "The metadata could not be read: only validate's problems are shown.")); return; }
  const line = el("div", {class: "summary-line muted"});
  const parts = [D.layout + (s.dcp_version ? " " + s.dcp_version : ""), count(s.tensors) + " tensors", count(s.objects) + " objects",
                 count(s.chunks) + " chunks", count(s.files) + " files", count(s.ranks) + " ranks",
                 bytes(s.tensor_bytes) + " of tensors", bytes(s.file_bytes) + " on disk"];
  if (D.duplicate_bytes > 0) parts.push(bytes(D.duplicate_bytes) + " stored more than once");
  for (const part of parts) line.appendChild(el("span", {}, part));
  page.appendChild(line);
  if (D.filters.length) page.appendChild(el("div", {class: "muted"}, "tensors listed: those matching " + D.filters.join(", ")));
}

function problems() {
  if (!D.validated) return;
  const section = el("section", {id: "problems"});
  section.appendChild(el("h2", {}, "Problems"));
  const errors = D.problems.filter(p => p[P.severity] === "error").length;
  const warnings = D.problems.filter(p => p[P.severity] === "warning").length;
  section.appendChild(errors ? el("p", {class: "fail"}, "invalid: " + errors + " errors, " + warnings + " warnings")
                             : el("p", {class: "ok"}, "valid" + (warnings ? ", " + warnings + " warnings" : "")));
  const list = el("ul", {class: "problems"});
  const more = el("button", {}, "show all " + D.problems.length);
  more.hidden = D.problems.length <= 20;
  more.addEventListener("click", () => { for (const item of list.children) item.hidden = false; more.hidden = true; });
  D.problems.slice(0, 500).forEach((p, i) => {
    const item = el("li", {"data-problem": i}, el("span", {class: "badge " + p[P.severity]}, p[P.severity] + " " + p[P.code]), " ", p[P.message]);
    if (p[P.fqn] !== null && tensorIndex.has(p[P.fqn])) {
      item.appendChild(document.createTextNode(" "));
      const button = el("button", {class: "link"}, "show tensor");
      button.addEventListener("click", () => openTensor(tensorIndex.get(p[P.fqn])));
      item.appendChild(button);
    }
    item.hidden = i >= 20;
    list.appendChild(item);
  });
  section.append(list, more);
  if (D.problems.length > 500) section.appendChild(el("p", {class: "muted"}, "... and " + (D.problems.length - 500) + " more"));
  page.appendChild(section);
}

function groupLegend() {
  const legend = el("div", {class: "muted"});
  for (const g of GROUPS) legend.append(el("span", {class: "swatch g-" + g}), g);
  return legend;
}

function groupBytes() {
  if (!D.summary) return;
  const section = el("section", {id: "groups"});
  section.appendChild(el("h2", {}, "Bytes by group"));
  const total = GROUPS.reduce((sum, g) => sum + (D.groups[g] ? D.groups[g].bytes : 0), 0);
  const stack = el("div", {class: "stack"});
  for (const g of GROUPS) if (D.groups[g] && D.groups[g].bytes)
    stack.appendChild(el("span", {class: "g-" + g, style: "width:" + pct(D.groups[g].bytes, total) + "%", title: g + ": " + bytes(D.groups[g].bytes)}));
  section.append(stack, groupLegend());
  const stored = {};
  for (const m of D.modules) stored[m[M.group]] = (stored[m[M.group]] || 0) + m[M.stored];
  const table = el("table", {}, el("tr", {}, el("th", {}, "group"), el("th", {class: "num"}, "tensors"), el("th", {class: "num"}, "objects"),
                                    el("th", {class: "num"}, "elements"), el("th", {class: "num"}, "bytes"), el("th", {class: "num"}, "share"),
                                    el("th", {class: "num"}, "stored (listed tensors)")));
  for (const g of GROUPS) {
    const info = D.groups[g] || {tensors: 0, objects: 0, numel: 0, bytes: 0};
    table.appendChild(el("tr", {"data-group": g}, el("td", {}, el("span", {class: "swatch g-" + g}), g), el("td", {class: "num"}, count(info.tensors)),
      el("td", {class: "num"}, count(info.objects)), el("td", {class: "num"}, count(info.numel)), el("td", {class: "num"}, bytes(info.bytes)),
      el("td", {class: "num"}, pct(info.bytes, total).toFixed(1) + "%"), el("td", {class: "num"}, bytes(stored[g] || 0))));
  }
  section.appendChild(table);
  page.appendChild(section);
}

function moduleBytes() {
  if (!D.summary) return;
  const section = el("section", {id: "modules"});
  section.appendChild(el("h2", {}, "Bytes by module"));
  section.appendChild(el("p", {class: "muted"}, "One row per layer (a name up to its first index), largest first."));
  const rows = D.modules.map((m, i) => i).sort((a, b) => D.modules[b][M.bytes] - D.modules[a][M.bytes] || (D.modules[a][M.module] < D.modules[b][M.module] ? -1 : 1));
  const largest = rows.length ? D.modules[rows[0]][M.bytes] : 0;
  const table = el("table", {});
  const body = el("tbody", {});
  table.append(el("thead", {}, el("tr", {}, el("th", {}, "module"), el("th", {}, "group"), el("th", {class: "num"}, "tensors"),
                  el("th", {class: "num"}, "bytes"), el("th", {class: "num"}, "stored"), el("th", {style: "width:30%"}, ""))), body);
  let shown = 0;
  const more = el("button", {}, "show more");
  function add() {
    for (const i of rows.slice(shown, shown + 40)) {
      const m = D.modules[i];
      body.appendChild(el("tr", {}, el("td", {class: "name"}, m[M.module]), el("td", {}, m[M.group]), el("td", {class: "num"}, count(m[M.tensors])),
        el("td", {class: "num"}, bytes(m[M.bytes])), el("td", {class: "num"}, bytes(m[M.stored])),
        el("td", {}, el("div", {class: "bar g-" + m[M.group], style: "width:" + pct(m[M.bytes], largest) + "%"}))));
    }
    shown = Math.min(rows.length, shown + 40);
    more.hidden = shown >= rows.length;
  }
  more.addEventListener("click", add);
  add();
  section.append(table, more);
  page.appendChild(section);
}

function fileBytes() {
  if (!D.summary || !D.files.length) return;
  const section = el("section", {id: "files"});
  section.appendChild(el("h2", {}, "Bytes by file"));
  const largest = Math.max(...D.files.map(f => Math.max(f[F.size] || 0, f[F.referenced])));
  const table = el("table", {});
  const body = el("tbody", {});
  table.append(el("thead", {}, el("tr", {}, el("th", {}, "file"), el("th", {class: "num"}, "rank"), el("th", {class: "num"}, "size"),
                  el("th", {style: "width:40%"}, "model / optimizer / other"))), body);
  let shown = 0;
  const more = el("button", {}, "show more");
  function add() {
    for (const [i, f] of D.files.slice(shown, shown + 64).entries()) {
      const stack = el("div", {class: "stack", style: "width:" + Math.max(1, pct(f[F.size] || f[F.referenced], largest)) + "%"});
      const inFile = GROUPS.reduce((sum, g, k) => sum + f[F.groups + k], 0);
      GROUPS.forEach((g, k) => { if (f[F.groups + k]) stack.appendChild(el("span", {class: "g-" + g, style: "width:" + pct(f[F.groups + k], inFile) + "%", title: g + ": " + bytes(f[F.groups + k])})); });
      const name = el("td", {class: "name"}, f[F.file]);
      if (fileProblems.has(f[F.file])) name.appendChild(el("span", {class: "badge error"}, fileProblems.get(f[F.file]).length + " problems"));
      body.appendChild(el("tr", {"data-file": shown + i}, name, el("td", {class: "num"}, f[F.rank] === null ? "-" : f[F.rank]),
                          el("td", {class: "num"}, f[F.size] === null ? "missing" : bytes(f[F.size])), el("td", {}, stack)));
    }
    shown = Math.min(D.files.length, shown + 64);
    more.hidden = shown >= D.files.length;
  }
  more.addEventListener("click", add);
  add();
  section.append(groupLegend(), table, more);
  page.appendChild(section);
}

function duplicates() {
  const stored = D.tensors.map((t, i) => i).filter(i => D.tensors[i][T.duplicate] > 0).sort((a, b) => D.tensors[b][T.duplicate] - D.tensors[a][T.duplicate]);
  if (!D.summary) return;
  const section = el("section", {id: "duplicates"});
  section.appendChild(el("h2", {}, "Stored more than once"));
  if (!stored.length) { section.appendChild(el("p", {class: "muted"}, "Every box of every listed tensor is stored once.")); page.appendChild(section); return; }
  section.appendChild(el("p", {}, stored.length + " tensors hold boxes stored by more than one rank or file: " + bytes(D.duplicate_bytes) + " of copies."));
  const list = el("ul", {class: "problems"});
  for (const i of stored.slice(0, 50)) {
    const t = D.tensors[i];
    const button = el("button", {class: "link"}, t[T.fqn]);
    button.addEventListener("click", () => openTensor(i));
    list.appendChild(el("li", {}, button, " ", el("span", {class: "badge copies"}, "x" + t[T.copies]), " " + bytes(t[T.duplicate]) + " of copies"));
  }
  section.appendChild(list);
  if (stored.length > 50) section.appendChild(el("p", {class: "muted"}, "... and " + (stored.length - 50) + " more (tick \"stored more than once\" below)"));
  page.appendChild(section);
}

const tensorIndex = new Map(D.tensors.map((t, i) => [t[T.fqn], i]));
const state = {text: "", group: "", problems: false, copies: false, sort: "name", shown: PAGE};
let tensorBody = null, moreTensors = null, matchLine = null;

function matching() {
  const text = state.text.toLowerCase();
  const rows = [];
  D.tensors.forEach((t, i) => {
    if (text && !t[T.fqn].toLowerCase().includes(text)) return;
    if (state.group && t[T.group] !== state.group) return;
    if (state.problems && !t[T.problems].length && !chunkFilesBad(i)) return;
    if (state.copies && !(t[T.duplicate] > 0)) return;
    rows.push(i);
  });
  const key = {bytes: T.stored, chunks: T.chunks}[state.sort];
  if (key !== undefined) rows.sort((a, b) => D.tensors[b][key] - D.tensors[a][key] || a - b);
  return rows;
}

const badChunkFiles = new Map();
function chunkFilesBad(i) {  // does any chunk of tensor i sit in a file validate found a problem with?
  if (!fileProblems.size) return false;
  if (!badChunkFiles.has(i)) {
    const t = D.tensors[i], data = D.chunks[i], width = 2 * t[T.shape].length + 1;
    let bad = false;
    for (let at = width - 1; at < data.length && !bad; at += width) bad = data[at] >= 0 && badFile[data[at]];
    badChunkFiles.set(i, bad);
  }
  return badChunkFiles.get(i);
}

function tensorRow(i) {
  const t = D.tensors[i];
  const marks = el("td", {});
  const severities = {};
  for (const p of t[T.problems]) severities[D.problems[p][P.severity]] = (severities[D.problems[p][P.severity]] || 0) + 1;
  for (const s of ["error", "warning", "info"]) if (severities[s]) marks.appendChild(el("span", {class: "badge " + s}, severities[s] + " " + s + (severities[s] > 1 ? "s" : "")));
  if (chunkFilesBad(i)) marks.appendChild(el("span", {class: "badge error"}, "in a damaged file"));
  if (t[T.copies] > 1) marks.appendChild(el("span", {class: "badge copies"}, "x" + t[T.copies]));
  const row = el("tr", {class: "tensor", "data-tensor": i, "data-fqn": t[T.fqn]},
    el("td", {class: "name"}, t[T.fqn]), el("td", {}, t[T.group]), el("td", {}, t[T.dtype]), el("td", {class: "num"}, "[" + t[T.shape].join(", ") + "]"),
    el("td", {}, t[T.sharding] + (t[T.uneven] ? " uneven" : "")), el("td", {class: "num"}, count(t[T.chunks])), el("td", {class: "num"}, count(t[T.ranks])),
    el("td", {class: "num"}, bytes(t[T.bytes])), el("td", {class: "num"}, bytes(t[T.stored])), marks);
  row.addEventListener("click", () => toggle(row, i));
  return row;
}

function renderTensors() {
  const rows = matching();
  tensorBody.replaceChildren();
  for (const i of rows.slice(0, state.shown)) tensorBody.appendChild(tensorRow(i));
  matchLine.textContent = rows.length + " of " + D.tensors.length + " tensors" + (rows.length > state.shown ? ", first " + state.shown + " shown" : "");
  moreTensors.hidden = rows.length <= state.shown;
}

function tensors() {
  const section = el("section", {id: "tensors"});
  section.appendChild(el("h2", {}, "Tensors"));
  section.appendChild(el("p", {class: "muted"}, "Click a tensor to draw the boxes each rank and file holds."));
  const search = el("input", {type: "search", placeholder: "filter by name", id: "filter"});
  search.addEventListener("input", () => { state.text = search.value; state.shown = PAGE; renderTensors(); });
  const group = el("select", {id: "group"}, el("option", {value: ""}, "all groups"), ...GROUPS.map(g => el("option", {value: g}, g)));
  group.addEventListener("change", () => { state.group = group.value; state.shown = PAGE; renderTensors(); });
  const sort = el("select", {id: "sort"}, el("option", {value: "name"}, "by name"), el("option", {value: "bytes"}, "by stored bytes"), el("option", {value: "chunks"}, "by chunks"));
  sort.addEventListener("change", () => { state.sort = sort.value; renderTensors(); });
  const withProblems = el("input", {type: "checkbox", id: "with-problems"});
  withProblems.addEventListener("change", () => { state.problems = withProblems.checked; state.shown = PAGE; renderTensors(); });
  const withCopies = el("input", {type: "checkbox", id: "with-copies"});
  withCopies.addEventListener("change", () => { state.copies = withCopies.checked; state.shown = PAGE; renderTensors(); });
  matchLine = el("span", {class: "muted"});
  const controls = el("div", {class: "controls"}, search, group, sort);
  if (D.validated) controls.appendChild(el("label", {}, withProblems, " with problems"));
  controls.append(el("label", {}, withCopies, " stored more than once"), matchLine);
  section.appendChild(controls);
  tensorBody = el("tbody", {});
  section.appendChild(el("table", {}, el("thead", {}, el("tr", {}, ...["tensor", "group", "dtype", "shape", "sharding"].map(h => el("th", {}, h)),
    ...["chunks", "ranks", "bytes", "stored"].map(h => el("th", {class: "num"}, h)), el("th", {}, ""))), tensorBody));
  moreTensors = el("button", {}, "show more");
  moreTensors.addEventListener("click", () => { state.shown += PAGE; renderTensors(); });
  section.appendChild(moreTensors);
  page.appendChild(section);
  renderTensors();
}

function toggle(row, i) {
  const next = row.nextElementSibling;
  if (next && next.classList.contains("detail")) { next.remove(); row.classList.remove("open"); return; }
  row.classList.add("open");
  row.after(el("tr", {class: "detail"}, el("td", {colspan: "10"}, detail(i))));
}

function openTensor(i) {
  const t = D.tensors[i];
  const search = document.getElementById("filter");
  search.value = t[T.fqn]; state.text = t[T.fqn]; state.shown = PAGE;
  renderTensors();
  const row = [...tensorBody.querySelectorAll("tr.tensor")].find(r => Number(r.dataset.tensor) === i);
  if (row) { if (!row.classList.contains("open")) toggle(row, i); row.scrollIntoView({block: "start"}); }
}

// the boxes of tensor i: bars along one dimension, or a grid of two (rows x columns); the k-th
// chunk holding the same box as earlier ones is drawn in copy k (a lane of bars, a grid of its own)
function detail(i) {
  const t = D.tensors[i], shape = t[T.shape], ndim = shape.length, axes = t[T.axes], data = D.chunks[i];
  const width = 2 * ndim + 1, total = data.length / width, drawn = Math.min(total, DRAW_LIMIT);
  const box = el("div", {class: "map"});
  const seen = new Map();
  const chunks = [];
  for (let c = 0; c < drawn; c++) {
    const row = data.slice(c * width, (c + 1) * width);
    const key = row.slice(0, 2 * ndim).join(",");
    const copy = seen.get(key) || 0;
    seen.set(key, copy + 1);
    chunks.push({index: c, offsets: row.slice(0, ndim), sizes: row.slice(ndim, 2 * ndim), file: row[2 * ndim], copy: copy});
  }
  const copies = chunks.reduce((m, c) => Math.max(m, c.copy + 1), 1);
  const split = new Set(axes);
  const unshown = [...Array(ndim).keys()].filter(d => !split.has(d) && chunks.some(c => c.sizes[d] !== shape[d] && c.sizes.every(s => s > 0)));
  let how;
  if (axes.length === 2) how = "grid: dim " + axes[0] + " down (" + shape[axes[0]] + " rows), dim " + axes[1] + " across (" + shape[axes[1]] + ")";
  else if (axes.length === 1) how = "bars along dim " + axes[0] + " (" + shape[axes[0]] + ")" + (copies > 1 ? ", one lane per copy" : "");
  else how = "a 0-d tensor: one box";
  box.appendChild(el("div", {class: "axis"}, how + (unshown.length ? "; also split along dims " + unshown.join(", ") + " (not drawn)" : "")));
  const label = c => holderName(c.file) + "\noffsets [" + c.offsets.join(", ") + "] sizes [" + c.sizes.join(", ") + "]\n" +
                     bytes(c.sizes.reduce((a, b) => a * b, 1) * (t[T.bytes] / Math.max(1, shape.reduce((a, b) => a * b, 1)))) + (c.copy ? "\ncopy " + (c.copy + 1) : "");
  function rect(svg, c, x, y, w, h) {
    const node = svgEl("rect", {class: "chunk" + (c.file >= 0 && badFile[c.file] ? " bad" : ""), x: x, y: y, width: w, height: h,
      fill: colour(c.file >= 0 ? holders[c.file] : -1), "vector-effect": "non-scaling-stroke",
      "data-chunk": c.index, "data-offsets": c.offsets.join(","), "data-sizes": c.sizes.join(","), "data-file": c.file, "data-copy": c.copy});
    const title = svgEl("title", {});
    title.textContent = label(c);
    node.appendChild(title);
    svg.appendChild(node);
  }
  const attrs = {class: "chunk-map", "data-tensor": i, "data-axes": axes.join(","), preserveAspectRatio: "none"};
  if (axes.length === 2) {
    const [a, b] = axes, rows = Math.max(1, shape[a]), cols = Math.max(1, shape[b]);
    const pixelsWide = copies > 1 ? 360 : 620, pixelsHigh = Math.round(Math.min(520, Math.max(90, pixelsWide * rows / cols)));
    const panels = el("div", {class: "copies-row"});
    for (let k = 0; k < copies; k++) {
      const svg = svgEl("svg", {...attrs, "data-copy": k, viewBox: "0 0 " + cols + " " + rows, width: pixelsWide, height: pixelsHigh});
      for (const c of chunks) if (c.copy === k) rect(svg, c, c.offsets[b], c.offsets[a], c.sizes[b], c.sizes[a]);
      panels.appendChild(el("div", {}, copies > 1 ? el("div", {class: "axis"}, "copy " + (k + 1)) : null, svg));
    }
    box.appendChild(panels);
  } else {
    const a = axes.length ? axes[0] : -1, length = a >= 0 ? Math.max(1, shape[a]) : 1;
    const svg = svgEl("svg", {...attrs, viewBox: "0 0 " + length + " " + copies, width: 720, height: 26 * copies});
    for (const c of chunks) rect(svg, c, a >= 0 ? c.offsets[a] : 0, c.copy + 0.1, a >= 0 ? c.sizes[a] : 1, 0.8);
    box.appendChild(svg);
  }
  const present = [...new Set(chunks.map(c => c.file))].sort((x, y) => (holders[x] ?? -1) - (holders[y] ?? -1));
  const legend = el("div", {class: "muted"});
  for (const f of present.slice(0, 64)) legend.append(el("span", {class: "swatch", style: "background:" + colour(f >= 0 ? holders[f] : -1)}), holderName(f));
  if (present.length > 64) legend.append(" ... and " + (present.length - 64) + " more files");
  box.appendChild(legend);
  if (drawn < total) box.appendChild(el("p", {class: "muted"}, "Drawn: the first " + count(drawn) + " of " + count(total) + " chunks."));
  for (const p of t[T.problems]) box.appendChild(el("div", {}, el("span", {class: "badge " + D.problems[p][P.severity]}, D.problems[p][P.severity] + " " + D.problems[p][P.code]), " ", D.problems[p][P.message]));
  const list = el("table", {class: "chunk-list"}, el("tr", {}, el("th", {class: "num"}, "#"), el("th", {}, "held by"), el("th", {}, "offsets"),
                  el("th", {}, "sizes"), el("th", {class: "num"}, "copy")));
  for (const c of chunks.slice(0, LIST_LIMIT)) list.appendChild(el("tr", {}, el("td", {class: "num"}, c.index), el("td", {class: "name"}, holderName(c.file)),
    el("td", {}, "[" + c.offsets.join(", ") + "]"), el("td", {}, "[" + c.sizes.join(", ") + "]"), el("td", {class: "num"}, c.copy + 1)));
  box.appendChild(list);
  if (total > LIST_LIMIT) box.appendChild(el("p", {class: "muted"}, "Listed: the first " + LIST_LIMIT + " of " + count(total) + " chunks (`ckpttool inspect --chunks` lists all)."));
  return box;
}

header();
problems();
groupBytes();
moduleBytes();
fileBytes();
duplicates();
tensors();
document.body.setAttribute("data-ready", "true");
})();
"""
