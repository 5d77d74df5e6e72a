"""One self-contained HTML page from the facts of :func:`fagen.explain.explain`.

No network: CSS, JavaScript and the SVG drawings are inline. Everything static (the
tile matrix, the shared-memory bar, the tables, the highlighted source with its
Algorithm 4 anchors) is drawn here, so the page reads without JavaScript; the
inline script adds the step control, which walks one CTA through its inner loop
from the same facts (embedded as JSON).
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from .facts import ALG4_REF, KIND_NAME

_TOKEN = re.compile(
    r"(?P<comment>//[^\n]*|/\*[\s\S]*?\*/)"
    r"|(?P<string>\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])')"
    r"|(?P<pre>^[ \t]*#[ \t]*\w+)"
    r"|(?P<number>\b\d+(?:\.\d*)?(?:[eE][+-]?\d+)?[fFuUlL]*\b)"
    r"|(?P<keyword>\b(?:if|else|for|while|do|return|continue|break|const|constexpr|static|inline|extern|"
    r"template|typename|struct|namespace|using|static_assert|sizeof|auto|void|bool|int|unsigned|long|"
    r"float|double|char|short|true|false|__global__|__device__|__forceinline__|__launch_bounds__|"
    r"__shared__|__restrict__)\b)",
    re.MULTILINE,
)

MATRIX_PX = 560

_CSS = """
:root { --skip: #e5e7eb; --part: #f59e0b; --full: #14b8a6; --hl: #2563eb; --ink: #111827; --mute: #6b7280; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--ink); margin: 0; background: #f9fafb; }
header { background: #111827; color: #f9fafb; padding: 14px 24px; }
header h1 { font-size: 18px; margin: 0 0 4px; font-family: ui-monospace, monospace; }
header p { margin: 0; color: #d1d5db; }
nav { padding: 6px 24px; background: #1f2937; }
nav a { color: #93c5fd; margin-right: 18px; text-decoration: none; }
section { background: #fff; margin: 16px 24px; padding: 12px 18px; border: 1px solid #e5e7eb; border-radius: 8px; }
h2 { font-size: 16px; margin: 4px 0 10px; }
.row { display: flex; gap: 24px; flex-wrap: wrap; align-items: flex-start; }
#matrix { max-width: 100%; height: auto; background: #fff; border: 1px solid #9ca3af; flex: none; }
.tile.s { fill: var(--skip); } .tile.p { fill: var(--part); } .tile.f { fill: var(--full); }
.gridline { stroke: #fff; stroke-width: 1; vector-effect: non-scaling-stroke; }
.diag { stroke: #b91c1c; stroke-width: 1.5; fill: none; vector-effect: non-scaling-stroke; stroke-dasharray: 4 3; }
#cta-band { fill: rgba(37, 99, 235, 0.10); stroke: var(--hl); stroke-width: 2; vector-effect: non-scaling-stroke; }
#dq-band { fill: rgba(124, 58, 237, 0.12); }
.done { fill: rgba(17, 24, 39, 0.28); }
#cursor { fill: none; stroke: #111827; stroke-width: 3; vector-effect: non-scaling-stroke; }
.legend span { display: inline-block; margin-right: 14px; }
.sw { display: inline-block; width: 12px; height: 12px; vertical-align: -1px; margin-right: 4px; border: 1px solid #9ca3af; }
#stepper { min-width: 360px; flex: 1; }
#stepper .controls { display: flex; gap: 8px; align-items: center; flex-wrap: wrap; margin-bottom: 8px; }
#stepper button { font: inherit; padding: 2px 10px; }
#step-label { font-family: ui-monospace, monospace; display: block; margin: 6px 0; min-height: 2.8em; }
#alg4-lines { list-style: none; padding: 0; margin: 0; font-size: 13px; }
#alg4-lines li { padding: 2px 6px; border-left: 3px solid transparent; color: var(--mute); cursor: pointer; }
#alg4-lines li b { display: inline-block; width: 2.2em; color: var(--ink); }
#alg4-lines li.absent { display: none; }
#alg4-lines li.on { color: var(--ink); border-left-color: var(--hl); background: #eff6ff; }
#smem-bar { width: 100%; height: 56px; display: block; }
.buflabels { position: relative; height: 18px; font: 11px ui-monospace, monospace; }
.buflabels span { position: absolute; top: 0; padding-left: 3px; border-left: 1px solid #9ca3af; }
.buflabels span.m { color: #b91c1c; border-left-color: #b91c1c; }
.buf { stroke: #fff; stroke-width: 1; vector-effect: non-scaling-stroke; }
.buf.T { fill: #60a5fa; } .buf.float { fill: #a78bfa; } .buf.on { fill: var(--hl); }
.free { fill: #f3f4f6; }
.cap { stroke: #b91c1c; stroke-width: 2; vector-effect: non-scaling-stroke; }
.buflabel { font: 11px ui-monospace, monospace; fill: #111827; }
table { border-collapse: collapse; margin: 6px 0 12px; }
th, td { border: 1px solid #e5e7eb; padding: 3px 8px; text-align: left; font-variant-numeric: tabular-nums; }
th { background: #f3f4f6; }
td.num { text-align: right; }
tr.on td { background: #eff6ff; }
.bar { display: inline-block; height: 10px; background: #60a5fa; vertical-align: middle; }
.note { color: var(--mute); }
.sass { max-height: 340px; overflow-y: auto; }
pre.src { font: 12px/1.4 ui-monospace, SFMono-Regular, Menlo, monospace; background: #0f172a; color: #e2e8f0;
  padding: 10px 0; overflow: auto; max-height: 640px; border-radius: 6px; }
pre.src .ln { display: block; padding: 0 12px 0 0; white-space: pre; }
pre.src .ln::before { content: attr(data-n); display: inline-block; width: 4.5em; padding-right: 1em; text-align: right; color: #475569; }
pre.src .ln.on { background: #1e3a8a; }
.k { color: #f472b6; } .c { color: #94a3b8; font-style: italic; } .s { color: #86efac; } .n { color: #fcd34d; } .p { color: #67e8f9; }
a.alg4 { color: #fde68a; font-style: normal; font-weight: 600; text-decoration: underline dotted; cursor: pointer; }
"""

_JS = r"""
(function () {
  'use strict';
  var F = JSON.parse(document.getElementById('fagen-facts').textContent);
  var $ = function (id) { return document.getElementById(id); };
  var SVGNS = 'http://www.w3.org/2000/svg';
  var bwd = F.direction === 'bwd';
  var br = F.block_r, bc = F.block_c, nq = F.seqlen_q, nk = F.seqlen_k;
  var A = F.algorithm4;
  var kindAt = function (i, j) {
    var runs = F.tile_map[i];
    for (var r = 0; r < runs.length; r++) if (j >= runs[r][1] && j < runs[r][2]) return runs[r][0];
    return 's';
  };
  // steps of one CTA: prologue, one per inner-loop block, epilogue
  function steps(cta) {
    var rg = F.cta_ranges[cta], out = [{phase: 'prologue', lines: A.prologue}];
    for (var b = rg[0]; b < rg[1]; b++) {
      var i = bwd ? b : cta, j = bwd ? cta : b;
      var kind = kindAt(i, j);  // a fully visible tile skips the mask (line 12)
      out.push({phase: 'loop', i: i, j: j, kind: kind, lines: kind === 'f' ? A.loop.filter(function (n) { return n !== 12; }) : A.loop});
    }
    out.push({phase: 'epilogue', lines: A.epilogue});
    return out;
  }
  var ctaInput = $('cta'), stepInput = $('step'), label = $('step-label');
  var cur = {cta: 0, step: 0, list: steps(0)};
  function rect(el, x, y, w, h) {
    el.setAttribute('x', x); el.setAttribute('y', y);
    el.setAttribute('width', Math.max(0, w)); el.setAttribute('height', Math.max(0, h));
  }
  function tileBox(i, j) {
    var x = j * bc, y = i * br;
    return [x, y, Math.min(nk, x + bc) - x, Math.min(nq, y + br) - y];
  }
  function setLines(lines, extra) {
    var on = {};
    lines.forEach(function (n) { on[n] = true; });
    (extra || []).forEach(function (n) { on[n] = true; });
    document.querySelectorAll('#alg4-lines li').forEach(function (li) {
      li.classList.toggle('on', !!on[li.getAttribute('data-line')]);
    });
    var bufs = {};
    Object.keys(on).forEach(function (n) { (A.buffers[n] || []).forEach(function (b) { bufs[b] = true; }); });
    document.querySelectorAll('.buf').forEach(function (el) { el.classList.toggle('on', !!bufs[el.getAttribute('data-name')]); });
    document.querySelectorAll('#smem-table tr[data-name]').forEach(function (el) { el.classList.toggle('on', !!bufs[el.getAttribute('data-name')]); });
  }
  function draw() {
    var s = cur.list[cur.step], cta = cur.cta, band = $('cta-band');
    if (bwd) rect(band, cta * bc, 0, Math.min(nk, cta * bc + bc) - cta * bc, nq);
    else rect(band, 0, cta * br, nk, Math.min(nq, cta * br + br) - cta * br);
    var done = $('done'); while (done.firstChild) done.removeChild(done.firstChild);
    for (var k = 1; k < cur.step && k < cur.list.length - 1; k++) {
      var t = cur.list[k], b = tileBox(t.i, t.j), r = document.createElementNS(SVGNS, 'rect');
      r.setAttribute('class', 'done'); rect(r, b[0], b[1], b[2], b[3]); done.appendChild(r);
    }
    var cursor = $('cursor'), dq = $('dq-band'), text;
    var n = cur.list.length - 2;
    if (s.phase === 'loop') {
      var b2 = tileBox(s.i, s.j); rect(cursor, b2[0], b2[1], b2[2], b2[3]);
      if (bwd) rect(dq, 0, b2[1], nk, b2[3]); else rect(dq, 0, 0, 0, 0);
      var mask = s.kind === 'f' ? 'fully visible: no mask math' : (s.kind === 'p' ? 'mask math (line 12)' : 'no allowed element');
      text = 'CTA ' + cta + ', step ' + cur.step + ' of ' + n + ': tile (Q block ' + s.i + ', K/V block ' + s.j + '), ' + mask +
        (bwd ? '; dQ_' + s.i + ' accumulated in HBM (line 21)' : '');
    } else {
      rect(cursor, 0, 0, 0, 0); rect(dq, 0, 0, 0, 0);
      text = 'CTA ' + cta + ': ' + (s.phase === 'prologue' ? 'before the inner loop (' + n + ' visited ' +
        (bwd ? 'Q' : 'K/V') + ' blocks follow)' : 'after the inner loop');
    }
    label.textContent = text;
    stepInput.max = cur.list.length - 1; stepInput.value = cur.step;
    setLines(s.lines);
  }
  function go(step) { cur.step = Math.max(0, Math.min(cur.list.length - 1, step)); draw(); }
  ctaInput.addEventListener('input', function () { cur.cta = +ctaInput.value; cur.list = steps(cur.cta); go(0); });
  stepInput.addEventListener('input', function () { go(+stepInput.value); });
  $('prev').addEventListener('click', function () { go(cur.step - 1); });
  $('next').addEventListener('click', function () { go(cur.step + 1); });
  var timer = null;
  $('play').addEventListener('click', function () {
    if (timer) { clearInterval(timer); timer = null; $('play').textContent = 'play'; return; }
    $('play').textContent = 'pause';
    timer = setInterval(function () {
      if (cur.step >= cur.list.length - 1) { clearInterval(timer); timer = null; $('play').textContent = 'play'; return; }
      go(cur.step + 1);
    }, 600);
  });
  // source anchors -> step view; Algorithm 4 list -> source
  function stepFor(line) {
    var L = +line;
    if (A.loop.indexOf(L) >= 0 && cur.list.length > 2) return 1;
    if (A.epilogue.indexOf(L) >= 0) return cur.list.length - 1;
    return 0;
  }
  document.querySelectorAll('a.alg4').forEach(function (a) {
    a.addEventListener('click', function (ev) {
      ev.preventDefault();
      var nums = a.getAttribute('data-alg4').split(' ');
      go(stepFor(nums[0]));
      setLines(cur.list[cur.step].lines, nums);
      $('tiles').scrollIntoView({behavior: 'smooth'});
    });
  });
  document.querySelectorAll('#alg4-lines li').forEach(function (li) {
    li.addEventListener('click', function () {
      var n = li.getAttribute('data-line'), hit = document.querySelector('a.alg4[data-first="' + n + '"]');
      document.querySelectorAll('pre.src .ln.on').forEach(function (el) { el.classList.remove('on'); });
      if (hit) { var ln = hit.closest('.ln'); ln.classList.add('on'); ln.scrollIntoView({block: 'center'}); }
    });
  });
  ctaInput.max = Math.max(0, F.grid.ctas - 1);
  // a link may pick the CTA and step: page.html#cta=3&step=2
  var want = {};
  location.hash.replace(/^#/, '').split('&').forEach(function (kv) { var p = kv.split('='); want[p[0]] = +p[1]; });
  if (want.cta >= 0 && want.cta < F.grid.ctas) { cur.cta = want.cta; ctaInput.value = want.cta; cur.list = steps(cur.cta); }
  go(want.step >= 0 ? want.step : 0);
  document.body.setAttribute('data-ready', '1');
})();
"""

_ERRORS_JS = """window.__fagenErrors = [];
window.addEventListener('error', function (e) {
  window.__fagenErrors.push(String(e.message));
  document.documentElement.setAttribute('data-js-errors', window.__fagenErrors.join(' | '));
});"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


# --------------------------------------------------------------------------- tiles
def tiles_svg(f: dict[str, Any]) -> str:
    """The Nq x Nk matrix in element coordinates: one rect per run of equal tile kind."""
    br, bc, nq, nk = f["block_r"], f["block_c"], f["seqlen_q"], f["seqlen_k"]
    scale = MATRIX_PX / max(nq, nk)  # the longer side is MATRIX_PX pixels
    parts = [f'<svg id="matrix" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {nk} {nq}" '
             f'width="{max(1, round(nk * scale))}" height="{max(1, round(nq * scale))}" '
             f'preserveAspectRatio="xMinYMin meet" role="img" aria-label="score matrix tiles">', '<g id="tile-runs">']
    for i, runs in enumerate(f["tile_map"]):
        y0, y1 = i * br, min(nq, (i + 1) * br)
        for letter, j0, j1 in runs:
            x0, x1 = j0 * bc, min(nk, j1 * bc)
            parts.append(f'<rect class="tile {letter}" data-i="{i}" data-j0="{j0}" data-j1="{j1}" '
                         f'x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}"><title>Q block {i}, K/V blocks '
                         f'{j0}..{j1 - 1}: {KIND_NAME[letter]}</title></rect>')
    parts.append("</g><g>")
    px = MATRIX_PX / max(nq, nk)  # pixels per element
    if bc * px >= 4:  # tile borders only while a tile is a few pixels wide
        parts += [f'<line class="gridline" x1="{j * bc}" y1="0" x2="{j * bc}" y2="{nq}"/>' for j in range(1, f["grid"]["kv_blocks"])]
    if br * px >= 4:
        parts += [f'<line class="gridline" x1="0" y1="{i * br}" x2="{nk}" y2="{i * br}"/>' for i in range(1, f["grid"]["q_blocks"])]
    parts.append("</g>")
    top_left = f.get("causal_align") == "top_left"
    shift = 0 if top_left else nk - nq  # row r's diagonal key is r + shift (fagen.masking)
    align = "top-left" if top_left else "bottom-right"
    left, right = f.get("window", (-1, -1))

    def boundary(c: int, title: str) -> None:  # the line x = y + c, clipped to the matrix
        y0, y1 = max(0, -c), min(nq, nk - c)
        if y1 > y0:
            parts.append(f'<path class="diag" d="M {y0 + c} {y0} L {y1 + c} {y1}"><title>{_e(title)}</title></path>')

    if f["causal"]:  # row r sees keys col <= r + shift
        boundary(shift + 1, f"causal boundary ({align})")
    if right >= 0 and not f["causal"]:  # row r sees keys col <= r + shift + right (causal: right is 0)
        boundary(shift + right + 1, f"window right = {right} ({align})")
    if left >= 0:  # row r sees keys col >= r + shift - left
        boundary(shift - left, f"window left = {left} ({align})")
    parts.append('<rect id="dq-band" x="0" y="0" width="0" height="0"/><g id="done"></g>'
                 '<rect id="cta-band" x="0" y="0" width="0" height="0"/><rect id="cursor" x="0" y="0" width="0" height="0"/></svg>')
    return "".join(parts)


def _kernel_links(f: dict[str, Any]) -> str:
    spans = f["algorithm4"]["kernel_lines"]
    links = [f'<a href="#L{spans[k["kernel"]][0]}"><code>{_e(k["kernel"])}</code></a> ({_e(k["role"])}, line '
             f'{spans[k["kernel"]][0]})' for k in f["kernels"] if k["kernel"] in spans]
    return "Entry points: " + ", ".join(links) if links else ""


def _fwd_note(f: dict[str, Any]) -> str:
    if f["direction"] != "fwd":
        return ""
    return ('<p class="note" id="fwd-note">The forward pass (online softmax) is not Algorithm 4; the lines listed '
            "are those its comments name, and its steps are the K/V blocks each Q block's CTA visits.</p>")


def _alg4_list(f: dict[str, Any]) -> str:
    a = f["algorithm4"]
    present = set(a["prologue"] + a["loop"] + a["epilogue"])
    items = []
    for n, text in a["texts"].items():
        where = ("" if int(n) in present else " absent")
        paper = a.get("paper", {}).get(n, "")
        items.append(f'<li class="alg4-line{where}" id="alg4-{n}" data-line="{n}" title="paper: {_e(paper)}">'
                     f'<b>{n}</b>{_e(text)}</li>')
    return '<ol id="alg4-lines">' + "".join(items) + "</ol>"


# --------------------------------------------------------------------------- shared memory
def smem_svg(f: dict[str, Any]) -> str:
    """Buffers at their byte offsets on a bar of M = sram_bytes (the capacity mark at M)."""
    sm = f["smem"]
    cap, total = sm["capacity_bytes"], sm["total_bytes"]
    width = max(cap, total)
    parts = [f'<svg id="smem-bar" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} 56" preserveAspectRatio="none">',
             f'<rect class="free" x="0" y="8" width="{cap}" height="40"/>']
    for b in sm["buffers"]:
        parts.append(f'<rect class="buf {_e(b["ctype"])}" data-name="{_e(b["name"])}" data-offset="{b["offset"]}" '
                     f'data-bytes="{b["bytes"]}" x="{b["offset"]}" y="8" width="{b["bytes"]}" height="40">'
                     f'<title>{_e(b["name"])}: {b["count"]} x {_e(b["ctype"])} at byte {b["offset"]} ({b["bytes"]} B)</title></rect>')
    parts.append(f'<line class="cap" x1="{cap}" y1="0" x2="{cap}" y2="56"/></svg>')
    labels = "".join(f'<span style="left:{100 * b["offset"] / width:.3f}%">{_e(b["name"])}</span>'
                     for b in sm["buffers"] if b["bytes"] >= 0.025 * width)
    return "".join(parts) + f'<div class="buflabels">{labels}<span class="m" style="left:{100 * cap / width:.3f}%">M</span></div>'



def _smem_section(f: dict[str, Any]) -> str:
    sm, tc = f["smem"], f["tile_choice"]
    rows = "".join(
        f'<tr data-name="{_e(b["name"])}"><td><code>s.{_e(b["name"])}</code></td><td>{_e(b["ctype"])}</td>'
        f'<td class="num">{b["count"]}</td><td class="num">{b["offset"]}</td><td class="num">{b["bytes"]}</td>'
        f'<td>{", ".join(str(x) for x in b["alg4"]) or "-"}</td></tr>' for b in sm["buffers"])
    pct = 100.0 * sm["total_bytes"] / sm["capacity_bytes"]
    choice = "".join(f"<li>{_e(r)}</li>" for r in tc["reasons"].values())
    return (
        f'<section id="smem"><h2>Shared memory: {sm["total_bytes"]} B of M = {sm["capacity_bytes"]} B ({pct:.1f}%)</h2>'
        f'{smem_svg(f)}'
        '<p class="legend"><span><i class="sw" style="background:#60a5fa"></i>dtype tile</span>'
        '<span><i class="sw" style="background:#a78bfa"></i>fp32</span><span><i class="sw" style="background:#f3f4f6"></i>free</span>'
        '<span><i class="sw" style="background:#b91c1c"></i>M</span><span><i class="sw" style="background:#2563eb"></i>used by the highlighted lines</span></p>'
        '<table id="smem-table"><tr><th>buffer</th><th>type</th><th>elements</th><th>offset (B)</th><th>bytes</th>'
        f'<th>Algorithm 4 lines</th></tr>{rows}</table>'
        '<table id="tile-choice"><tr><th></th><th>B_r</th><th>B_c</th><th>smem (B)</th><th>fits M</th></tr>'
        f'<tr><td>paper (line 2)</td><td class="num">{tc["paper"]["block_r"]}</td><td class="num">{tc["paper"]["block_c"]}</td>'
        f'<td class="num">{tc["paper"]["smem_bytes"] if tc["paper"]["smem_bytes"] is not None else "n/a"}</td><td>{"yes" if tc["paper"]["fits"] else "no"}</td></tr>'
        f'<tr><td>used</td><td class="num">{tc["used"]["block_r"]}</td><td class="num">{tc["used"]["block_c"]}</td>'
        f'<td class="num">{tc["used"]["smem_bytes"]}</td><td>{"yes" if tc["used"]["fits"] else "no"}</td></tr></table>'
        f'<ul id="tile-reasons">{choice}</ul></section>')


# --------------------------------------------------------------------------- codegen knobs
def _codegen_section(f: dict[str, Any]) -> str:
    """The family's codegen knobs: each one's value and where it came from (table, start, user)."""
    cg = f.get("codegen")
    if not cg:
        return ""
    rows = "".join(f'<tr><td><code>{_e(n)}</code></td><td><code>{_e(k["constant"])}</code></td>'
                   f'<td class="num">{k["value"]}</td><td>{_e(k["source"])}</td><td class="num">{k["start"]}</td></tr>'
                   for n, k in cg["knobs"].items())
    note = f'<p class="note">{_e(cg["note"])}</p>' if cg.get("note") else ""
    return (f'<section id="codegen"><h2>Codegen knobs (class <code>{_e(cg["class"])}</code>)</h2>{note}'
            '<table id="codegen-table"><tr><th>knob</th><th>constant</th><th>value</th><th>source</th>'
            f'<th>starting point</th></tr>{rows}</table></section>')


# --------------------------------------------------------------------------- resources
def _resources_section(f: dict[str, Any]) -> str:
    res, h = f["resources"], f["hbm"]
    out = ['<section id="resources"><h2>Resources</h2>']
    if res.get("error"):
        out.append(f'<p class="note">compile: {_e(res["error"])}</p>')
    if res.get("kernels"):
        out.append('<table id="resource-table"><tr><th>kernel</th><th>registers</th><th>spills (B)</th><th>smem (B)</th>'
                   '<th>blocks/SM</th><th>occupancy</th><th>limited by</th></tr>')
        for k in res["kernels"]:
            o = k["occupancy"]
            out.append(f'<tr><td><code>{_e(k["kernel"])}</code></td><td class="num">{k["registers"]}</td>'
                       f'<td class="num">{k["spill_bytes"]}</td><td class="num">{k["smem_bytes"]}</td>'
                       f'<td class="num">{o["blocks_per_sm"]}</td><td class="num">{100 * o["fraction"]:.0f}%</td>'
                       f'<td>{_e(o["limiter"])}</td></tr>')
        out.append("</table>")
    sass = res.get("sass")
    if sass:
        out.append('<h3>SASS instruction mix (opcode counts in the code)</h3><div id="sass" class="row">')
        tables = [(f"{k}", m) for k, m in sass.items()]
        for k, m in (res.get("sass_loop") or {}).items():
            if k == f["kernel"]:
                tables.insert(1 if tables and tables[0][0] == k else 0, (f"{k}: its largest loop", m))
        for title, mix in tables:
            peak = max(mix.values(), default=1) or 1
            rows = "".join(f'<tr><td><code>{_e(op)}</code></td><td class="num">{v}</td>'
                           f'<td><span class="bar" style="width:{int(120 * v / peak)}px"></span></td></tr>'
                           for op, v in mix.items())
            out.append(f'<div class="sass"><table><tr><th colspan="3"><code>{_e(title)}</code></th></tr>{rows}</table></div>')
        out.append("</div>")
    else:
        out.append(f'<p class="note">SASS instruction mix: not available ({_e(res.get("sass_note") or "no disassembler")}).</p>')
    model = h.get("model_bytes")
    out.append(
        f'<h3>HBM traffic (one batch, one head; N_q = {f["seqlen_q"]}, N_k = {f["seqlen_k"]}, d = {f["head_dim"]}, '
        f'M = {h["sram_elements"]} elements)</h3><table id="hbm-table">'
        f'<tr><td>FlashAttention, {_e(h["theorem"])}: &Theta;(N<sub>q</sub> N<sub>k</sub> d<sup>2</sup> / M)</td>'
        f'<td class="num">{h["flash_accesses"]:.4g} accesses</td></tr>'
        f'<tr><td>standard attention: &Theta;((N<sub>q</sub> + N<sub>k</sub>) d + N<sub>q</sub> N<sub>k</sub>)</td>'
        f'<td class="num">{h["standard_accesses"]:.4g} accesses</td></tr>'
        f'<tr><td>cost model, this tiling (bytes, all kernels)</td><td class="num">'
        f'{_fmt_bytes(model) if model is not None else "n/a"}</td></tr></table></section>')
    return "".join(out)


# --------------------------------------------------------------------------- source
def _tokens(source: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    for m in _TOKEN.finditer(source):
        if m.start() > pos:
            out.append(("", source[pos:m.start()]))
        out.append((m.lastgroup or "", m.group()))
        pos = m.end()
    out.append(("", source[pos:]))
    return out


_CLS = {"comment": "c", "string": "s", "pre": "p", "number": "n", "keyword": "k"}


def highlight(source: str) -> str:
    """The source as ``<span class="ln" id="L{n}">`` lines; Algorithm 4 comments link to the step view."""
    lines: list[list[str]] = [[]]
    for kind, text in _tokens(source):
        for k, piece in enumerate(text.split("\n")):
            if k:
                lines.append([])
            if not piece:
                continue
            body = _e(piece)
            if kind == "comment":
                nums: list[int] = []
                for m in ALG4_REF.finditer(piece):
                    a = int(m.group(1))
                    nums += [x for x in range(a, (int(m.group(2)) if m.group(2) else a) + 1) if x not in nums]
                if nums:
                    body = (f'<a class="alg4" href="#tiles" data-first="{nums[0]}" '
                            f'data-alg4="{" ".join(map(str, nums))}">{body}</a>')
            cls = _CLS.get(kind)
            lines[-1].append(f'<span class="{cls}">{body}</span>' if cls else body)
    if lines and not lines[-1]:
        lines.pop()
    return "".join(f'<span class="ln" id="L{n}" data-n="{n}">{"".join(parts)}</span>'
                   for n, parts in enumerate(lines, 1))


# --------------------------------------------------------------------------- page
def render_html(f: dict[str, Any]) -> str:
    """The whole page for the facts ``f``."""
    t = f["tiles"]
    flags = ", ".join(x for x in ("causal", "key_padding", "dropout") if f[x])
    spec = f.get("spec", {})
    extra = [x for x in ("softcap", "alibi", "attn_mask", "bias", "bias_grad", "varlen", "deterministic") if spec.get(x)]
    if spec.get("window"):
        extra.insert(0, "window ({}, {})".format(*f.get("window", (-1, -1))))
    if spec.get("causal_align") == "top_left":
        extra.insert(0, "top-left aligned")
    flags = ", ".join(filter(None, [flags] + extra)) or "no mask"
    who = ("one CTA per K/V block j (grid x), inner loop over Q blocks i" if f["direction"] == "bwd"
           else "one CTA per Q block i (grid x), inner loop over K/V blocks j")
    facts_json = json.dumps(f, separators=(",", ":")).replace("</", "<\\/")
    legend = "".join(f'<span><i class="sw tile-sw" style="background:var(--{v})"></i>{_e(KIND_NAME[k])}</span>'
                     for k, v in (("s", "skip"), ("p", "part"), ("f", "full")))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>fagen explain: {_e(f["name"])}</title>
<script>{_ERRORS_JS}</script>
<style>{_CSS}</style></head>
<body>
<header><h1>{_e(f["name"])}</h1>
<p>{_e(f["direction"])} &middot; d = {f["head_dim"]} &middot; {_e(f["dtype"])} &middot; {_e(flags)} &middot; {_e(f["arch"])}
&middot; {f["num_warps"]} warps &middot; N<sub>q</sub> = {f["seqlen_q"]}, N<sub>k</sub> = {f["seqlen_k"]} &middot;
main kernel <code>{_e(f["kernel"])}</code></p></header>
<nav><a href="#tiles">tiles</a><a href="#smem">shared memory</a><a href="#resources">resources</a>{'<a href="#codegen">codegen knobs</a>' if f.get("codegen") else ""}<a href="#source">source</a></nav>
<section id="tiles"><h2>Tiles: {f["grid"]["q_blocks"]} Q blocks &times; {f["grid"]["kv_blocks"]} K/V blocks of
B<sub>r</sub> &times; B<sub>c</sub> = {f["block_r"]} &times; {f["block_c"]}</h2>
<p id="tile-counts" data-total="{t["total"]}" data-visited="{t["visited"]}" data-skipped="{t["skipped"]}"
 data-fully-visible="{t["fully_visible"]}">{t["total"]} tiles: <b>{t["visited"]}</b> visited
({t["fully_visible"]} fully visible, {t["visited"] - t["fully_visible"]} with mask math), <b>{t["skipped"]}</b> skipped.
{_e(who)}; {f["grid"]["ctas"]} CTAs per (batch, head).</p>
<p class="legend">{legend}<span><i class="sw" style="background:rgba(37,99,235,.25)"></i>the CTA's band</span>
<span><i class="sw" style="background:rgba(17,24,39,.35)"></i>done</span>{'<span><i class="sw" style="background:rgba(124,58,237,.3)"></i>dQ rows accumulated</span>' if f["direction"] == "bwd" else ""}</p>
<div class="row">{tiles_svg(f)}
<div id="stepper"><div class="controls">
<label>CTA <input type="range" id="cta" min="0" max="{max(0, f["grid"]["ctas"] - 1)}" value="0"></label>
<button id="prev" type="button">&#9664;</button>
<input type="range" id="step" min="0" max="1" value="0" aria-label="step">
<button id="next" type="button">&#9654;</button><button id="play" type="button">play</button></div>
<output id="step-label">Algorithm 4, step by step (needs JavaScript)</output>
{_fwd_note(f)}{_alg4_list(f)}</div></div></section>
{_smem_section(f)}
{_resources_section(f)}
{_codegen_section(f)}
<section id="source"><h2>Generated CUDA source ({len(f["source"].splitlines())} lines; Algorithm 4 comments link to the step view)</h2>
<p id="kernel-links">{_kernel_links(f)}</p>
<pre class="src"><code>{highlight(f["source"])}</code></pre></section>
<script type="application/json" id="fagen-facts">{facts_json}</script>
<script>{_JS}</script>
</body></html>
"""


def write_html(facts: dict[str, Any], path: str | Path) -> Path:
    """Write the page for ``facts`` to ``path`` (UTF-8; the parent directory must exist)."""
    out = Path(path)
    out.write_text(render_html(facts), encoding="utf-8")
    return out
