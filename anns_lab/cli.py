"""The ``anns-lab`` command: one click group; each stage contributes its own commands."""

from __future__ import annotations

import signal
import sys
import threading

import click

from anns_lab.version import __version__
from anns_lab.errors import AnnsLabError


class _Group(click.Group):
    """Prints an AnnsLabError as one line (no traceback) and exits with status 2; SIGTERM stops a command as Ctrl-C
    does."""

    def invoke(self, ctx: click.Context):
        before = _stop_on_sigterm()
        try:
            return super().invoke(ctx)
        except AnnsLabError as err:
            click.echo(f"Error: {err}", err=True)
            sys.exit(2)
        finally:
            if before is not None:
                signal.signal(signal.SIGTERM, before)


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop_on_sigterm():
    """`kill`, `timeout` or a scheduler's stop gets the clean stop a Ctrl-C gets (workers stopped, finished work kept,
    the resume told): by default it ended the driver alone, and its workers ran on. The previous handler, or None
    where none is set: not the main thread, or SIGTERM ignored by whoever started us (as Python keeps an ignored
    SIGINT)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        return None
    return signal.signal(signal.SIGTERM, _terminated)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="anns-lab")
def main() -> None:
    """anns-lab: ANN indexes for attention-query → key retrieval."""


def _register() -> None:
    from anns_lab.decode.cli import decode
    from anns_lab.dumps.cli import dump
    from anns_lab.eval.cli import export, report, sweep
    from anns_lab.indexes.cli import indexes

    for command in (dump, indexes, sweep, report, export, decode):
        main.add_command(command)


_register()
