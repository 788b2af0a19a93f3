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


def given_flags(ctx: click.Context, *names: str) -> list[str]:
    """The flags of the parameters ``names`` that the command line (or the environment) set, in the command's order:
    the options a run refuses as unused are those a person typed, not defaults."""
    from click.core import ParameterSource

    return [p.opts[0] for p in ctx.command.params if p.name in names
            and ctx.get_parameter_source(p.name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)]
