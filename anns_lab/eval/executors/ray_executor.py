"""The Ray executor: one Ray task per (layer, head, index), ``cpus_per_task`` CPUs each, on a Ray cluster.

A task per index (not per head) makes a worker that dies attributable to exactly one part; Ray
retries it (``max_retries``: the part's attempts left) and the driver records it as failed only
when they are used up. Workers read the dump through its path when every node sees the same dump
there (a shared file system); otherwise the driver loads each head once and ships its arrays
through the object store, released when the head's last task ends. Ray itself sizes a worker's
thread pools to its ``num_cpus`` (OMP_NUM_THREADS). The driver alone writes
``parts/``, exactly as with the local executor, so a sweep may move between the two.

With a ``part_timeout``, a task's worker ends itself once its index has run that long (its head's read and its
kernels' warm-up not counted, as locally; the warm-up has a watchdog of its own, ``base.warm_limit``, and a worker it
ends is a death to the driver): ``faulthandler``'s watchdog, a C thread that needs no GIL, writes the index's stack to
the worker's log and exits the process whatever the index is doing. Each task also tells a small clock actor when its
index starts and ends, so the driver can tell a worker that timed out (its attempt on the clock for the timeout) from
one that died, fails the first as timed out, not retried in the run, and retries the second itself, each attempt on
the clock under its own key. The driver cancels nothing on time: a ``ray.cancel`` that meets a task finishing at that moment can abort
the driver (Ray 2.60). Only a worker that outlives its own watchdog (an index that replaced it: ``faulthandler``
keeps one) is force-cancelled, at ``BACKSTOP`` times the timeout.
"""

from __future__ import annotations

import faulthandler
import time
from collections import deque
from dataclasses import replace

import numpy as np

from anns_lab import stops
from anns_lab.errors import AnnsLabError, ExecutorLost
from anns_lab.eval.executors.base import (OnOutcome, OnRunning, Outcome, Part, Unit, Work, attempt, load, warm,
                                          warm_limit)
from anns_lab.eval.executors.ray_cluster import Cluster, ClusterWatch, check_cpus_per_task, ray_error_text

DATA_MODES = ("auto", "path", "ship")
# Ray errors that mean the worker (or its node) died, which a retry may outlive; a force-cancel is one too
_DEATHS = ("WorkerCrashedError", "NodeDiedError", "OutOfMemoryError", "TaskCancelledError", "LocalRayletDiedError")
BACKSTOP = 3.0  # the driver force-cancels a task whose worker is still running this many part timeouts after its start
CLOCK_WAIT_S = 10.0  # how long the driver's loop waits for the clock's answer
CLOCK_EVERY_S = 5.0  # how often it looks for parts past BACKSTOP part timeouts
CLOCK_SLACK = 0.1  # a dead attempt counts as timed out when the clock saw it run (1 - this) x the timeout: the clock
# hears of a start a little after the watchdog is armed (an actor call; the driver hears of a death later still)


def _part_task(work: Work, layer: int, head: int, index: str, data=None, clock=None, key: str | None = None,
               timeout: float = 0.0):
    """Runs on a Ray worker: one part; its error (SystemExit included) comes back as text. With a ``timeout`` the
    worker exits once the index has run that long; ``clock`` (an actor handle) hears when the index starts and
    ends, as ``key`` (the part and its attempt)."""
    work.setup_worker()
    error = None
    if data is None:
        data, error = load(work, layer, head)
    else:
        data = _writable(data)
    if error:
        return None, error
    if timeout:  # the kernels readied before the clock and the part's watchdog, under a watchdog of their own
        faulthandler.dump_traceback_later(warm_limit(timeout), exit=True)
    try:
        warm(work, data, index)  # a node's first compile (minutes) is not the index's time
    finally:
        if timeout:
            faulthandler.cancel_dump_traceback_later()
    _tell(clock, "start", key)
    if timeout:
        faulthandler.dump_traceback_later(timeout, exit=True)
    try:  # a KeyboardInterrupt here is the index's (a Ray task gets no Ctrl-C): Ray would call it a cancelled task
        return attempt(work, data, index, worker=True)
    finally:
        if timeout:
            faulthandler.cancel_dump_traceback_later()
        _tell(clock, "finish", key)


def _writable(data):
    """``data`` (a head shipped through the object store) with writable copies of its read-only arrays: numba types
    an array by whether it is writable, and the warmed kernels are the writable ones (a first roargraph build on
    the object store's arrays compiled inside its timing: 22-33 s against 0.3 s)."""
    for name, value in getattr(data, "__dict__", {}).items():
        if isinstance(value, np.ndarray) and not value.flags.writeable:
            setattr(data, name, value.copy())
    return data


def _tell(clock, what: str, key: str | None) -> None:
    """Tell the clock actor (if any) that ``key`` starts or finishes; a clock that is gone only loses the timeout.
    Not waited for: a task blocked in ``ray.get`` lends its CPU to a queued task (two would then run on one CPU and
    skew the timings), and the call is sent from Ray's own thread, even while the index then holds the GIL for ever;
    an actor takes one caller's calls in order, so start comes before finish."""
    if clock is None:
        return
    import ray

    try:
        getattr(clock, what).remote(key)
    except ray.exceptions.RayError:
        pass


class _StartClock:
    """A Ray actor: when each running attempt of a part started, on this actor's one clock (nodes' clocks differ)."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}

    def start(self, key: str) -> None:
        self.started[key] = time.monotonic()

    def finish(self, key: str) -> None:
        self.started.pop(key, None)

    def running_for(self) -> dict[str, float]:
        now = time.monotonic()
        return {key: now - t for key, t in self.started.items()}


def _fingerprint_task(work: Work) -> str | None:
    return work.fingerprint()


class RayExecutor:
    """Sweep parts as Ray tasks; see the module doc."""

    def __init__(self, address: str | None, jobs: int, cpus_per_task: float, data: str = "auto", log=print,
                 part_timeout: float = 0.0) -> None:
        if data not in DATA_MODES:
            raise AnnsLabError(f"data must be one of {DATA_MODES}, got {data!r}")
        check_cpus_per_task(cpus_per_task)
        self.log, self.data, self.cpus_per_task = log, data, float(cpus_per_task)
        self.part_timeout = part_timeout  # seconds an index may run (its head's load, its kernels' warm-up not counted)
        self.cluster = Cluster(address, jobs, log)
        self.ray = self.cluster.ray
        self.cluster.require({"CPU": self.cpus_per_task}, "sweep")

    def describe(self) -> str:
        return f"{self.cluster.summary}, {self.cpus_per_task:g} CPU per task"

    def close(self) -> None:
        self.cluster.close()

    def data_mode(self, work: Work) -> str:
        """``path`` when every alive node sees the driver's input at its path, else ``ship``."""
        if self.data != "auto":
            self.log(f"ray: --ray-data {self.data}: " + ("every node reads the dump through its path" if self.data == "path"
                                                          else "the driver ships each head's arrays through the object store"))
            return self.data
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        mine = work.fingerprint()
        probe = self.ray.remote(_fingerprint_task)
        refs = {n["NodeManagerAddress"] + " " + n["NodeID"][:8]: probe.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(work)
                for n in self.cluster.nodes()}
        seen = {}
        for node, ref in refs.items():
            try:
                seen[node] = self.ray.get(ref, timeout=300)
            except self.ray.exceptions.RayError as err:  # a node gone or stuck while probed was a traceback, exit 1
                self.log(f"ray: node {node} did not answer the dump probe ({type(err).__name__})")
                seen[node] = None
        missing = [node for node, fp in seen.items() if fp != mine]
        if missing:
            self.log(f"ray: the dump is not at its path on node(s) {', '.join(missing)}: the driver ships each head's "
                     "arrays through the object store")
            return "ship"
        self.log("ray: every node reads the dump through its path (shared file system)")
        return "path"

    def run(self, work: Work, units: list[Unit], tries: dict[Part, int], on_outcome: OnOutcome,
            on_running: OnRunning | None = None) -> None:
        """Submit parts (a bounded number in flight), report each as it ends; Ctrl-C cancels the rest. ``on_running``
        is not called: a submitted part may still wait in Ray's queue, and the driver does not see it start.

        Ray retries a part whose worker died (``max_retries``), except under a part timeout: then the driver does,
        each attempt on the clock under its own key, so a dead attempt's start never times out the next one."""
        ray = self.ray
        ship = self.data_mode(work) == "ship"
        task = ray.remote(_part_task)
        todo = deque((Part(layer, head, n), 1) for layer, head, names in units for n in names)
        left = {(layer, head): len(names) for layer, head, names in units}
        heads: dict[tuple[int, int], object] = {}
        unreadable: dict[tuple[int, int], str] = {}  # shipped heads the driver could not load: their error
        inflight: dict[object, tuple[Part, int]] = {}  # ref -> (part, its attempt in this run)
        limit = max(2, int(2 * self.cluster.cpus() / self.cpus_per_task))  # keeps workers fed, memory bounded
        clock = self._clock() if self.part_timeout else None
        overdue: set = set()  # refs cancelled for the part timeout
        next_clock = 0.0  # when the overdue parts are looked for next
        watch = ClusterWatch(self.cluster, {"CPU": self.cpus_per_task}, "sweep", "Ctrl-C stops it; the same command "
                              "then goes on from the parts written", self.log)
        try:
            while todo or inflight:
                stops.check()  # the outcomes taken before are written: a lost Ctrl-C stops here (stops.py)
                while todo and len(inflight) < limit:
                    part, n = todo.popleft()
                    key = (part.layer, part.head)
                    if ship and key not in heads and key not in unreadable:
                        data, error = load(work, *key)  # a head that cannot be read fails its parts, not the sweep
                        if error is None:
                            heads[key] = ray.put(data)
                        else:
                            unreadable[key] = error
                    if key in unreadable:
                        on_outcome(Outcome(part, None, unreadable[key]))
                        continue
                    retries = 0 if clock else tries.get(part, 1) - 1
                    ref = task.options(num_cpus=self.cpus_per_task, max_retries=retries, retry_exceptions=False).remote(
                        work, part.layer, part.head, part.index, heads.get(key), clock, f"{part} #{n}",
                        self.part_timeout)
                    inflight[ref] = (part, n)
                if not inflight:  # every part submitted so far was of an unreadable head
                    continue
                done, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)  # wakes up for Ctrl-C
                if clock is not None and time.monotonic() >= next_clock and watch.head_up():  # its calls block on a
                    next_clock = time.monotonic() + CLOCK_EVERY_S  # head that is gone: asked each time, not too often
                    overdue |= self._cancel_overdue(clock, {r: f"{p} #{n}" for r, (p, n) in inflight.items()
                                                            if r not in done and r not in overdue})
                for ref in done:
                    part, n = inflight.pop(ref)
                    outcome = self._outcome(ref, part, n if clock else tries.get(part, 1))
                    if outcome.crashed and (ref in overdue or clock is not None and watch.head_up()
                                            and self._timed_out(clock, f"{part} #{n}")):
                        outcome = Outcome(part, None, f"its Ray worker was killed: the index ran past --part-timeout "
                                                      f"{self.part_timeout:g} s", n, crashed=True)
                    elif clock is not None and outcome.crashed and n < tries.get(part, 1):
                        self.log(f"its Ray worker died while running {part}; retrying (attempt {n + 1} of "
                                 f"{tries[part]})")
                        todo.appendleft((part, n + 1))
                        continue
                    elif clock is not None:  # the driver counted this part's attempts
                        outcome = replace(outcome, attempts=n)
                    overdue.discard(ref)
                    on_outcome(outcome)
                    left[(part.layer, part.head)] -= 1
                    if not left[(part.layer, part.head)]:
                        heads.pop((part.layer, part.head), None)  # its last task ended: free the shipped arrays
                watch()  # after the finished parts are handed on: a head lost now loses none of them
        except KeyboardInterrupt:
            self.cluster.abandon(list(inflight))
            raise
        except ExecutorLost:
            clock = None  # an actor call to a cluster without its head waits for Ray's end of the process
            raise
        finally:
            if clock is not None:
                try:  # never in the way of the KeyboardInterrupt or error that ends the run
                    ray.kill(clock)
                except Exception:  # noqa: BLE001
                    pass

    def _clock(self):
        """The part-timeout clock: an actor on the driver's node where it can, up before any task starts (a worker's
        call to an actor still starting waits in that worker, and dies with it). Restarted if it dies: the attempts
        it lost then count as workers' deaths when their watchdog ends them, rather than the sweep failing."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(self.ray.get_runtime_context().get_node_id(), soft=True)
        clock = self.ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1,
                                scheduling_strategy=here)(_StartClock).remote()
        try:
            self.ray.get(clock.running_for.remote(), timeout=120)
        except self.ray.exceptions.RayError as err:
            self.log(f"ray: the part-timeout clock did not start ({type(err).__name__}); a part that times out counts "
                     "as its worker's death")
        return clock

    def _ask(self, clock, timeout: float) -> dict | str:
        """The clock's ``running_for``, or why not (its error's name, or that it did not answer within ``timeout``
        seconds: waited for with ``ray.wait``, as ``ray.get``'s own timeout never came once the head was gone)."""
        try:
            ref = clock.running_for.remote()
            ready, _ = self.ray.wait([ref], timeout=timeout)
            return self.ray.get(ref) if ready else f"no answer in {timeout:g} s"
        except self.ray.exceptions.RayError as err:
            return type(err).__name__

    def _timed_out(self, clock, key: str) -> bool:
        """Whether the dead attempt ``key`` was ended by its own watchdog: the clock saw its index start and not end,
        about the part timeout ago (False without a clock, or when it does not answer: the attempt then counts as a
        worker's death)."""
        if clock is None:
            return False
        started = self._ask(clock, 60.0)
        return isinstance(started, dict) and started.get(key, 0.0) >= (1.0 - CLOCK_SLACK) * self.part_timeout

    def _cancel_overdue(self, clock, running: dict) -> set:
        """Force-cancel the tasks (``running``: ref -> its attempt's key) whose worker is still running ``BACKSTOP``
        part timeouts after its index started (its watchdog did not end it); returns their refs. One that has just
        finished is left its result. (One that ends at the very moment of the cancel races it, which Ray 2.60 may
        answer by aborting the driver: see Cluster.abandon; finished parts are on disk by then, and the same command
        resumes. The watchdog leaves this to indexes that replace it.)"""
        ray = self.ray
        started = self._ask(clock, CLOCK_WAIT_S)
        if not isinstance(started, dict):
            self.log(f"ray: the part-timeout clock did not answer ({started}); no part timed out this round")
            return set()
        late = [ref for ref, key in running.items() if started.get(key, 0.0) > BACKSTOP * self.part_timeout]
        if late:
            ready, _ = ray.wait(late, num_returns=len(late), timeout=0)
            late = [ref for ref in late if ref not in ready]
        for ref in late:
            ray.cancel(ref, force=True)
        return set(late)

    def _outcome(self, ref, part: Part, tries: int) -> Outcome:
        """The part's result; a Ray error is a crash (``crashed``) when the worker or its node died, the task's own
        failure otherwise (its error raised outside the index, or a result that would not load: never retried)."""
        errors = self.ray.exceptions
        try:
            table, error = self.ray.get(ref)
            return Outcome(part, table, error)
        except errors.RayError as err:
            first = ray_error_text(err)
            deaths = tuple(getattr(errors, name) for name in _DEATHS if hasattr(errors, name))
            if not isinstance(err, deaths):
                return Outcome(part, None, f"its Ray task failed ({type(err).__name__}: {first})")
            return Outcome(part, None, f"its Ray worker died {tries} time(s) ({type(err).__name__}: {first})",
                           tries, crashed=True)
