"""The local executor: ``jobs`` single-threaded worker processes on this machine, each fed one head at a time.

Not a ``ProcessPoolExecutor``: when one of its workers dies the whole pool breaks and no error names
the part. Here each worker tells the driver which index it readies (its kernels: ``Work.warm``) and starts, so a
worker that dies (``os.abort``, a segfault, the OOM killer, ``kill -9``) fails exactly that part; the driver starts a
new worker and retries the part while its attempts last; one that dies between two heads is replaced without a trace.
Workers ignore SIGINT: on Ctrl-C the driver stops them (SIGTERM, then SIGKILL) and returns at once
instead of waiting for queued heads. With a ``part_timeout``, an index that runs longer (a stuck plugin) has its
worker killed and its part failed as timed out, not retried in the run: a hang costs that part, not the sweep
(its kernels' warm-up, before its clock starts, has a bound of its own: ``base.warm_limit``).
Workers end with their driver, however it ends (``kill -9`` included): none is left running an index for no one.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from anns_lab import stops
from anns_lab.eval.executors.base import (OnOutcome, OnRunning, Outcome, Part, Unit, Work, attempt, death_text, load,
                                          warm, warm_limit)
from anns_lab.processes import die_with

LOADING = "<load>"  # what a worker is doing before its first index: reading the head


def _worker(conn: Connection, work: Work, driver: int) -> None:
    """Worker main: for each (layer, head, names) received, load the head and evaluate each name; a driver gone (its
    pipe closed) ends the worker quietly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    die_with(driver)  # started by the driver's thread that runs the sweep to its end
    work.setup_worker()
    try:
        while True:
            unit = conn.recv()
            if unit is None:
                return
            layer, head, names = unit
            conn.send(("start", LOADING))
            data, load_error = load(work, layer, head)
            for name in names:
                if not load_error:  # its kernels first, on a clock of their own (warm_limit), then the part's
                    conn.send(("warm", name))
                    warm(work, data, name)
                conn.send(("start", name))
                table, error = (None, load_error) if load_error else attempt(work, data, name, worker=True)
                conn.send(("done", name, table, error))
            conn.send(("idle",))
    except (EOFError, OSError):  # the driver ended (BrokenPipe, ConnectionReset): nothing is left to report to
        return


@dataclass
class _Slot:
    proc: multiprocessing.process.BaseProcess
    conn: Connection
    unit: tuple[int, int, list[str]] | None = None
    current: str | None = None
    remaining: list[str] = field(default_factory=list)
    since: float = 0.0  # when ``current`` started (time.monotonic)
    warming: bool = False  # ``current`` is readying its kernels (Work.warm), bounded by warm_limit, not yet its part


class LocalExecutor:
    """``jobs`` spawned worker processes (spawn, not fork: forking running OpenMP/numba pools can deadlock)."""

    def __init__(self, jobs: int, log=print, part_timeout: float = 0.0) -> None:
        self.jobs = max(1, int(jobs))
        self.log = log
        self.part_timeout = part_timeout  # seconds an index may run (its head's load, its kernels' warm-up not counted)

    def describe(self) -> str:
        return f"local: {self.jobs} single-threaded worker process{'es' if self.jobs > 1 else ''}"

    def close(self) -> None:
        pass

    def run(self, work: Work, units: list[Unit], tries: dict[Part, int], on_outcome: OnOutcome,
            on_running: OnRunning | None = None) -> None:
        """Evaluate every unit's names; a part whose worker dies is retried up to ``tries[part]`` attempts;
        ``on_running`` hears the parts the workers are on whenever they change."""
        ctx = multiprocessing.get_context("spawn")
        queue: deque[Unit] = deque((layer, head, list(names)) for layer, head, names in units if names)
        attempts: Counter[Part] = Counter()
        slots: list[_Slot] = []
        running: list[Part] = []
        try:
            while queue or any(s.unit for s in slots):
                stops.check()  # the outcomes drained before are written: a lost Ctrl-C stops here (stops.py)
                for slot in list(slots):
                    if slot.unit is None and queue and not self._give(slot, queue):
                        slots.remove(slot)  # it died idle (the OOM killer, kill -9): nothing of a unit was lost
                        self._stop(slot)
                while queue and len(slots) < self.jobs:
                    slots.append(self._start(ctx, work, queue.popleft()))
                busy = [s for s in slots if s.unit]
                wait([s.conn for s in busy] + [s.proc.sentinel for s in busy], timeout=self._until_overdue(busy))
                for slot in busy:
                    if not self._drain(slot, attempts, on_outcome):
                        slots.remove(slot)
                        self._died(slot, attempts, tries, queue, on_outcome)
                    elif self._until_overdue([slot]) == 0.0:
                        slot.proc.kill()
                        slots.remove(slot)
                        self._died(slot, attempts, tries, queue, on_outcome, timed_out=True)
                now = [Part(*s.unit[:2], s.current) for s in slots if s.unit and s.current not in (None, LOADING)]
                if on_running and now != running:
                    running = now
                    on_running(now)
        finally:
            for slot in slots:
                self._stop(slot)

    def _until_overdue(self, slots: list[_Slot]) -> float | None:
        """Seconds until the first of ``slots``' running indexes passes ``part_timeout``, or its warm-up
        :func:`warm_limit` (0.0: one has); None: no bound."""
        ends = [s.since + (warm_limit(self.part_timeout) if s.warming else self.part_timeout)
                for s in slots if s.current not in (None, LOADING)]
        if not self.part_timeout or not ends:
            return None
        return max(0.0, min(ends) - time.monotonic())

    def _start(self, ctx, work: Work, unit: Unit) -> _Slot:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, work, os.getpid()), daemon=True)
        env = work.worker_env()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # a spawned child starts with the parent's environment of this moment
        try:
            proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        slot = _Slot(proc, parent, unit, None, list(unit[2]))
        parent.send(unit)
        return slot

    @staticmethod
    def _give(slot: _Slot, queue: deque) -> bool:
        """Send an idle worker the next unit; False (the unit back at the queue's head) when its pipe is broken."""
        unit = queue.popleft()
        try:
            slot.conn.send(unit)
        except OSError:
            queue.appendleft(unit)
            return False
        slot.unit, slot.remaining = unit, list(unit[2])
        return True

    def _drain(self, slot: _Slot, attempts: Counter, on_outcome: OnOutcome) -> bool:
        """Handle every message the worker sent; False when it has died."""
        layer, head, _ = slot.unit
        while True:
            # Only the pipe's errors mean a dead worker: one from on_outcome (writing the part) is the driver's own
            # and must stop the run, not drop the finished part unrecorded.
            try:
                if not slot.conn.poll():
                    break
                msg = slot.conn.recv()
            except (EOFError, OSError):
                return False
            if msg[0] in ("warm", "start"):
                slot.current, slot.since, slot.warming = msg[1], time.monotonic(), msg[0] == "warm"
            elif msg[0] == "done":
                _, name, table, error = msg
                part = Part(layer, head, name)
                attempts[part] += 1
                slot.remaining.remove(name)
                slot.current = None
                on_outcome(Outcome(part, table, error, attempts[part]))
            else:  # idle: the unit is finished
                slot.unit, slot.current, slot.remaining = None, None, []
                return True
        return slot.proc.is_alive() or slot.unit is None

    def _died(self, slot: _Slot, attempts: Counter, tries: dict[Part, int], queue: deque, on_outcome: OnOutcome,
              timed_out: bool = False) -> None:
        """A worker died (or was killed for ``part_timeout``) mid-unit: the part it was on fails (or is retried; a timed
        out one is not, in this run); the rest of the unit is requeued."""
        slot.proc.join(timeout=5)
        layer, head, _ = slot.unit
        how = death_text(slot.proc.exitcode)
        if timed_out:
            how = (f"was killed: readying the index's kernels ran past {warm_limit(self.part_timeout):g} s (at least "
                   f"--part-timeout)" if slot.warming else f"was killed: the index ran past --part-timeout "
                   f"{self.part_timeout:g} s")
        # Dying while reading the head counts against every part of the unit; otherwise only the current one.
        suspects = list(slot.remaining) if slot.current in (None, LOADING) else [slot.current]
        keep = [n for n in slot.remaining if n not in suspects]
        for name in suspects:
            part = Part(layer, head, name)
            attempts[part] += 1
            if attempts[part] < tries.get(part, 1) and not timed_out:
                self.log(f"worker process {how} while running {part}; retrying (attempt {attempts[part] + 1} "
                         f"of {tries[part]})")
                keep.insert(0, name)
            else:
                on_outcome(Outcome(part, None, f"worker process {how} while running it (attempt {attempts[part]})",
                                   attempts[part], crashed=True))
        if keep:
            queue.appendleft((layer, head, keep))
        slot.conn.close()

    @staticmethod
    def _stop(slot: _Slot) -> None:
        if slot.proc.is_alive() and slot.unit is None:
            try:
                slot.conn.send(None)
            except OSError:
                pass
            slot.proc.join(timeout=2)
        if slot.proc.is_alive():
            slot.proc.terminate()
            slot.proc.join(timeout=5)
        if slot.proc.is_alive():
            slot.proc.kill()
            slot.proc.join(timeout=5)
        slot.conn.close()
