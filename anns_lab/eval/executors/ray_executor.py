"""The Ray executor: one Ray task per (layer, head, index), ``cpus_per_task`` CPUs each, on a Ray cluster.

A task per index (not per head) makes a worker that dies attributable to exactly one part; Ray
retries it (``max_retries``: the part's attempts left) and the driver records it as failed only
when they are used up. Workers read the dump through its path when every node sees the same dump
there (a shared file system); otherwise the driver loads each head once and ships its arrays
through the object store, released when the head's last task ends. Ray itself sizes a worker's
thread pools to its ``num_cpus`` (OMP_NUM_THREADS). The driver alone writes
``parts/``, exactly as with the local executor, so a sweep may move between the two.

With a ``part_timeout``, each task tells a small clock actor when its index starts (after its head is read, as
the local executor counts): the driver cancels a task that runs past it with ``force=True``, which kills its
worker process whatever the index is doing, and fails the part as timed out (a cancelled task is not retried).
"""

from __future__ import annotations

import time
from collections import deque

from anns_lab.errors import AnnsLabError
from anns_lab.eval.executors.base import OnOutcome, OnRunning, Outcome, Part, Unit, Work, attempt, load
from anns_lab.eval.executors.ray_cluster import Cluster, check_cpus_per_task

DATA_MODES = ("auto", "path", "ship")


def _part_task(work: Work, layer: int, head: int, index: str, data=None, clock=None):
    """Runs on a Ray worker: one part; its error (SystemExit included) comes back as text. ``clock`` (an actor
    handle, with a part timeout) hears when the index starts."""
    work.setup_worker()
    error = None
    if data is None:
        data, error = load(work, layer, head)
    if error:
        return None, error
    if clock is not None:  # waited for: an index that then holds the GIL for ever must already be on the clock
        import ray

        ray.get(clock.start.remote(str(Part(layer, head, index))))
    return attempt(work, data, index)


class _StartClock:
    """A Ray actor: when each part's index started, on this actor's one clock (nodes' clocks may differ)."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}

    def start(self, part: str) -> None:
        self.started[part] = time.monotonic()  # a retried task starts its clock again

    def running_for(self) -> dict[str, float]:
        now = time.monotonic()
        return {part: now - t for part, t in self.started.items()}


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
        self.part_timeout = part_timeout  # seconds an index may run (its head's load not counted); 0: no bound
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
            return self.data
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        mine = work.fingerprint()
        probe = self.ray.remote(_fingerprint_task)
        refs = {n["NodeManagerAddress"] + " " + n["NodeID"][:8]: probe.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(work)
                for n in self.cluster.nodes()}
        seen = dict(zip(refs, self.ray.get(list(refs.values()), timeout=300)))
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
        is not called: a submitted part may still wait in Ray's queue, and the driver does not see it start."""
        ray = self.ray
        ship = self.data_mode(work) == "ship"
        task = ray.remote(_part_task)
        todo = deque(Part(layer, head, n) for layer, head, names in units for n in names)
        left = {(layer, head): len(names) for layer, head, names in units}
        heads: dict[tuple[int, int], object] = {}
        unreadable: dict[tuple[int, int], str] = {}  # shipped heads the driver could not load: their error
        inflight: dict[object, Part] = {}
        limit = max(2, int(2 * self.cluster.cpus() / self.cpus_per_task))  # keeps workers fed, memory bounded
        clock = ray.remote(num_cpus=0)(_StartClock).remote() if self.part_timeout else None
        overdue: set = set()  # refs cancelled for the part timeout
        try:
            while todo or inflight:
                while todo and len(inflight) < limit:
                    part = todo.popleft()
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
                    ref = task.options(num_cpus=self.cpus_per_task, max_retries=tries.get(part, 1) - 1,
                                       retry_exceptions=False).remote(work, part.layer, part.head, part.index,
                                                                      heads.get(key), clock)
                    inflight[ref] = part
                if not inflight:  # every part submitted so far was of an unreadable head
                    continue
                done, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)  # wakes up for Ctrl-C
                if clock is not None:
                    overdue |= self._cancel_overdue(clock, {r: p for r, p in inflight.items() if r not in done})
                for ref in done:
                    part = inflight.pop(ref)
                    if ref in overdue:
                        on_outcome(Outcome(part, None, f"its Ray worker was killed: the index ran past --part-timeout "
                                                       f"{self.part_timeout:g} s", crashed=True))
                        continue
                    on_outcome(self._outcome(ref, part, tries.get(part, 1)))
                    left[(part.layer, part.head)] -= 1
                    if not left[(part.layer, part.head)]:
                        heads.pop((part.layer, part.head), None)  # its last task ended: free the shipped arrays
        except KeyboardInterrupt:
            self.cluster.abandon(list(inflight))
            raise
        finally:
            if clock is not None:
                ray.kill(clock)

    def _cancel_overdue(self, clock, inflight: dict) -> set:
        """Force-cancel the tasks whose index has run past the part timeout; returns their refs. (One that ends at
        that very moment races the cancel, which Ray 2.60 may answer by aborting the driver: see Cluster.abandon.
        Finished parts are on disk by then, and the same command resumes.)"""
        started = self.ray.get(clock.running_for.remote(), timeout=60)
        late = {ref for ref, part in inflight.items() if started.get(str(part), 0.0) > self.part_timeout}
        for ref in late:
            self.ray.cancel(ref, force=True)
        return late

    def _outcome(self, ref, part: Part, tries: int) -> Outcome:
        try:
            table, error = self.ray.get(ref)
            return Outcome(part, table, error)
        except self.ray.exceptions.RayError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return Outcome(part, None, f"its Ray worker died {tries} time(s) ({type(err).__name__}: {first})",
                           tries, crashed=True)
