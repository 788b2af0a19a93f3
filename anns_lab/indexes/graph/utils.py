"""Shared pieces of the graph kernels, in pynndescent's ``utils`` manner: binary heaps as parallel
(score, id) arrays, epoch-stamped visited sets, the per-thread search workspace, and the one helper
that runs a chunked kernel serially or on a thread pool.

Heaps: the beam is a min-heap of the L best nodes scanned (its root is the worst), the frontier a
min-heap of the negated scores of nodes not yet expanded (its root is the best): hnswlib's two-heap
best-first search, O(log L) per insertion where a sorted candidate list shifts O(L) entries.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, inline="always")
def push_min(hs, hi, n, s, v):
    """Push (s, v) on the min-heap ``hs``/``hi`` of size n; return the new size."""
    i = n
    while i > 0:
        p = (i - 1) >> 1
        if hs[p] <= s:
            break
        hs[i] = hs[p]
        hi[i] = hi[p]
        i = p
    hs[i] = s
    hi[i] = v
    return n + 1


@njit(cache=True, nogil=True, inline="always")
def sift_min(hs, hi, n, s, v):
    """Put (s, v) at the root of the min-heap of size n and sift it down."""
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and hs[c + 1] < hs[c]:
            c += 1
        if hs[c] >= s:
            break
        hs[i] = hs[c]
        hi[i] = hi[c]
        i = c
    hs[i] = s
    hi[i] = v


class Workspace(NamedTuple):
    """Scratch arrays of one search, reused from query to query (no n-sized allocation per query).

    ``visited`` (≥ n,) int32 is stamped with the query's epoch (bump it per query: no clearing);
    ``heap_s``/``heap_i`` hold the beam, top-k and frontier heaps (≥ :func:`heap_slots`); ``expanded``
    receives the expanded nodes in order, as far as it has room (the builds; empty at query time);
    ``memo`` (≥ n,) float32 the score of each node scanned (the row stop of ``search``; empty for full rows).
    """

    visited: np.ndarray
    heap_s: np.ndarray
    heap_i: np.ndarray
    expanded: np.ndarray
    memo: np.ndarray


HEADROOM = 4  # a grown workspace has room for n / 2**HEADROOM more keys (thread_workspace)


def heap_slots(n: int, L: int, k: int) -> int:
    """Heap slots a search needs for n keys, beam L, top-k: the beam, the top-k heap when L < k, the frontier."""
    return n + L + (k if L < k else 0)


def workspace(n: int, L: int, k: int, expanded: int = 0) -> tuple:
    """A fresh :class:`Workspace`, as a plain tuple, for searches of n keys, beam L, top-k, recording
    ``expanded`` nodes. The kernels unpack it by position; numba dispatches a plain tuple in C, a
    NamedTuple through Python (µs per call, the batch-1 latency)."""
    slots = heap_slots(n, L, k)
    return (np.zeros(n, np.int32), np.empty(slots, np.float32), np.empty(slots, np.int64), np.empty(expanded, np.int64),
            np.empty(n, np.float32))


_LOCAL = threading.local()
_NO_EXPANDED = np.empty(0, np.int64)


def thread_workspace(h: int, n: int, L: int, k: int = 0) -> tuple[Workspace, list[Workspace], int]:
    """This thread's workspace for h searches at once ((h, ≥n) visited, (h, ≥ heap_slots) heaps), its
    rows as :class:`Workspace` tuples, and a fresh epoch; grown when too small (with :data:`HEADROOM` to spare), kept
    between calls."""
    ws = getattr(_LOCAL, "ws", None)
    slots = heap_slots(n, L, k)
    if ws is None or ws[0][0].shape[0] < h or ws[0][0].shape[1] < n or ws[0][1].shape[1] < slots:
        old = ws[0] if ws else None
        hh = max(h, old[0].shape[0] if old else 0)
        # spare keys: a decoder's index grows by a key per step, and a workspace sized to the key exactly was made anew
        # (zeroed, its pages faulted in) on every step: ~0.5 ms of a 128K step's ~8
        nn = max(n + (n >> HEADROOM), old[0].shape[1] if old else 0)
        width = max(nn + slots - n, old[1].shape[1] if old else 0)
        full = (np.zeros((hh, nn), np.int32), np.empty((hh, width), np.float32), np.empty((hh, width), np.int64),
                _NO_EXPANDED, np.empty((hh, nn), np.float32))  # plain tuples: numba dispatches them in C, a NamedTuple through Python (µs per call)
        ws = [full, [(full[0][i], full[1][i], full[2][i], _NO_EXPANDED, full[4][i]) for i in range(hh)], 0]
        _LOCAL.ws = ws
    if ws[2] >= 2**31 - 2:
        ws[0][0][:] = 0
        ws[2] = 0
    ws[2] += 1
    return ws[0], ws[1], ws[2]


_POOL: list = [None, 0]  # the pool and the process that made it (a forked child must not use its parent's)
_POOL_LOCK = threading.Lock()  # two layers' searches may ask at once: one pool, not one each left idle


def run_chunks(kernel, args: tuple, n_items: int, n_threads: int) -> None:
    """Run ``kernel(*args, c, n_chunks)`` for every chunk c of ``n_items`` items over ``n_threads``.

    One chunk runs on the calling thread (no pool hand-off: it costs ms on a loaded machine);
    more run on a shared thread pool, which is parallel because every kernel is ``nogil``. Each
    kernel decides which items chunk c owns and writes only their slots, so results do not depend
    on the thread count. (Not numba's ``prange``: a parallel loop cannot capture the tuples the
    kernels take.)
    """
    n_chunks = max(1, min(n_items, n_threads))
    if n_chunks == 1:
        kernel(*args, 0, 1)
        return
    with _POOL_LOCK:
        pool, pid = _POOL
        if pool is None or pool._max_workers < n_chunks or pid != os.getpid():
            pool = ThreadPoolExecutor(n_chunks, thread_name_prefix="anns-lab-graph")
            _POOL[:] = [pool, os.getpid()]
    for f in [pool.submit(kernel, *args, c, n_chunks) for c in range(n_chunks)]:
        f.result()


@njit(cache=True, nogil=True, inline="always")
def append_new(row, m, v):
    """Append ``v`` to ``row[:m]`` unless it is there already; return the new length (a linear scan: rows are short)."""
    for t in range(m):
        if row[t] == v:
            return m
    row[m] = v
    return m + 1


@njit(cache=True, nogil=True, inline="always")
def mark_fresh(cands, visited, epoch, fresh):
    """Copy the nodes of ``cands`` not yet visited (``-1`` skipped) into ``fresh`` in order, marking them; return how many."""
    m = 0
    for v in cands:
        if v >= 0 and visited[v] != epoch:
            visited[v] = epoch
            fresh[m] = v
            m += 1
    return m


@njit(cache=True, nogil=True, inline="always")
def offer_all(rs, ri, cs, ci, nr, nc, fresh, fresh_s):
    """Offer the scored nodes ``fresh`` (scores ``fresh_s``), in order, to the beam (``rs``/``ri``, size nr,
    at most L = ``len(rs)``); each that enters it is pushed on the frontier (``cs``/``ci``, size nc). Returns (nr, nc)."""
    L = rs.shape[0]
    for j in range(fresh.shape[0]):
        s, v = fresh_s[j], fresh[j]
        if nr < L:
            nr = push_min(rs, ri, nr, s, v)
        elif s > rs[0]:
            sift_min(rs, ri, nr, s, v)
        else:
            continue
        nc = push_min(cs, ci, nc, -s, v)
    return nr, nc


@njit(cache=True, nogil=True, inline="always")
def pop_next(rs, cs, ci, nr, nc, L):
    """Pop the next node to expand: (node, nc), node -1 when the search is done (the frontier is empty, or its
    best is worse than the worst of a full beam: every node of the beam is expanded)."""
    if nc == 0 or (nr == L and -cs[0] < rs[0]):
        return -1, nc
    node = ci[0]
    nc -= 1
    sift_min(cs, ci, nc, cs[nc], ci[nc])
    return node, nc


KTH_BITS = 11  # kth_largest's histogram: the top 11 bits of a float32 made order-preserving (sign, exponent, 2 mantissa bits)


@njit(cache=True, nogil=True, inline="always")
def _f32_order(x):
    """The bits of float32 ``x`` as a uint32 ascending as x (-0.0 below +0.0; no NaN)."""
    b = np.uint32(np.float32(x).view(np.uint32))
    return (b ^ np.uint32(0xFFFFFFFF)) if b >> np.uint32(31) else (b | np.uint32(0x80000000))


@njit(cache=True, nogil=True)
def kth_scratch(n: int, k: int) -> tuple:
    """Scratch of :func:`kth_largest` for up to ``n`` values and rank ``k``: (histogram, zeroed; values; heap)."""
    return np.zeros(1 << KTH_BITS, np.int32), np.empty(n, np.float32), np.empty(k, np.float32), np.empty(k, np.int64)


@njit(cache=True, nogil=True)
def kth_largest(x, k, scratch):
    """The ``k``-th largest value of float32 ``x`` counted with repeats (1 ≤ k ≤ len(x); no NaN), as
    ``np.partition(x, len(x) - k)[len(x) - k]``. A histogram of the values' top KTH_BITS order-preserving bits finds
    the bin holding it; that bin's values alone go through a min-heap of the k' largest (``scratch`` from
    :func:`kth_scratch`; its histogram is zero again on return). numba's ``np.partition`` copies ``x`` twice and
    mispredicts every other compare: ~4x slower on the projection's ~2,000 candidates (BENCHMARKS "Scale", fourth pass)."""
    hist, vals, hs, hi = scratch
    shift = np.uint32(32 - KTH_BITS)
    top = 0
    for i in range(x.shape[0]):
        b = np.int64(_f32_order(x[i]) >> shift)
        hist[b] += 1
        top = max(top, b)
    above = 0
    b = top
    while above + hist[b] < k:
        above += hist[b]
        b -= 1
    c = 0
    for i in range(x.shape[0]):
        bi = np.int64(_f32_order(x[i]) >> shift)
        hist[bi] = 0
        if bi == b:
            vals[c] = x[i]
            c += 1
    want = k - above  # the want-th largest of the bin's c values
    n = 0
    for i in range(want):
        n = push_min(hs, hi, n, vals[i], i)
    for i in range(want, c):
        if vals[i] > hs[0]:
            sift_min(hs, hi, n, vals[i], i)
    return hs[0]


@njit(cache=True, nogil=True, inline="always")
def drain(hs, hi, n, out_ids, out_scores):
    """Pop the min-heap ``hs``/``hi`` of size n into ``out_ids``/``out_scores``: its k = ``len(out_ids)`` best,
    best first, padded with -1 / -inf."""
    k = out_ids.shape[0]
    for j in range(n, k):
        out_ids[j] = -1
        out_scores[j] = -np.inf
    while n > 0:  # worst first: the node popped when n nodes are left has rank n - 1
        n -= 1
        if n < k:
            out_ids[n] = hi[0]
            out_scores[n] = hs[0]
        if n > 0:
            sift_min(hs, hi, n, hs[n], hi[n])
