"""Command-line value types shared by several commands (one parser per kind of value)."""

from __future__ import annotations

import click


class WindowType(click.ParamType):
    """The static window ``SINK,RECENT``: first SINK and most recent RECENT tokens (design.md §8)."""

    name = "SINK,RECENT"

    def convert(self, value, param, ctx) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        try:
            sink, recent = (int(x) for x in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r}: write SINK,RECENT token counts, e.g. 128,512", param, ctx)
        if sink < 0 or recent < 0:
            self.fail(f"{value!r}: SINK,RECENT must be non-negative token counts", param, ctx)
        return sink, recent


WINDOW = WindowType()
