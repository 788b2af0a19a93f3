"""What every executor shares: the unit of work, its outcome, and the one way a part's error is caught."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import pandas as pd

from anns_lab.errors import error_text


@dataclass(frozen=True)
class Part:
    """One (layer, head, index) of a sweep: the unit that succeeds or fails on its own."""

    layer: int
    head: int
    index: str

    def __str__(self) -> str:
        return f"index {self.index} on layer {self.layer} head {self.head}"


@dataclass
class Outcome:
    """A part's final result in this run: its table, or its error and whether its worker process died."""

    part: Part
    table: pd.DataFrame | None
    error: str | None = None
    attempts: int = 1
    crashed: bool = False


class Work(Protocol):
    """The sweep's work as executors see it: load a head once, evaluate an index on it (both picklable)."""

    def worker_env(self) -> dict[str, str]:
        """Environment a worker process must start with (thread-pool sizes are read at load time)."""
        ...

    def setup_worker(self) -> None: ...

    def load(self, layer: int, head: int) -> Any: ...

    def fingerprint(self) -> str | None:
        """What identifies the input seen from this process (None when it is not there): the same on every
        node means the nodes share its folder."""
        ...

    def warm(self, data: Any, index: str) -> None:
        """Ready the index's kernels in this process for ``data``'s shapes, before its part is timed (a node whose
        kernel cache is empty compiles for minutes: inside a part, past its --part-timeout)."""
        ...

    def evaluate(self, data: Any, index: str) -> pd.DataFrame: ...


#: A group of parts sharing one head: (layer, head, index names); ``tries`` bounds each part's attempts.
Unit = tuple[int, int, list[str]]
OnOutcome = Callable[[Outcome], None]
#: Told the parts an executor's workers are running now, each time that set changes (the progress bar names them).
OnRunning = Callable[[list[Part]], None]


class Executor(Protocol):
    """Runs units, calls ``on_outcome`` on the driver for every finished part (and ``on_running``, where the
    executor knows which parts its workers are on), and raises KeyboardInterrupt (after stopping its workers) when
    interrupted."""

    def describe(self) -> str: ...

    def run(self, work: Work, units: list[Unit], tries: dict[Part, int], on_outcome: OnOutcome,
            on_running: OnRunning | None = None) -> None: ...

    def close(self) -> None: ...


#: Seconds a worker may spend readying one index's kernels (``Work.warm``) when parts are bounded by --part-timeout (at
#: least that timeout): a node whose numba cache is empty compiles for minutes, off the part's clock but not unbounded.
WARM_LIMIT = 600.0


def warm_limit(part_timeout: float) -> float:
    """The bound on one index's warm-up in a worker under ``part_timeout`` (0: no bound, as the parts)."""
    return max(WARM_LIMIT, part_timeout) if part_timeout else 0.0


def warm(work: Work, data: Any, index: str) -> None:
    """``work.warm`` for one index with its error dropped: the part itself then meets it and reports it as its own."""
    try:
        work.warm(data, index)
    except Exception:  # noqa: BLE001 - a warm-up only (the sweep's swallows its own already)
        pass


def load(work: Work, layer: int, head: int) -> tuple[Any, str | None]:
    """``work.load`` with its error caught: a head that cannot be read fails its parts, not the sweep."""
    try:
        return work.load(layer, head), None
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001
        return None, error_text(err)


INDEX_INTERRUPT = "KeyboardInterrupt raised by the index (not a Ctrl-C: workers ignore those)"


def attempt(work: Work, data: Any, index: str, worker: bool = False) -> tuple[pd.DataFrame | None, str | None]:
    """``work.evaluate`` with every error of the index (SystemExit included) caught as its part's error; in a
    ``worker`` (which ignores the driver's Ctrl-C) a KeyboardInterrupt is the index's own, and its part's error too."""
    try:
        return work.evaluate(data, index), None
    except KeyboardInterrupt:
        if worker:
            return None, INDEX_INTERRUPT
        raise
    except BaseException as err:  # noqa: BLE001 - a plugin's error, even SystemExit, fails its own part only
        return None, error_text(err)


def death_text(exitcode: int | None) -> str:
    """``exit code -6`` → ``killed by SIGABRT``: how a worker process ended."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exit code {exitcode}"
