"""Text from results, dumps and plugins made safe inside report.md: table cells and code spans.

Index labels carry build-parameter values and a dump carries its model's name, both from files people exchange: in
Markdown a ``|`` ends a table cell, a newline a row, ``<script>`` is raw HTML and ``[x](y)`` a link.
"""

from __future__ import annotations

import re
import unicodedata

MARKUP = re.compile(r"([\\`*\[\]<>|])")  # what ends a cell, opens a span, a link or raw HTML


def cell(value) -> str:
    """A table cell's text that reads as written: it cannot end its cell or row, nor open a link, emphasis or HTML."""
    return MARKUP.sub(r"\\\1", visible(str(value)))


def code(text: str) -> str:
    """``text`` as one Markdown code span, whatever it holds: a folder name with backticks or a newline once ended the
    span and started a heading of its own in report.md."""
    text = visible(text)
    fence = "`" * (1 + max((len(run) for run in re.findall("`+", text)), default=0))
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def visible(text: str) -> str:
    """Control characters (newlines, tabs, escapes) spelled as Python writes them, everything else as it is."""
    return "".join(repr(ch)[1:-1] if unicodedata.category(ch) == "Cc" else ch for ch in text)
