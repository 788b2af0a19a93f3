"""The ``anns-lab`` command: one click group; each stage contributes its own commands."""

from __future__ import annotations

import sys

import click

from anns_lab import stops
from anns_lab.errors import AnnsLabError
from anns_lab.version import __version__


class _Group(click.Group):
    """Prints an AnnsLabError as one line (no traceback) and exits with status 2; SIGTERM stops a command as Ctrl-C
    does, and every command stopped so exits with status 130 (dump, sweep and decode say what they kept)."""

    def invoke(self, ctx: click.Context):
        # `kill`, `timeout` or a scheduler's stop gets the clean stop a Ctrl-C gets (by default it ended the driver
        # alone, and its workers ran on), and neither is lost in a finalizer (stops.py)
        restore = stops.install()
        try:
            return super().invoke(ctx)
        except AnnsLabError as err:
            click.echo(f"Error: {err}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:  # report, export, indexes: click's own "Aborted!" exits 1, unlike the others' 130
            click.echo(f"interrupted: anns-lab {ctx.invoked_subcommand} stopped", err=True)
            sys.exit(130)
        finally:
            restore()


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="anns-lab")
def main() -> None:
    """anns-lab: ANN indexes for attention-query → key retrieval."""


def entry() -> None:
    """The ``anns-lab`` console script: :func:`main`, its exit status kept through the interpreter's shutdown."""
    try:
        main()
    finally:
        stops.ignore_after_end()


def _register() -> None:
    from anns_lab.decode.cli import decode
    from anns_lab.dumps.cli import dump
    from anns_lab.eval.cli import export, report, sweep
    from anns_lab.indexes.cli import indexes

    for command in (dump, indexes, sweep, report, export, decode):
        main.add_command(command)


_register()
