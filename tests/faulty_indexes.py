"""Misbehaving index plugins for the executor tests (installed per test into a temporary entry-point folder).

``faulty`` searches exactly like ``flat`` unless told otherwise: ``fault`` makes its search call
``os.abort()`` or ``sys.exit(3)``, raise KeyboardInterrupt or a ValueError, hang in C holding the GIL (``hang``), or normalise the queries it is given in place (``normalise``); ``pid_dir`` makes its build leave a file ``<pid>-<ns>`` per build
(so a test can find and kill the worker), ``sleep_s`` keeps the build busy that long and ``build_fault`` then makes it
raise, ``os.abort()`` or write into its keys. ``SlowWarmWork``: the sweep's work on a node whose kernels take a while to
compile at their first warm-up.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anns_lab.eval.sweep import SweepWork
from anns_lab.indexes import Index, Param


class FaultyIndex(Index):
    """Exact search with injectable faults."""

    build_params = {
        "fault": Param("none", choices=("none", "abort", "exit", "normalise", "interrupt", "hang", "raise"),
                       help="what search does"),
        "pid_dir": Param("", help="folder to leave <pid> files in at build"),
        "sleep_s": Param(0.0, 0.0, 600.0, help="seconds the build sleeps"),
        "build_fault": Param("none", choices=("none", "raise", "abort", "write"),
                             help="what build does after its sleep (write: doubles the keys it was given, in place)"),
    }

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        if os.environ.get("ANNS_LAB_TEST_FAULTY_BROKEN"):  # as an author's edit that broke it: the same parameters
            raise RuntimeError("an edit broke the build")
        if self.params["pid_dir"]:
            (Path(self.params["pid_dir"]) / f"{os.getpid()}-{time.time_ns()}").write_text("")  # one file per build
        time.sleep(self.params["sleep_s"])
        if self.params["build_fault"] == "raise":
            raise RuntimeError("no memory for its graph")
        if self.params["build_fault"] == "abort":
            os.abort()
        if self.params["build_fault"] == "write":
            keys *= 2
        self._keys = keys

    def _search(self, queries: np.ndarray, k: int):
        if self.params["fault"] == "abort":
            os.abort()
        if self.params["fault"] == "exit":
            sys.exit(3)
        if self.params["fault"] == "interrupt":
            raise KeyboardInterrupt
        if self.params["fault"] == "raise":
            raise ValueError("boom in search")
        if self.params["fault"] == "hang":  # a backtracking regex: C code that never lets go of the GIL (2^60 steps)
            import re

            re.match(r"(a+)+$", "a" * 60 + "b")
        if self.params["fault"] == "normalise":  # as faiss.normalize_L2 would: the caller's array, in place
            queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        s = queries @ self._keys.T
        ids = np.argsort(-s, axis=1, kind="stable")[:, :k]
        return ids, np.take_along_axis(s, ids, 1), np.full(len(queries), len(self._keys), np.int64)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        self._keys = arrays["keys"]


_WARMED: set[str] = set()  # the indexes SlowWarmWork warmed in this process


@dataclass(frozen=True)
class SlowWarmWork(SweepWork):
    """The sweep's work where an index's first warm-up in a process takes ``warm_s`` seconds (a node compiling its
    kernels), and ``abort_on``'s aborts the process; a part evaluated before its index was warmed in this process
    fails."""

    warm_s: float = 0.0
    abort_on: str = ""

    def warm(self, data, index: str) -> None:
        if index == self.abort_on:
            os.abort()
        if index not in _WARMED:
            time.sleep(self.warm_s)
            _WARMED.add(index)
        super().warm(data, index)

    def evaluate(self, data, index: str):
        if index not in _WARMED:
            raise RuntimeError(f"{index} evaluated before its warm-up")
        return super().evaluate(data, index)
