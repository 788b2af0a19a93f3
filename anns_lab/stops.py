"""Ctrl-C and SIGTERM as one stop that is not lost.

Both raise KeyboardInterrupt in the main thread, where the command's clean stop takes over (workers stopped, finished
work kept, the resume told). An exception raised inside a finalizer is printed and dropped by Python ("Exception
ignored in ... __del__"): a Ctrl-C that landed in pyarrow's ``ParquetWriter.__del__`` let a sweep run to its end with
status 0. So the handler also records the stop, and the long loops :func:`check` it at their safe points.
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

_STOP = threading.Event()
_ARMED: set[int] = set()  # the signals install() routed to the stop (rearm() routes them again)


def _stop(signum, frame) -> None:
    _STOP.set()
    raise KeyboardInterrupt


def install() -> Callable[[], None]:
    """Route SIGINT and SIGTERM to the recorded stop for a command's run (the main thread only; a signal ignored by
    whoever started us stays ignored, as Python keeps an ignored SIGINT); returns what restores the handlers before."""
    _STOP.clear()
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s, handler in before.items():
        if handler != signal.SIG_IGN:
            signal.signal(s, _stop)
            _ARMED.add(s)

    def restore() -> None:
        _STOP.clear()  # the command's stop is over: a later call in this process (a test's, a notebook's) runs
        _ARMED.clear()
        for s, handler in before.items():
            if handler != signal.SIG_IGN:
                signal.signal(s, handler)

    return restore


def rearm() -> None:
    """Route the signals :func:`install` routed to the stop again: ``ray.init`` replaces the SIGTERM handler with its
    own, which printed a stack dump and ended the driver with status 15 (no table written, no resume said)."""
    if threading.current_thread() is threading.main_thread():
        for s in _ARMED:
            signal.signal(s, _stop)


def check() -> None:
    """Raise KeyboardInterrupt where a stop was asked for whose own exception was lost; once, as the signal's own."""
    if _STOP.is_set():
        _STOP.clear()
        raise KeyboardInterrupt


def ignore_after_end() -> None:
    """From now on SIGINT and SIGTERM are ignored: the command is over and its files written, and a signal during the
    interpreter's shutdown (torch's takes up to a second) killed it with the signal's status, or printed a
    KeyboardInterrupt from an atexit callback (an interrupt fuzz); ignored, the process ends with the command's own
    status (a Python handler would be gone once the interpreter finalizes, before torch's shutdown is). For the
    console script's process alone: a notebook's would no longer stop on Ctrl-C."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
