"""The best-first search of every graph index, at query time and inside the builds.

Keep the ``L`` best nodes scanned (the beam), expand the best unexpanded one, until every node of
the beam is expanded (hnswlib's two-heap search: it stops when the frontier's best is worse than
the worst of a full beam). With L < k a third heap keeps the k best of every node scanned, so a
narrow beam still returns k keys (on a query-aware graph the rest of a query's top keys are
neighbours of the best L); what is expanded, and when the search stops, does not change.

**Row stop** (``stop`` = (C, ρ, A); C = 0: every row in full, the builds' search): an expansion walks the
node's row in order (roargraph stores rows by co-occurrence in the training lists, most first) and stops
once its misses reach C + ρ·hits. A neighbour is a hit when it enters the beam, or was scanned before and
is in the beam now; a miss otherwise (a fresh one that does not enter, or an earlier one outside the beam).
At recall 0.95 most inner products go to out-of-region neighbours of the region's keys; a row whose first
neighbours fall outside the beam leads out of the query's region, one whose first neighbours are in it
still has region keys further down. The walk runs in stages of as many positions as could still stop it
(``row_need``): the fresh nodes of a stage are scored together, as a full row's are. Where it stops, the
rest of the row's keys with ids ≥ A (added after the build: their edges sit at the rows' ends, out of the
build's order) are still scanned; A = the number of keys when none was added.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph.simd import dot
from anns_lab.indexes.graph.utils import (drain, mark_fresh, offer_all, pop_next, push_min, run_chunks,
                                          sift_min, thread_workspace)

FULL_ROWS = (0, 0.0, 0)  # the row stop (C, ρ, A) that scans every row in full


@njit(cache=True, nogil=True, inline="always")
def score_fresh(data, query, fresh, m, fresh_s):
    """``fresh_s[j]`` = ip(query, data[fresh[j]]) for j < m, with no branch between the inner products,
    so that their key rows load in parallel (the search is memory-bound)."""
    for j in range(m):
        fresh_s[j] = dot(data[fresh[j]], query)


@njit(cache=True, nogil=True, inline="always")
def row_need(stop, hits, misses):
    """How many more misses stop an expansion's row walk: ⌈C + ρ·hits − misses⌉ for ``stop`` = (C, ρ, A);
    C = 0: none ever does (a number larger than any row)."""
    c, rho, _ = stop
    if c <= 0:
        return 1 << 30
    return int(np.ceil(c + rho * hits - misses))


@njit(cache=True, nogil=True, inline="always")
def walk_row(row, pos, need, visited, epoch, memo, worst, fresh):
    """One stage of a row walk from position ``pos``: the unvisited nodes go to ``fresh`` (marked) until they and
    the misses met on the way number ``need``; a node scanned before is a hit when its score (``memo``) is at
    least ``worst`` (the beam's worst; -inf while the beam is not full), a miss otherwise; one marked earlier in
    the same stage is a hit. Returns (fresh nodes, next position, hits, misses) of the nodes scanned before."""
    m = hits = misses = 0
    while pos < row.shape[0] and m + misses < need:
        v = row[pos]
        pos += 1
        if v < 0:
            continue
        if visited[v] != epoch:
            visited[v] = epoch
            memo[v] = np.inf  # scored after the stage: a repeat within it counts as a hit, whatever the last query left here
            fresh[m] = v
            m += 1
        elif memo[v] >= worst:
            hits += 1
        else:
            misses += 1
    return m, pos, hits, misses


@njit(cache=True, nogil=True, inline="always")
def mark_added(row, first, visited, epoch, fresh):
    """:func:`utils.mark_fresh` of the nodes of ``row`` with ids ≥ ``first`` only (the keys added after the build)."""
    m = 0
    for v in row:
        if v >= first and visited[v] != epoch:
            visited[v] = epoch
            fresh[m] = v
            m += 1
    return m


@njit(cache=True, nogil=True)
def search_one(g, query, entries, L, ws, epoch, out_ids, out_scores, stop):
    """Best-first search of ``g`` (:class:`Graph`) for one query from ``entries`` with beam L and row stop ``stop``
    (= (C, ρ, A), see the module docstring; :data:`FULL_ROWS` scans every row); writes the top-k (k =
    ``len(out_ids)``, padded with -1 / -inf) and returns (n_scanned, n_words, nodes expanded).

    The entry points are scored and offered first, in order (``-1`` and repeats skipped); every inner
    product is counted once, entry points included, and so is every adjacency word read (``n_words``:
    an expanded node's degree and the neighbour ids its walk read). ``ws`` is a :class:`Workspace` (visited
    stamped with ``epoch``; the expanded nodes go to ``ws.expanded`` as far as it has room; ``ws.memo`` holds
    the scores for the row stop, unused with C = 0). Both tuples are unpacked by position: callers pass plain
    tuples (numba dispatches those in C, a NamedTuple in Python).
    """
    data, nbrs, degree = g
    visited, heap_s, heap_i, expanded, memo = ws
    full = stop[0] <= 0
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
    node = -1  # the node being expanded, its row position, and its walk's hits and misses
    pos = deg = hits = misses = 0
    while True:
        score_fresh(data, query, fresh, m, fresh_s)
        if not full:
            for j in range(m):
                memo[fresh[j]] = fresh_s[j]
        if kt > 0:  # written out: as an inline helper of its own this cost ~16 ns more per node (numba 0.68)
            for j in range(m):
                if nt < kt:
                    nt = push_min(ts, ti, nt, fresh_s[j], fresh[j])
                elif fresh_s[j] > ts[0]:
                    sift_min(ts, ti, nt, fresh_s[j], fresh[j])
        entered = nc
        nr, nc = offer_all(rs, ri, cs, ci, nr, nc, fresh[:m], fresh_s[:m])
        hits += nc - entered  # a node enters the frontier exactly when it enters the beam
        misses += m - (nc - entered)
        need = row_need(stop, hits, misses) if node >= 0 and pos < deg else 0
        if need <= 0 and node >= 0 and pos < deg and stop[2] < data.shape[0]:  # stopped: the rest's added keys
            m = mark_added(nbrs[node, pos:deg], stop[2], visited, epoch, fresh)
            n_words += deg - pos
            pos = deg
            n_scanned += m
            continue
        if need <= 0:
            node, nc = pop_next(rs, cs, ci, nr, nc, L)
            if node < 0:
                break
            if n_exp < expanded.shape[0]:
                expanded[n_exp] = node
            n_exp += 1
            deg = degree[node]
            pos = hits = misses = 0
            n_words += 1
            need = row_need(stop, 0, 0)
        if full:
            m = mark_fresh(nbrs[node, :deg], visited, epoch, fresh)
            n_words += deg
            pos = deg
        else:
            worst = rs[0] if nr == L else -np.inf
            m, at, h, x = walk_row(nbrs[node, :deg], pos, need, visited, epoch, memo, worst, fresh)
            n_words += at - pos
            pos, hits, misses = at, hits + h, misses + x
        n_scanned += m
    if kt > 0:
        drain(ts, ti, nt, out_ids, out_scores)
    elif k > 0:
        drain(rs, ri, nr, out_ids, out_scores)
    return n_scanned, n_words, min(n_exp, expanded.shape[0])


def typed_stop(stop: tuple) -> tuple:
    """A row stop (C, ρ, A) as the kernels take it (int, float, int: one compiled signature)."""
    return int(stop[0]), float(stop[1]), int(stop[2])


def search_single(g: Graph, query: np.ndarray, entries: np.ndarray, L: int, k: int, stop: tuple = FULL_ROWS):
    """One query on the calling thread (batch 1, the decoding case) with this thread's workspace, row stop
    ``stop`` = (C, ρ, A): (ids (1, k), scores (1, k), n_scanned (1,), n_words (1,))."""
    g = tuple(g)  # a plain tuple: see utils.workspace
    _, rows, epoch = thread_workspace(1, g[0].shape[0], L, k)
    ids = np.empty((1, k), np.int64)
    scores = np.empty((1, k), np.float32)
    n, w, _ = search_one(g, query, entries, L, rows[0], epoch, ids[0], scores[0], typed_stop(stop))
    return ids, scores, np.array([n], np.int64), np.array([w], np.int64)


@njit(cache=True, nogil=True)
def _batch_chunk(g, queries, entries, L, stop, out, c, n_chunks):
    """Queries [c·nq/n_chunks, (c+1)·nq/n_chunks) of :func:`search_batch`, on one workspace."""
    out_ids, out_scores, n_scanned, n_words = out
    nq = queries.shape[0]
    slots = g[0].shape[0] + L + (out_ids.shape[1] if L < out_ids.shape[1] else 0)  # heap_slots
    memo = np.empty(g[0].shape[0] if stop[0] > 0 else 0, np.float32)
    ws = (np.zeros(g[0].shape[0], np.int32), np.empty(slots, np.float32), np.empty(slots, np.int64), np.empty(0, np.int64), memo)
    lo = c * nq // n_chunks
    for qi in range(lo, (c + 1) * nq // n_chunks):
        n, w, _ = search_one(g, queries[qi], entries[qi], L, ws, qi - lo + 1, out_ids[qi], out_scores[qi], stop)
        n_scanned[qi] = n
        n_words[qi] = w


def search_batch(g: Graph, queries: np.ndarray, entries: np.ndarray, L: int, k: int, n_threads: int,
                 stop: tuple = FULL_ROWS):
    """Search each query (row of ``entries`` = its entry nodes, ``-1`` = none) on ``n_threads``, row stop ``stop``
    = (C, ρ, A): (ids (nq, k), scores (nq, k), n_scanned (nq,), n_words (nq,)), padded with -1 / -inf."""
    nq = queries.shape[0]
    out = (np.full((nq, k), -1, np.int64), np.full((nq, k), -np.inf, np.float32), np.zeros(nq, np.int64),
           np.zeros(nq, np.int64))
    run_chunks(_batch_chunk, (tuple(g), queries, entries, L, typed_stop(stop), out), nq, n_threads)
    return out


def bytes_read(dim: int, n_scanned, n_words, n_entries: int) -> np.ndarray:
    """Bytes of index data per query of a graph search: each scanned key (float32, ``dim``), each adjacency
    word read (int32: an expanded node's degree and neighbour ids) and the entry-point list (int64 ids)."""
    return 4 * dim * np.asarray(n_scanned, np.int64) + 4 * np.asarray(n_words, np.int64) + 8 * n_entries
