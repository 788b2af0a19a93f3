"""Where a sweep's parts run: ``local`` (worker processes on this machine, the default) or ``ray`` (a Ray cluster).

Both run the same work (:class:`base.Work`), fail a crashing part alone with a message naming it,
retry a part whose worker died up to a bound, and stop at once on Ctrl-C. Nothing of Ray is
imported unless the Ray executor is asked for.
"""

from __future__ import annotations

import math
import os

from anns_lab.errors import AnnsLabError
from anns_lab.eval.executors.base import Executor, Outcome, Part

EXECUTORS = ("local", "ray")


def open_executor(name: str, jobs: int | None = None, address: str | None = None, cpus_per_task: float | None = None,
                  data: str | None = None, log=print, part_timeout: float = 0.0) -> Executor:
    """The executor ``name`` (connected and checked when it is Ray); raises AnnsLabError for bad settings.
    ``cpus_per_task`` (default 1) and ``data`` (default ``auto``) are Ray's: given to the local executor, refused.
    ``part_timeout``: seconds an index may run on a head before its worker is killed (0: no bound)."""
    if not (part_timeout >= 0 and math.isfinite(part_timeout)):
        raise AnnsLabError(f"--part-timeout {part_timeout}: give seconds (0 for no bound)")
    if jobs is None:  # two workers, where the machine has two CPUs (more would share them)
        jobs = min(2, machine_cpus())
    if name == "local":
        ray_only = [flag for flag, value in (("--address", address), ("--cpus-per-task", cpus_per_task),
                                             ("--ray-data", data)) if value is not None]
        if ray_only:  # silently ignored before (but --address): the run was not the one asked for
            raise AnnsLabError(f"{', '.join(ray_only)} {'is' if len(ray_only) == 1 else 'are'} for --executor ray; the "
                               "local executor runs on this machine")
        _check_jobs(jobs)
        from anns_lab.eval.executors.local import LocalExecutor

        return LocalExecutor(jobs, log, part_timeout)
    if name == "ray":
        cpus_per_task, data = 1.0 if cpus_per_task is None else cpus_per_task, data or "auto"
        from anns_lab.eval.executors.ray_cluster import check_cpus_per_task, require_ray
        from anns_lab.eval.executors.ray_executor import RayExecutor

        if address is None and not require_ray().is_initialized():  # a private Ray here, of --jobs CPUs (a connection
            _check_jobs(jobs, check_cpus_per_task(cpus_per_task))    # already open is used as it is)
        return RayExecutor(address, jobs, cpus_per_task, data, log, part_timeout)
    raise AnnsLabError(f"unknown executor {name!r}; known: {', '.join(EXECUTORS)}")


CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2's CPU quota of this process's group: "QUOTA PERIOD" or "max PERIOD"


def machine_cpus() -> int:
    """The CPUs this process may run on: its affinity (taskset, cpusets), within a cgroup v2 CPU quota (a container's
    ``--cpus``) where one is set; not the host's count."""
    cpus = len(os.sched_getaffinity(os.getpid())) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open(CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":  # whole CPUs: 1.5 of them run one worker at full speed, not two
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def _check_jobs(jobs: int, cpus_per_task: float = 1.0) -> None:
    """Workers on this machine (local ones, or a private Ray's CPUs) fit its CPUs, and a private Ray's task fits it:
    more single-threaded workers than CPUs slow every part and skew the table's timings (``--jobs 64`` on 2 CPUs ran,
    with the memory of 64 loaded heads), and the remedy for a task larger than the private Ray is ``--jobs``."""
    cpus = machine_cpus()
    if jobs > cpus:
        raise AnnsLabError(f"--jobs {jobs}: this machine gives this process {cpus} CPUs, and each job is a single-threaded "
                           f"worker (more would share CPUs and skew the timings): give at most {cpus}")
    if cpus_per_task > cpus:  # no --jobs gives a private Ray room for it
        raise AnnsLabError(f"--cpus-per-task {cpus_per_task:g} is more than the {cpus} CPUs this machine gives this "
                           "process, which a private Ray can hold at most: lower --cpus-per-task, or join a larger "
                           "cluster with --address")
    if cpus_per_task > jobs:
        raise AnnsLabError(f"--cpus-per-task {cpus_per_task:g} is more than the private Ray's {jobs} CPUs (--jobs): "
                           f"raise --jobs to {math.ceil(cpus_per_task)} (this machine has {cpus}) or lower --cpus-per-task")


__all__ = ["EXECUTORS", "Executor", "Outcome", "Part", "open_executor"]
