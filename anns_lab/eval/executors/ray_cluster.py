"""Joining a Ray cluster (or starting Ray here) and checking it can run a task; shared by sweep and decode.

``ray`` is imported here only, and only when a Ray executor is asked for.
"""

from __future__ import annotations

import math
import re
import socket

from anns_lab import stops
from anns_lab.errors import AnnsLabError


def require_ray():
    """The ``ray`` module, or one clear error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise AnnsLabError("the Ray executor needs the ray package: pip install 'anns-lab[ray]' "
                           "(on the driver and every node of the cluster)") from None
    return ray


def check_cpus_per_task(value: float) -> float:
    """``value`` if it is a positive finite number of CPUs for one Ray task, else one clear error (NaN passes a
    ``<= 0`` test)."""
    if not (math.isfinite(value) and value >= 0.0001):  # Ray's own precision: below it, its ValueError after the folder
        raise AnnsLabError(f"--cpus-per-task must be a number of CPUs of at least 0.0001, got {value}")
    return float(value)


def _reachable(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise AnnsLabError(f"--address takes HOST:PORT of a Ray head (e.g. 10.0.0.5:6379) or 'auto', got {address!r}")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=5).close()
    except OSError as err:
        raise AnnsLabError(f"cannot reach a Ray cluster at {address} ({err.strerror or err}); start one there with "
                           "`ray start --head --port PORT`, or leave out --address to run Ray on this machine") from None


class Cluster:
    """A connection to Ray: joins ``address`` ('auto' = the cluster this machine is part of), or starts a
    private Ray on this machine with ``local_cpus`` CPUs when ``address`` is None. A connection that was
    already open in this process is used as it is and left open."""

    def __init__(self, address: str | None, local_cpus: int, log=print) -> None:
        self.ray = ray = require_ray()
        self.owned = not ray.is_initialized()
        if self.owned:
            if address not in (None, "auto"):
                _reachable(address)
            try:
                if address is None:  # "local": a new Ray, whatever RAY_ADDRESS or a `ray start` here would join
                    ray.init(address="local", num_cpus=max(1, local_cpus), include_dashboard=False,
                             logging_level="WARNING", log_to_driver=False, configure_logging=True)
                else:
                    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as err:
                where = "start a private Ray" if address is None else f"join the Ray cluster at {address}"
                raise AnnsLabError(f"cannot {where}: {str(err).splitlines()[0]}") from None
            stops.rearm()  # ray.init took SIGTERM over: a `kill` ended the driver without its clean stop
        nodes = self.nodes()
        cpus = sum(n["Resources"].get("CPU", 0) for n in nodes)
        gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
        where = "a private Ray on this machine" if address is None and self.owned else \
            f"the Ray cluster at {ray.get_runtime_context().gcs_address if address in (None, 'auto') else address}"
        self.summary = f"{where}: {len(nodes)} node(s), {cpus:g} CPUs, {gpus:g} GPUs"
        log(f"ray: {self.summary}")

    def nodes(self) -> list[dict]:
        return [n for n in self.ray.nodes() if n.get("Alive")]

    def gpus(self) -> float:
        return sum(n["Resources"].get("GPU", 0) for n in self.nodes())

    def cpus(self) -> float:
        return sum(n["Resources"].get("CPU", 0) for n in self.nodes())

    def require(self, resources: dict[str, float], what: str) -> None:
        """Refuse, before any work, a task that no node can hold (Ray would wait for it forever)."""
        for n in self.nodes():
            if all(n["Resources"].get(r, 0) >= v for r, v in resources.items()):
                return
        largest = {r: max((n["Resources"].get(r, 0) for n in self.nodes()), default=0) for r in resources}
        need = ", ".join(f"{v:g} {r}" for r, v in resources.items())
        have = ", ".join(f"{v:g} {r}" for r, v in largest.items())
        self.close()
        raise AnnsLabError(f"no node of {self.summary} can run a {what} task needing {need} (the largest node has {have}); "
                           "lower the request or add a node that has it")

    def abandon(self, refs: list) -> None:
        """Stop tasks the driver no longer waits for (Ctrl-C). A driver that started or joined Ray here ends its
        job on close, and Ray then ends the job's workers; cancelling one by one instead can race a task that is
        just finishing (Ray 2.60 aborts the driver on that race), so only a borrowed connection cancels."""
        if self.owned or not refs:
            return
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in set(refs) - set(ready):
            self.ray.cancel(ref)

    def close(self) -> None:
        if self.owned and self.ray.is_initialized():
            self.ray.shutdown()
            self.owned = False


ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its task names in errors


def ray_error_text(err: Exception) -> str:
    """A failed Ray task's error as one plain line: the exception the task raised (a ``RayTaskError``'s own first line
    only says where it ran, "ray::_part_task() (pid=…, ip=…)", in terminal colours), else the error's first line (a
    worker that died)."""
    cause = getattr(err, "cause", None)
    if cause is not None:
        text = str(cause) if isinstance(cause, AnnsLabError) else f"{type(cause).__name__}: {cause}"
    else:
        text = str(err).strip()
        text = text.splitlines()[0] if text else type(err).__name__
    return ANSI.sub("", text)
