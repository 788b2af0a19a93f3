"""The report as one self-contained HTML page: figures as data URIs, sortable tables, no network at view time.

Sorting is a few lines of inline JavaScript (click a header; numbers sort as numbers, "not
reached" after every percentage). The page is plain HTML so any browser, or a test running
headless Chromium, renders it from the file alone.
"""

from __future__ import annotations

import base64
import html
import re

import pandas as pd

from anns_lab.eval.findings import Finding
from anns_lab.eval.markdown import UNMEASURED

_STYLE = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
th,td{border:1px solid #ccc;padding:0.25em 0.6em;text-align:right}
th{background:#f0f0f0;cursor:pointer;user-select:none}
th:after{content:" \\2195";color:#999}
td:first-child,th:first-child{text-align:left}
img{max-width:100%;display:block;margin:1em 0}
.agrees{color:#1a7f37}.disagrees{color:#b35900}.not-measured{color:#666}
nav a{margin-right:1em}
"""

# Click a header to sort its table by that column; a second click reverses.
_SCRIPT = """
function sortKey(t){const s=t.trim();if(s==='not reached'||s==='—')return Infinity;
const n=parseFloat(s.replace(/[%,×]/g,''));return isNaN(n)?s.toLowerCase():n}
document.querySelectorAll('table.sortable th').forEach((th,col)=>th.addEventListener('click',()=>{
const body=th.closest('table').tBodies[0];const rows=[...body.rows];const dir=th.dataset.dir==='asc'?-1:1;
th.dataset.dir=dir===1?'asc':'desc';rows.sort((a,b)=>{const x=sortKey(a.cells[col].textContent),
y=sortKey(b.cells[col].textContent);return (x>y?1:x<y?-1:0)*dir});rows.forEach(r=>body.appendChild(r))}));
"""


def paragraph(text: str) -> str:
    """``text`` (plain, or the findings' Markdown) as an HTML paragraph, escaped: names in it come from tables and
    plugins (an estimator's name once reached the page raw)."""
    return f"<p>{_md_inline(text)}</p>"


def _md_inline(text: str) -> str:
    """Escape, then render the Markdown the findings use: **bold** and `code`."""
    out = html.escape(text)
    out = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)
    # A code span as Markdown writes it: a fence of n backticks ends at the next run of exactly n (markdown.code
    # fences a name holding backticks with a longer run), one space inside each end is padding.
    return re.sub(r"(?<!`)(`+)(?!`) ?(.+?) ?(?<!`)\1(?!`)", r"<code>\2</code>", out)


def table(df: pd.DataFrame, table_id: str) -> str:
    """A sortable HTML table of ``df``'s cells as they are (format them first), a NaN as unmeasured."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = "\n".join("<tr>" + "".join(f"<td>{html.escape(_text(v))}</td>" for v in row) + "</tr>"
                     for row in df.itertuples(index=False))
    return f'<table class="sortable" id="{table_id}"><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>'


def _text(value) -> str:
    return UNMEASURED if isinstance(value, float) and value != value else str(value)  # NaN: no figure measured


def figure(png: bytes, alt: str) -> str:
    """An <img> holding the PNG itself as a data URI."""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def page(title: str, intro: str, findings: list[Finding], sections: list[tuple[str, str]],
         links: list[tuple[str, str | None]]) -> str:
    """The whole page: title, links to the dump's other sweeps (named without a link where they have no report yet),
    findings, then (heading, HTML body) sections."""
    nav = ""
    if links:
        nav = "<nav>Other sweeps of this dump: " + " · ".join(
            f'<a href="{html.escape(href)}">{html.escape(label)}</a>' if href else f"{html.escape(label)} (no report yet)"
            for label, href in links) + "</nav>"
    items = "\n".join(f'<li><b class="{f.verdict.replace(" ", "-")}">{html.escape(f.topic)}: {f.verdict}.</b> '
                      f"{_md_inline(f.text)}</li>" for f in findings)
    body = "\n".join(f"<h2>{html.escape(h)}</h2>\n{content}" for h, content in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_STYLE}</style></head><body>\n<h1>{html.escape(title)}</h1>\n{nav}\n<p>{_md_inline(intro)}</p>\n"
            f'<h2>Findings against the paper</h2>\n<ul id="findings">\n{items}\n</ul>\n{body}\n'
            f"<script>{_SCRIPT}</script>\n</body></html>\n")
