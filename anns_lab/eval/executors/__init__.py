"""Where a sweep's parts run: ``local`` (worker processes on this machine, the default) or ``ray`` (a Ray cluster).

Both run the same work (:class:`base.Work`), fail a crashing part alone with a message naming it,
retry a part whose worker died up to a bound, and stop at once on Ctrl-C. Nothing of Ray is
imported unless the Ray executor is asked for.
"""

from __future__ import annotations

import math

from anns_lab.errors import AnnsLabError
from anns_lab.eval.executors.base import Executor, Outcome, Part

EXECUTORS = ("local", "ray")


def open_executor(name: str, jobs: int = 2, address: str | None = None, cpus_per_task: float = 1.0,
                  data: str = "auto", log=print, part_timeout: float = 0.0) -> Executor:
    """The executor ``name`` (connected and checked when it is Ray); raises AnnsLabError for bad settings.
    ``part_timeout``: seconds an index may run on a head before its worker is killed (0: no bound)."""
    if not (part_timeout >= 0 and math.isfinite(part_timeout)):
        raise AnnsLabError(f"--part-timeout {part_timeout}: give seconds (0 for no bound)")
    if name == "local":
        ray_only = [flag for flag, given in (("--address", address is not None), ("--cpus-per-task", cpus_per_task != 1.0),
                                             ("--ray-data", data != "auto")) if given]
        if ray_only:  # silently ignored before (but --address): the run was not the one asked for
            raise AnnsLabError(f"{', '.join(ray_only)} {'is' if len(ray_only) == 1 else 'are'} for --executor ray; the "
                               "local executor runs on this machine")
        from anns_lab.eval.executors.local import LocalExecutor

        return LocalExecutor(jobs, log, part_timeout)
    if name == "ray":
        from anns_lab.eval.executors.ray_executor import RayExecutor

        return RayExecutor(address, jobs, cpus_per_task, data, log, part_timeout)
    raise AnnsLabError(f"unknown executor {name!r}; known: {', '.join(EXECUTORS)}")


__all__ = ["EXECUTORS", "Executor", "Outcome", "Part", "open_executor"]
