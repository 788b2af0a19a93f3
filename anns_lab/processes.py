"""Worker processes that end with the process that started them (a sweep's workers, the decoder's build workers)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # prctl(2)
WATCH_S = 0.5  # how often a worker whose parent-death signal cannot be asked for looks at its parent


def die_with(parent: int, *, by_main_thread: bool = True) -> None:
    """End this process when ``parent`` ends, even inside work that never returns (a parent killed by SIGKILL left
    such a worker running for good): Linux's parent-death signal; elsewhere the worker's closed pipe or queue ends it
    at its next message.

    Linux sends the signal when the *thread* that started this process ends, so it is asked for only where that was
    the parent's main thread (``by_main_thread``), which lives as long as the parent does; a worker started by
    another thread has a thread of its own look at its parent instead (it runs whenever the work lets go of the GIL).
    """
    if not by_main_thread:
        _watch(parent)
        return
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            return
    if os.getppid() != parent:  # the parent ended before the signal was asked for
        os._exit(0)


def _watch(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:  # an orphan is handed to init or a subreaper: another parent
            time.sleep(WATCH_S)
        os._exit(0)

    threading.Thread(target=watch, name="anns-lab-parent-watch", daemon=True).start()
