"""The best-first search of every graph index, at query time and inside the builds.

Keep the ``L`` best nodes scanned (the beam), expand the best unexpanded one, until every node of
the beam is expanded (hnswlib's two-heap search: it stops when the frontier's best is worse than
the worst of a full beam). With L < k a third heap keeps the k best of every node scanned, so a
narrow beam still returns k keys (on a query-aware graph the rest of a query's top keys are
neighbours of the best L); what is expanded, and when the search stops, does not change.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph.simd import dot
from anns_lab.indexes.graph.utils import (drain, mark_fresh, offer_all, pop_next, push_min, run_chunks,
                                          sift_min, thread_workspace)


@njit(cache=True, nogil=True, inline="always")
def score_fresh(data, query, fresh, m, fresh_s):
    """``fresh_s[j]`` = ip(query, data[fresh[j]]) for j < m, with no branch between the inner products,
    so that their key rows load in parallel (the search is memory-bound)."""
    for j in range(m):
        fresh_s[j] = dot(data[fresh[j]], query)


@njit(cache=True, nogil=True)
def search_one(g, query, entries, L, ws, epoch, out_ids, out_scores):
    """Best-first search of ``g`` (:class:`Graph`) for one query from ``entries`` with beam L; writes the
    top-k (k = ``len(out_ids)``, padded with -1 / -inf) and returns (n_scanned, n_words, nodes expanded).

    The entry points are scored and offered first, in order (``-1`` and repeats skipped); every inner
    product is counted once, entry points included, and so is every adjacency word read (``n_words``:
    an expanded node's degree and its neighbour ids). ``ws`` is a :class:`Workspace` (visited stamped
    with ``epoch``; the expanded nodes go to ``ws.expanded`` as far as it has room). Both tuples are
    unpacked by position: callers pass plain tuples (numba dispatches those in C, a NamedTuple in Python).
    """
    data, nbrs, degree = g
    visited, heap_s, heap_i, expanded = ws
    k = out_ids.shape[0]
    kt = k if L < k else 0
    # The workspace split (sliced here: a helper returning these views in a tuple hides from numba's dead-code
    # elimination that they alias heap_s, and it drops stores into them that nothing reads later on).
    rs = heap_s[:L]  # the beam
    ri = heap_i[:L]
    ts = heap_s[L:L + kt]  # the top-k heap (none when L ≥ k)
    ti = heap_i[L:L + kt]
    cs = heap_s[L + kt:]  # the frontier: each node is pushed on it at most once
    ci = heap_i[L + kt:]
    fresh = np.empty(max(nbrs.shape[1], entries.shape[0]), np.int64)  # the unvisited nodes of one step
    fresh_s = np.empty(fresh.shape[0], np.float32)
    m = mark_fresh(entries, visited, epoch, fresh)  # the entry points: scored and offered as an expanded row's
    n_scanned = m
    n_words = n_exp = nr = nt = nc = 0
    while True:
        score_fresh(data, query, fresh, m, fresh_s)
        if kt > 0:  # written out: as an inline helper of its own this cost ~16 ns more per node (numba 0.68)
            for j in range(m):
                if nt < kt:
                    nt = push_min(ts, ti, nt, fresh_s[j], fresh[j])
                elif fresh_s[j] > ts[0]:
                    sift_min(ts, ti, nt, fresh_s[j], fresh[j])
        nr, nc = offer_all(rs, ri, cs, ci, nr, nc, fresh[:m], fresh_s[:m])
        node, nc = pop_next(rs, cs, ci, nr, nc, L)
        if node < 0:
            break
        if n_exp < expanded.shape[0]:
            expanded[n_exp] = node
        n_exp += 1
        m = mark_fresh(nbrs[node, :degree[node]], visited, epoch, fresh)
        n_scanned += m
        n_words += 1 + degree[node]
    if kt > 0:
        drain(ts, ti, nt, out_ids, out_scores)
    elif k > 0:
        drain(rs, ri, nr, out_ids, out_scores)
    return n_scanned, n_words, min(n_exp, expanded.shape[0])


def search_single(g: Graph, query: np.ndarray, entries: np.ndarray, L: int, k: int):
    """One query on the calling thread (batch 1, the decoding case) with this thread's workspace:
    (ids (1, k), scores (1, k), n_scanned (1,), n_words (1,))."""
    g = tuple(g)  # a plain tuple: see utils.workspace
    _, rows, epoch = thread_workspace(1, g[0].shape[0], L, k)
    ids = np.empty((1, k), np.int64)
    scores = np.empty((1, k), np.float32)
    n, w, _ = search_one(g, query, entries, L, rows[0], epoch, ids[0], scores[0])
    return ids, scores, np.array([n], np.int64), np.array([w], np.int64)


@njit(cache=True, nogil=True)
def _batch_chunk(g, queries, entries, L, out, c, n_chunks):
    """Queries [c·nq/n_chunks, (c+1)·nq/n_chunks) of :func:`search_batch`, on one workspace."""
    out_ids, out_scores, n_scanned, n_words = out
    nq = queries.shape[0]
    slots = g[0].shape[0] + L + (out_ids.shape[1] if L < out_ids.shape[1] else 0)  # heap_slots
    ws = (np.zeros(g[0].shape[0], np.int32), np.empty(slots, np.float32), np.empty(slots, np.int64), np.empty(0, np.int64))
    lo = c * nq // n_chunks
    for qi in range(lo, (c + 1) * nq // n_chunks):
        n, w, _ = search_one(g, queries[qi], entries[qi], L, ws, qi - lo + 1, out_ids[qi], out_scores[qi])
        n_scanned[qi] = n
        n_words[qi] = w


def search_batch(g: Graph, queries: np.ndarray, entries: np.ndarray, L: int, k: int, n_threads: int):
    """Search each query (row of ``entries`` = its entry nodes, ``-1`` = none) on ``n_threads``:
    (ids (nq, k), scores (nq, k), n_scanned (nq,), n_words (nq,)), padded with -1 / -inf."""
    nq = queries.shape[0]
    out = (np.full((nq, k), -1, np.int64), np.full((nq, k), -np.inf, np.float32), np.zeros(nq, np.int64),
           np.zeros(nq, np.int64))
    run_chunks(_batch_chunk, (tuple(g), queries, entries, L, out), nq, n_threads)
    return out



def bytes_read(dim: int, n_scanned, n_words, n_entries: int) -> np.ndarray:
    """Bytes of index data per query of a graph search: each scanned key (float32, ``dim``), each adjacency
    word read (int32: an expanded node's degree and neighbour ids) and the entry-point list (int64 ids)."""
    return 4 * dim * np.asarray(n_scanned, np.int64) + 4 * np.asarray(n_words, np.int64) + 8 * n_entries
