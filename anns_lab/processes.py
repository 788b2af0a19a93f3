"""Worker processes that end with the process that started them (a sweep's workers, the decoder's build workers)."""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with(parent: int) -> None:
    """End this process when ``parent`` ends, even inside work that never returns (a parent killed by SIGKILL left
    such a worker running for good): Linux's parent-death signal; elsewhere the worker's closed pipe or queue ends it
    at its next message.

    Linux sends the signal when the *thread* that started this process ends: call it only in a process started by its
    parent's main thread, which lives as long as the parent does.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            return
    if os.getppid() != parent:  # the parent ended before the signal was asked for
        os._exit(0)
