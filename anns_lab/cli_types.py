"""Command-line value types shared by several commands (one parser per kind of value)."""

from __future__ import annotations

import click

from anns_lab.errors import AnnsLabError
from anns_lab.io import param_value
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

    return [p.secondary_opts[0] if getattr(p, "secondary_opts", None) and ctx.params.get(p.name) is False else p.opts[0]
            for p in ctx.command.params if p.name in names  # a --x/--no-x pair: the one typed
            and ctx.get_parameter_source(p.name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)]


def name_list(spec: str, option: str) -> list[str]:
    """The names of a comma list (``--indexes``, ``--mode``) in order, none for an empty one (the caller says what that
    means); an empty item between names is refused, as ``--layers 0,,1`` is (a name lost to a typo ran the others)."""
    items = [s.strip() for s in spec.split(",")]
    names = [s for s in items if s]
    if names and len(names) < len(items):
        raise AnnsLabError(f"{option} {spec!r} has an empty item between commas")
    return names


def parse_params(items: tuple[str, ...] | list[str], what: str = "--param") -> dict:
    """``["L=200", "nprobe=32"]`` → ``{"L": 200, "nprobe": 32}`` (decode's --param and --build-param, indexes --check's
    --param and --unbiased-at)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise AnnsLabError(f"{what} {item!r}: write NAME=VALUE, e.g. {what} L=200")
        name, value = item.split("=", 1)
        if not (name := name.strip()):  # else it reached the modes as a parameter named '' that none declares
            raise AnnsLabError(f"{what} {item!r}: NAME is empty; write NAME=VALUE, e.g. {what} L=200")
        if "." in name:  # the sweep's INDEX.NAME: here a parameter goes to every named index that declares it
            raise AnnsLabError(f"{what} {item!r}: write NAME=VALUE without the index's name (e.g. {what} "
                               f"{name.rsplit('.', 1)[1]}={value.strip()}): every index named that declares NAME takes it")
        if name in out:  # the last one silently won before: say which is meant
            raise AnnsLabError(f"{what} {name} is given twice ({out[name]!r} and {value.strip()}): give one value")
        out[name] = param_value(value.strip())
    return out
