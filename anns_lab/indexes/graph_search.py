"""Counted graph search: beam search (maximum inner product) and reachability.

A graph is a fixed-width adjacency array ``nbrs`` (n, R) int32 with ``degree`` (n,) int32
(row i's neighbours are ``nbrs[i, :degree[i]]``). Every inner product a search computes is
counted (``n_scanned``), entry points included.

Style as in pynndescent: ``@njit(cache=True, nogil=True)``, ``prange`` over independent
queries, the candidate list as parallel arrays, and an epoch-stamped visited array per thread
(so it is cleared by bumping an integer, not by an O(n) fill per query).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

@njit(cache=True, nogil=True, inline="always")
def dot(a: np.ndarray, b: np.ndarray) -> float:
    """Inner product of two float32 vectors (a plain loop: numba vectorises it, no BLAS call overhead)."""
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@njit(cache=True, nogil=True)
def _insert(ids, scores, done, size, cap, node, score):
    """Insert (node, score) into the descending candidate list; return (new size, insert position)."""
    pos = size
    while pos > 0 and scores[pos - 1] < score:
        pos -= 1
    if pos >= cap:
        return size, pos
    last = min(size, cap - 1)
    for i in range(last, pos, -1):  # shift the tail right by one, dropping the worst if full
        ids[i] = ids[i - 1]
        scores[i] = scores[i - 1]
        done[i] = done[i - 1]
    ids[pos] = node
    scores[pos] = score
    done[pos] = False
    return min(size + 1, cap), pos


@njit(cache=True, nogil=True)
def beam_search(data, nbrs, degree, query, entries, L, visited, epoch, expanded):
    """Best-first search keeping the L best candidates, until every one of them is expanded.

    Returns (ids, scores, size, n_scanned, n_expanded): the candidate list (descending, first
    ``size`` valid), the number of inner products computed (entries included), and how many
    expanded node ids were written into ``expanded`` (capacity permitting).
    """
    ids = np.empty(L, np.int64)
    scores = np.empty(L, np.float32)
    done = np.zeros(L, np.bool_)
    size = 0
    n_scanned = 0
    for e in entries:
        if visited[e] == epoch:
            continue
        visited[e] = epoch
        n_scanned += 1
        size, _ = _insert(ids, scores, done, size, L, e, dot(data[e], query))
    n_expanded = 0
    cur = 0  # every candidate before `cur` is expanded
    while cur < size:
        if done[cur]:
            cur += 1
            continue
        done[cur] = True
        node = ids[cur]
        if n_expanded < expanded.shape[0]:
            expanded[n_expanded] = node
        n_expanded += 1
        best = size
        for j in range(degree[node]):
            nb = nbrs[node, j]
            if visited[nb] == epoch:
                continue
            visited[nb] = epoch
            n_scanned += 1
            s = dot(data[nb], query)
            if size < L or s > scores[size - 1]:
                size, pos = _insert(ids, scores, done, size, L, nb, s)
                best = min(best, pos)
        cur = min(cur + 1, best)
    return ids, scores, size, n_scanned, min(n_expanded, expanded.shape[0])


@njit(cache=True, nogil=True, parallel=True)
def beam_search_batch(data, nbrs, degree, queries, entries, L, k, n_threads):
    """Beam search each query (row of ``entries`` = its entry nodes) on ``n_threads``; top-k, padded with -1/-inf.

    ``n_threads`` is passed in (``numba.get_num_threads()``) because reading it inside would stop caching.
    """
    nq = queries.shape[0]
    out_ids = np.full((nq, k), -1, np.int64)
    out_scores = np.full((nq, k), -np.inf, np.float32)
    n_scanned = np.zeros(nq, np.int64)
    n_chunks = max(1, min(nq, n_threads))
    no_expanded = np.empty(0, np.int64)
    for c in prange(n_chunks):
        visited = np.zeros(data.shape[0], np.int32)  # one per thread, reused through epochs
        lo = c * nq // n_chunks
        hi = (c + 1) * nq // n_chunks
        for qi in range(lo, hi):
            epoch = qi - lo + 1
            ids, scores, size, scanned, _ = beam_search(data, nbrs, degree, queries[qi], entries[qi], L, visited, epoch, no_expanded)
            m = min(size, k)
            out_ids[qi, :m] = ids[:m]
            out_scores[qi, :m] = scores[:m]
            n_scanned[qi] = scanned
    return out_ids, out_scores, n_scanned


@njit(cache=True, nogil=True)
def reachable_from(nbrs, degree, entries):
    """Boolean mask of the nodes reachable from ``entries`` (BFS)."""
    n = nbrs.shape[0]
    seen = np.zeros(n, np.bool_)
    queue = np.empty(n, np.int64)
    for e in entries:
        _mark_from(nbrs, degree, e, seen, queue)
    return seen


@njit(cache=True, nogil=True)
def _mark_from(nbrs, degree, start, seen, queue):
    """BFS from ``start`` over nodes not yet ``seen``, marking them."""
    head = 0
    tail = 0
    if not seen[start]:
        seen[start] = True
        queue[tail] = start
        tail += 1
    while head < tail:
        u = queue[head]
        head += 1
        for j in range(degree[u]):
            v = nbrs[u, j]
            if not seen[v]:
                seen[v] = True
                queue[tail] = v
                tail += 1


def search_graphs(indexes, queries: np.ndarray, k: int, L: int):
    """Search graph ``indexes[i]`` (exposing ``graph_arrays()`` and ``entries_for(q)``) with ``queries[i]``.

    Returns a ``SearchResult`` of ids (H, k), scores (H, k), n_scanned (H,).
    """
    from anns_lab.indexes.base import SearchResult

    q = np.ascontiguousarray(queries, dtype=np.float32)
    out = [beam_search_batch(*index.graph_arrays(), q[i: i + 1], index.entries_for(q[i: i + 1]), max(L, k), k, 1)
           for i, index in enumerate(indexes)]
    return SearchResult(*(np.concatenate(column) for column in zip(*out)))
