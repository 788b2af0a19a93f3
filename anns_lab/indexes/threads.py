"""Threads that each run their kernels on one core, and independent index builds spread over them.

numba's, faiss's and torch's kernels each start their own thread team per call. Beside other work (the decoder builds
its indexes while the prefill keeps the cores busy) a team's threads wait for each other at every barrier, and they wait
spinning: on the 2-core machine a SmolLM2 8K head's build cost 0.65 CPU s with each library's default threads against
0.26 s on one (``benchmarks/bench_decoder_build.py``; BENCHMARKS "Scale"), its faiss k-means 0.21 s against 0.005. Independent builds
(one per query head) on one-core threads side by side use the cores with no barrier at all: as many at once as the
process gave the calling thread (:func:`thread_budget`). A lone build beside other work (the prefill, or the decoder's
other layer building at the same time: ``decode.builds.EarlyBuilds``) runs on one such thread too; a build with
nothing beside it keeps the libraries' full teams.

Beside the prefill the builds' threads also run at the lowest CPU priority (:func:`lower_priority`; Linux, where a
nice value is per thread): the prefill, which the first token waits for whole, keeps the cores whenever it can use them,
and the builds take what it leaves (its serial stretches, its threads' waits), then the cores once it has ended. As
equals they cost more than their CPU: on the 2-core machine an 8K SmolLM2 prefill beside its builds took 1.6x its time
alone, and a first token came 0.91x as late with the builds below it (BENCHMARKS "Builds below the prefill").

Each library's setting is per thread: numba's ``set_num_threads`` and faiss's OpenMP ``omp_set_num_threads`` hold for the
calling thread. torch's ``set_num_threads`` is process-wide (it also sets MKL's threads, which the prefill's matmuls on
other threads use), so a thread's torch team is narrowed in torch's own OpenMP runtime instead, for that thread only.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import faiss
import numba

T = TypeVar("T")

_POOLS: dict = {}  # (process, workers, beside, caller's nice) -> pool: a forked child must not use its parent's
_POOLS_LOCK = threading.Lock()  # the decoder's early-build workers ask for their pool at the same moment
LOWEST_PRIORITY = 19  # the nice value of a thread that builds beside the prefill
_OMP_DEFAULT: dict = {}  # process -> OpenMP's count for a thread that set none
_STOP = threading.local()  # .event: the calling thread's stop (stopping_on), checked by its map_one_thread items


def one_thread() -> None:
    """Run the calling thread's numba, faiss and torch kernels on one thread (the other threads keep theirs)."""
    numba.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    _torch_one_thread()


def numpy_blas() -> list:
    """threadpoolctl's controllers of the BLAS numpy's wheels bundle (``numpy.libs`` beside the package, ``.dylibs``
    inside it on macOS: ``libscipy_openblas`` since numpy 2, ``libopenblas64_`` before); none for a numpy linked to a
    BLAS of the system or of conda, which torch or faiss may share."""
    import numpy
    from threadpoolctl import ThreadpoolController

    package = Path(numpy.__file__).resolve().parent
    own = (package.parent / "numpy.libs", package / ".dylibs")
    return [c for c in ThreadpoolController().lib_controllers
            if c.user_api == "blas" and any(Path(c.filepath).resolve().is_relative_to(d) for d in own)]


def numpy_blas_one_thread() -> None:
    """numpy's own BLAS (:func:`numpy_blas`) on one thread, for the whole process (its count is global, unlike the
    libraries :func:`one_thread` narrows per thread): the decoder's build and search threads call it (plugins'
    ``keys[ids] @ q``, loki's covariance) beside the prefill, where its team spins against the prefill's threads
    (BENCHMARKS "numpy's BLAS on one thread in the decoder"). torch and faiss keep their teams."""
    for controller in numpy_blas():
        controller.set_num_threads(1)


def lower_priority() -> None:
    """Run the calling thread at the lowest CPU priority (nice :data:`LOWEST_PRIORITY`) for good: on Linux, where nice
    is a thread's own (other threads keep theirs); elsewhere, or where it is refused, it keeps its priority."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
        except OSError:  # not permitted here: the builds then share the cores with the prefill as equals
            pass


def _own_priority() -> int:
    """The calling thread's nice value (Linux: a thread's own); 0 where there is none to read."""
    if sys.platform.startswith("linux"):
        try:
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        except OSError:
            pass
    return 0


def _beside_worker() -> None:
    """A pool thread for builds beside other work: its kernels on one thread, below that work's priority."""
    one_thread()
    lower_priority()


def _torch_one_thread() -> None:
    """One thread for torch's kernels called from this thread: ``omp_set_num_threads(1)`` in the OpenMP runtime torch
    ships (the one its parallel loops and oneDNN ask), after torch has set this thread's count from its global one
    (it does so on a thread's first ``get_num_threads``). A torch without its own ``libgomp`` keeps its threads."""
    import torch

    torch.get_num_threads()
    lib = Path(torch.__file__).parent / "lib"
    gomp = sorted(lib.glob("libgomp*.so*"))
    if gomp:
        try:
            ctypes.CDLL(str(gomp[0])).omp_set_num_threads(1)
        except (OSError, AttributeError):  # not loadable here: only slower
            pass


def thread_budget() -> int:
    """The threads the calling thread's kernels were given: numba's count (``NUMBA_NUM_THREADS``, or ``set_num_threads``
    on this thread), at most the process's OpenMP count (``OMP_NUM_THREADS``, which Ray sets to a task's CPUs; numba does
    not read it). Not this thread's OpenMP count: that is torch's too (``--torch-threads``, :func:`set_torch_threads`)."""
    return max(1, min(numba.get_num_threads(), _omp_default()))


def _omp_default() -> int:
    """OpenMP's count for a thread that set none (``OMP_NUM_THREADS``, else the cores), read on a fresh thread once per
    process: the calling thread's may be torch's (torch sets its threads as OpenMP's count of the calling thread, in the
    runtime faiss shares)."""
    pid = os.getpid()
    if pid not in _OMP_DEFAULT:
        out: list[int] = []
        reader = threading.Thread(target=lambda: out.append(faiss.omp_get_max_threads()))
        reader.start()
        reader.join()
        _OMP_DEFAULT[pid] = out[0]
    return _OMP_DEFAULT[pid]


def set_torch_threads(n: int) -> None:
    """torch's CPU threads (``decode --torch-threads``) set to ``n`` for good: numba's thread pool is started first,
    since numba's OpenMP layer sets the OpenMP count of the thread that starts it, which torch reads as its own (a
    first parallel kernel on this thread later would give torch numba's count)."""
    import torch
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()
    torch.set_num_threads(n)


def map_one_thread(fn: Callable[..., T], items: Iterable, beside: bool = False) -> list[T]:
    """``[fn(x) for x in items]`` in order, at most :func:`thread_budget` at once, each on a thread running its kernels
    on one thread (:func:`one_thread`). A single item runs on the calling thread as it is (the libraries' full teams),
    unless ``beside`` other work (the decoder's prefill), whose threads a team would spin against; ``beside``, the
    threads run below that work's priority (:func:`lower_priority`). A budget of one, or numba's ``workqueue`` threading
    layer (:func:`numba_threadsafe`), runs every item on the calling thread. An item's error stops the others
    (:func:`settle`), and so does the calling thread's stop (:func:`stopping_on`)."""
    items = list(items)
    fn = _unless_stopped(fn, current_stop())
    budget = thread_budget()
    if budget <= 1 or len(items) < (1 if beside else 2) or not numba_threadsafe():
        return [fn(x) for x in items]
    # A pool's threads start on its first submits and take the submitting thread's priority: a caller at the early
    # builds' lowest priority must not leave a later caller at its own priority a pool of lowered threads.
    key = (os.getpid(), budget, beside, _own_priority())
    with _POOLS_LOCK:
        if key not in _POOLS:  # separate pools: a thread's lowered priority cannot be raised again without privileges
            _POOLS[key] = ThreadPoolExecutor(budget, thread_name_prefix="anns-lab-build",
                                             initializer=_beside_worker if beside else one_thread)
        pool = _POOLS[key]
    return settle([pool.submit(fn, x) for x in items])


def settle(futures: list[Future], stop: threading.Event | None = None) -> list:
    """The ``futures``' results in order once all have run. At the first error (or an interrupt of the waiting thread)
    the ones not started are cancelled, ``stop`` is set (the running ones' own items then stop: :func:`stopping_on`)
    and the running ones waited for, then the first failed one's error is raised (in the list's order, one that was
    only stopped last): nothing of the work outlives the error (a shared pool's threads would build on for nothing, and
    whatever is queued next, as the next layer's or decode's builds, would wait behind it)."""
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
    finally:
        for f in futures:
            f.cancel()  # only those not started: a running one cannot be stopped
        if stop is not None and not all(f.done() for f in futures):
            stop.set()
        wait(futures)
    errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, CancelledError)), errors[0])
    return [f.result() for f in futures]


@contextmanager
def stopping_on(event: threading.Event) -> Iterator[None]:
    """Within it, the calling thread's :func:`map_one_thread` items not started when ``event`` is set do not run (each
    raises ``CancelledError``): an interrupt, or another layer's error, then waits for the items running, not for the
    rest of the layers building."""
    before = getattr(_STOP, "event", None)
    _STOP.event = event
    try:
        yield
    finally:
        _STOP.event = before


def current_stop() -> threading.Event | None:
    """The calling thread's stop (:func:`stopping_on`), or None."""
    return getattr(_STOP, "event", None)


def _unless_stopped(fn: Callable[..., T], stop: threading.Event | None) -> Callable[..., T]:
    """``fn``, refusing to start once ``stop`` is set."""
    if stop is None:
        return fn

    def run(x):
        if stop.is_set():
            raise CancelledError("stopped: an interrupt, or another build's error")
        return fn(x)

    return run


def numba_threadsafe() -> bool:
    """Whether numba's threading layer lets several threads run its parallel kernels at once: TBB and OpenMP do;
    ``workqueue`` (where neither loads, or ``NUMBA_THREADING_LAYER`` asks for it) aborts the process when two do."""
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()  # picks the layer (once), as the first parallel kernel would
    return numba.threading_layer() != "workqueue"
