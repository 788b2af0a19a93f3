"""Command-line value types shared by several commands (one parser per kind of value)."""

from __future__ import annotations

import click

from anns_lab.window import Window, WindowError


class WindowType(click.ParamType):
    """The static window ``SINK,RECENT``: first SINK and most recent RECENT tokens (docs/decoder.md)."""

    name = "SINK,RECENT"

    def convert(self, value, param, ctx) -> Window:
        try:
            return Window(*value) if isinstance(value, tuple) else Window.parse(value)
        except WindowError as err:
            self.fail(str(err), param, ctx)


WINDOW = WindowType()
