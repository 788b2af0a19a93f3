"""Numba kernels shared by every graph index: counted beam search, RobustPrune, the Vamana pass.

A graph is a fixed-width adjacency array ``nbrs`` (n, R) int32 with ``degree`` (n,) int32
(row i's neighbours are ``nbrs[i, :degree[i]]``). Similarity is always the inner product, so
beam search is maximum-inner-product search, and RobustPrune uses DiskANN's inner-product
occlusion rule.

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
def robust_prune(data, p, candidates, alpha, R, out):
    """RobustPrune with inner-product similarity: write at most R diverse neighbours of ``p`` into ``out``.

    Candidates are taken most similar to p first; each kept u removes every v with
    ip(u, v) − ip(p, v) > (α − 1)·|ip(p, v)|, i.e. v is more similar to u than to p by a
    margin. For ip(p, v) ≥ 0 this is DiskANN's INNER_PRODUCT rule ip(u, v) > α·ip(p, v) (and at
    α = 1 hnswlib's heuristic for space 'ip'); the |·| keeps "α > 1 prunes less" true for
    negative similarities. Returns how many were kept; duplicates and p itself are ignored.
    """
    cand = np.unique(candidates)
    m = 0
    for i in range(cand.shape[0]):  # drop p in place
        if cand[i] != p:
            cand[m] = cand[i]
            m += 1
    cand = cand[:m]
    sim_p = np.empty(m, np.float32)
    for i in range(m):
        sim_p[i] = dot(data[p], data[cand[i]])
    order = np.argsort(-sim_p, kind="mergesort")  # stable: ties resolved by id, deterministic
    alive = np.ones(m, np.bool_)
    kept = 0
    for oi in range(m):
        i = order[oi]
        if not alive[i]:
            continue
        u = cand[i]
        out[kept] = u
        kept += 1
        if kept == R:
            break
        for oj in range(oi + 1, m):
            j = order[oj]
            if alive[j] and dot(data[u], data[cand[j]]) - sim_p[j] > (alpha - 1.0) * abs(sim_p[j]):
                alive[j] = False
    return kept


@njit(cache=True, nogil=True)
def random_graph(n, R, seed):
    """A random graph with min(R, n-1) distinct out-neighbours per node (no self loops), seeded."""
    np.random.seed(seed)
    r = min(R, n - 1)
    nbrs = np.full((n, R), -1, np.int32)
    degree = np.full(n, r, np.int32)
    for i in range(n):
        filled = 0
        while filled < r:
            c = np.random.randint(0, n)
            if c == i:
                continue
            dup = False
            for t in range(filled):
                if nbrs[i, t] == c:
                    dup = True
                    break
            if not dup:
                nbrs[i, filled] = c
                filled += 1
    return nbrs, degree


@njit(cache=True, nogil=True)
def vamana_pass(data, nbrs, degree, order, entry, alpha, R, L):
    """One Vamana pass: for each p in ``order``, search for p from ``entry``, prune, add back-edges.

    Sequential, so a seeded build is deterministic. ``nbrs``/``degree`` are updated in place.
    """
    n = data.shape[0]
    visited = np.zeros(n, np.int32)
    expanded = np.empty(n, np.int64)
    entries = np.array([entry], np.int64)
    pruned = np.empty(R, np.int32)
    tmp = np.empty(R, np.int32)  # back-edge prunes write here, never into `pruned` (being iterated)
    cand = np.empty(n + R, np.int64)
    for step in range(order.shape[0]):
        p = order[step]
        _, _, _, _, n_exp = beam_search(data, nbrs, degree, data[p], entries, L, visited, step + 1, expanded)
        m = 0
        for i in range(n_exp):
            cand[m] = expanded[i]
            m += 1
        for j in range(degree[p]):
            cand[m] = nbrs[p, j]
            m += 1
        kept = robust_prune(data, p, cand[:m], alpha, R, pruned)
        nbrs[p, :kept] = pruned[:kept]
        degree[p] = kept
        for t in range(kept):
            j = pruned[t]
            present = False
            for u in range(degree[j]):
                if nbrs[j, u] == p:
                    present = True
                    break
            if present:
                continue
            if degree[j] < R:
                nbrs[j, degree[j]] = p
                degree[j] += 1
            else:
                back = np.empty(degree[j] + 1, np.int64)
                back[: degree[j]] = nbrs[j, : degree[j]]
                back[degree[j]] = p
                jkept = robust_prune(data, j, back, alpha, R, tmp)
                nbrs[j, :jkept] = tmp[:jkept]
                degree[j] = jkept
