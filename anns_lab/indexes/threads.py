"""Threads that each run their kernels on one core, and independent index builds spread over them.

numba's, faiss's and torch's kernels each start their own thread team per call. Beside other work (the decoder builds
its indexes while the prefill keeps the cores busy) a team's threads wait for each other at every barrier, and they wait
spinning: on the 2-core machine a SmolLM2 8K head's build cost 0.65 CPU s with each library's default threads against
0.26 s on one (``benchmarks/bench_decoder_build.py``; BENCHMARKS "Scale"), its faiss k-means 0.21 s against 0.005. Independent builds
(one per query head) on one-core threads side by side use the cores with no barrier at all.

Each library's setting is per thread: numba's ``set_num_threads`` and faiss's OpenMP ``omp_set_num_threads`` hold for the
calling thread. torch's ``set_num_threads`` is process-wide (it also sets MKL's threads, which the prefill's matmuls on
other threads use), so a thread's torch team is narrowed in torch's own OpenMP runtime instead, for that thread only.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import faiss
import numba

T = TypeVar("T")

_POOL: list = [None, 0]  # the pool and the process that made it (a forked child must not use its parent's)


def one_thread() -> None:
    """Run the calling thread's numba, faiss and torch kernels on one thread (the other threads keep theirs)."""
    numba.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    _torch_one_thread()


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


def map_one_thread(fn: Callable[..., T], items: Iterable) -> list[T]:
    """``[fn(x) for x in items]`` in order, run on as many threads as there are cores, each running its kernels on one
    thread (:func:`one_thread`). A single item, or a single core, runs on the calling thread as it is; so does every
    item under numba's ``workqueue`` threading layer (:func:`_numba_threadsafe`)."""
    items = list(items)
    workers = min(len(items), os.cpu_count() or 1)
    if workers <= 1 or not _numba_threadsafe():
        return [fn(x) for x in items]
    pool, pid = _POOL
    if pool is None or pid != os.getpid():
        pool = ThreadPoolExecutor(os.cpu_count(), thread_name_prefix="anns-lab-build", initializer=one_thread)
        _POOL[:] = [pool, os.getpid()]
    return [f.result() for f in [pool.submit(fn, x) for x in items]]


def _numba_threadsafe() -> bool:
    """Whether numba's threading layer lets several threads run its parallel kernels at once: TBB and OpenMP do;
    ``workqueue`` (where neither loads, or ``NUMBA_THREADING_LAYER`` asks for it) aborts the process when two do."""
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()  # picks the layer (once), as the first parallel kernel would
    return numba.threading_layer() != "workqueue"
