"""Joining a Ray cluster (or starting Ray here) and checking it can run a task; shared by sweep and decode.

``ray`` is imported here only, and only when a Ray executor is asked for.
"""

from __future__ import annotations

import math
import os
import re
import socket
import time
from collections.abc import Callable

from anns_lab import stops
from anns_lab.errors import AnnsLabError, ExecutorLost


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


HANDSHAKE_S = 10.0  # how long a Ray head's GCS port may take to answer the gRPC handshake
WATCH_EVERY_S = 10.0  # how often a driver waiting on its tasks asks whether a node can still run them
PROBE_S = 2.0  # how long the head may take to answer the driver's watch


def _host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` split, an IPv6 host in brackets; one clear error for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise AnnsLabError(f"--address takes HOST:PORT of a Ray head (e.g. 10.0.0.5:6379, an IPv6 host in brackets: "
                           f"[::1]:6379) or 'auto', got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _tcp_answers(address: str, timeout: float) -> OSError | None:
    """None when ``address`` takes a TCP connection within ``timeout`` seconds, else the error."""
    try:
        socket.create_connection(_host_port(address), timeout=timeout).close()
        return None
    except OSError as err:
        return err


def _reachable(address: str) -> None:
    """One clear error unless something at ``address`` answers as a Ray head would: a TCP port that takes a
    connection, then a gRPC (HTTP/2) handshake. ``ray.init`` at an open port of another kind (an HTTP server, SSH)
    retried its GCS connection for ever."""
    if err := _tcp_answers(address, 5):
        raise AnnsLabError(f"cannot reach a Ray cluster at {address} ({err.strerror or err}); start one there with "
                           "`ray start --head --port PORT`, or leave out --address to run Ray on this machine")
    if _speaks_grpc(address, HANDSHAKE_S) is False:
        raise AnnsLabError(f"{address} takes connections but is not a Ray head: no gRPC handshake within "
                           f"{HANDSHAKE_S:g} s (a Ray head's GCS port answers one: the PORT of `ray start --head "
                           "--port PORT`, 6379 by default)")


# An HTTP/2 client's opening (RFC 9113 §3.4): its preface, then an empty SETTINGS frame (length 0, type 4, stream 0)
_H2_OPENING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _speaks_grpc(address: str, timeout: float) -> bool | None:
    """Whether the server at ``address`` answers an HTTP/2 client's opening, as gRPC servers (a Ray head's GCS) do,
    with its own SETTINGS frame within ``timeout`` seconds (a process that is stopped or hung does not, though the
    kernel still takes its TCP connections); None on a cluster on TLS, whose handshake needs its certificates. A
    plain socket, a few milliseconds: grpc's own channel checks its state every 200 ms, and it took an
    ``http_proxy`` that Ray's channels do not."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    try:
        with socket.create_connection(_host_port(address), timeout=timeout) as sock:
            sock.sendall(_H2_OPENING)
            header = b""
            while len(header) < 9:  # the first frame's header: length (3), type (1), flags, stream (4)
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    return False
                header += chunk
    except OSError:  # refused, reset, or no answer within the timeout
        return False
    return header[3] == 4 and header[5:9] == bytes(4)


class Cluster:
    """A connection to Ray: joins ``address`` ('auto' = the cluster this machine is part of), or starts a
    private Ray on this machine with ``local_cpus`` CPUs when ``address`` is None. A connection that was
    already open in this process is used as it is and left open."""

    def __init__(self, address: str | None, local_cpus: int, log=print) -> None:
        self.ray = ray = require_ray()
        self.owned, self.lost = not ray.is_initialized(), False
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
        self.gcs = ray.get_runtime_context().gcs_address  # HOST:PORT as Ray itself reaches the head
        self.head = address if address not in (None, "auto") else self.gcs  # in the user's words
        nodes = self.nodes()
        cpus = sum(n["Resources"].get("CPU", 0) for n in nodes)
        gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
        where = "a private Ray on this machine" if address is None and self.owned else f"the Ray cluster at {self.head}"
        self.summary = f"{where}: {len(nodes)} node(s), {cpus:g} CPUs, {gpus:g} GPUs"
        log(f"ray: {self.summary}")

    def nodes(self) -> list[dict]:
        return [n for n in self.ray.nodes() if n.get("Alive")]

    def gpus(self) -> float:
        return sum(n["Resources"].get("GPU", 0) for n in self.nodes())

    def cpus(self) -> float:
        return sum(n["Resources"].get("CPU", 0) for n in self.nodes())

    def head_answers(self) -> bool:
        """Whether the head's GCS completes a gRPC handshake within ``PROBE_S`` (on TLS: takes a TCP connection),
        asked without Ray: once the head is gone, Ray's own calls block until Ray ends the process."""
        try:
            spoke = _speaks_grpc(self.gcs, PROBE_S)
            return spoke if spoke is not None else _tcp_answers(self.gcs, PROBE_S) is None
        except AnnsLabError:  # an address of Ray's this parser does not take: Ray's own calls are the judge
            return True

    def fits(self, resources: dict[str, float]) -> bool:
        """Whether an alive node has ``resources`` (in all: taken or free)."""
        return any(all(n["Resources"].get(r, 0) >= v for r, v in resources.items()) for n in self.nodes())

    def largest(self, resources: dict[str, float]) -> str:
        """The most of each of ``resources`` an alive node has, in words ("1 CPU, 0 GPU")."""
        return ", ".join(f"{max((n['Resources'].get(r, 0) for n in self.nodes()), default=0):g} {r}" for r in resources)

    def require(self, resources: dict[str, float], what: str) -> None:
        """Refuse, before any work, a task that no node can hold (Ray would wait for it forever)."""
        if self.fits(resources):
            return
        need = ", ".join(f"{v:g} {r}" for r, v in resources.items())
        have = self.largest(resources)
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
        """Leave Ray where this connection started it; not a cluster whose head is lost (Ray's shutdown then waits
        on it, up to Ray's own end of the process, and the run's last words would be lost)."""
        if self.owned and self.ray.is_initialized() and not self.lost:
            self.ray.shutdown()
            self.owned = False


def reconnect_s() -> float:
    """How long Ray's processes wait for a head whose GCS stopped answering before Ray ends them (a driver too: no
    Python runs then, so nothing can say what was kept)."""
    try:
        return float(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", 60))
    except ValueError:
        return 60.0


class ClusterWatch:
    """Asked at each turn of a driver's waiting loop (at most every ``every`` seconds, ``WATCH_EVERY_S``): says, once,
    when no alive node can run a task any more (the nodes that could have died: Ray then holds the tasks until one
    joins, and the driver waited without a word), and once when one can again; raises :class:`ExecutorLost` when the
    head has not answered for half of ``reconnect_s`` (Ray would end the driver at the whole, with no word of what was
    kept: the run's own stop writes what finished and says how to go on)."""

    def __init__(self, cluster: Cluster, resources: dict[str, float], what: str, after: str, log=print,
                 every: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster, self.resources, self.what, self.after = cluster, resources, what, after
        self.lost_after = reconnect_s() / 2
        # asked often enough to give up well before Ray ends the driver (at twice lost_after)
        every = min(WATCH_EVERY_S, self.lost_after / 3) if every is None else every
        self.log, self.every, self.clock = log, every, clock
        self.errors = (OSError, RuntimeError, cluster.ray.exceptions.RayError)  # a head going away
        self.next, self.short, self.silent_since = clock() + self.every, False, None

    def head_up(self, now: float | None = None) -> bool:
        """Whether the head answers now (asked at once, its silence timed from ``now``, the watch's clock): before a
        call of Ray's that would block on a head that is gone (an actor's, whose restart needs it)."""
        now = self.clock() if now is None else now
        if self.cluster.head_answers():
            self.silent_since = None
            return True
        self.silent_since = now if self.silent_since is None else self.silent_since
        return False

    def __call__(self) -> None:
        now = self.clock()
        if now < self.next:
            return
        self.next = now + self.every
        if not self.head_up(now):
            if now - self.silent_since >= self.lost_after:
                self.cluster.lost = True
                raise ExecutorLost(f"lost the Ray head at {self.cluster.head}: it has not answered for "
                                   f"{now - self.silent_since:.0f} s")
            return
        try:
            have = None if self.cluster.fits(self.resources) else self.cluster.largest(self.resources)
        except self.errors:  # the head going away just now: asked again at the next turn
            return
        if have is not None and not self.short:
            need = ", ".join(f"{v:g} {r}" for r, v in self.resources.items())
            self.log(f"ray: no node alive can run a {self.what} task now (each needs {need}; the alive nodes have at "
                     f"most {have}): the {self.what} waits for a node to join. {self.after}")
        elif have is None and self.short:
            self.log(f"ray: a node that can run {self.what} tasks has joined; going on")
        self.short = have is not None


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
