"""Text from results, dumps and plugins made safe inside report.md: table cells and code spans.

Index labels carry build-parameter values and a dump carries its model's name, both from files people exchange: in
Markdown a ``|`` ends a table cell, a newline a row, ``<script>`` is raw HTML and ``[x](y)`` a link.
"""

from __future__ import annotations

import math
import re
import unicodedata

MARKUP = re.compile(r"([\\`*\[\]<>|])")  # what ends a cell, opens a code span, bold, a link or raw HTML
UNMEASURED = "—"  # a table's cell for a figure the sweep did not measure (a NaN column: docs/results-table.md)


def number(value: float, spec: str) -> str:
    """``value`` formatted by ``spec`` (``"{:.4f}"``), or :data:`UNMEASURED` where it is NaN or infinite: a quick
    sweep's output error read "nan" in the report's tables."""
    return spec.format(value) if math.isfinite(value) else UNMEASURED


def cell(value) -> str:
    """Text (a table cell's, a sentence's) that reads as written: it cannot end a cell or row, nor open a code span, a
    link, ``*`` emphasis or HTML (``_``, ``~`` and ``&`` are left: names hold them, and they harm nothing)."""
    return MARKUP.sub(r"\\\1", visible(str(value)))


def code(text: str, in_table: bool = False) -> str:
    """``text`` as one Markdown code span, whatever it holds: a folder name with backticks or a newline once ended the
    span and started a heading of its own in report.md. ``in_table``: a ``|`` ends a table's cell even inside a span."""
    text = visible(text)
    fence = "`" * (1 + max((len(run) for run in re.findall("`+", text)), default=0))
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    span = f"{fence}{pad}{text}{pad}{fence}"
    return span.replace("|", "\\|") if in_table else span


def visible(text: str) -> str:
    """Control characters (newlines, tabs, escapes) spelled as Python writes them, everything else as it is."""
    return "".join(repr(ch)[1:-1] if unicodedata.category(ch) == "Cc" else ch for ch in text)
