"""NGFix's and RFix's graph repairs (numba): escape hardness, the defect-fixing edges, the reachability edges.

A graph here is the lab's fixed-width adjacency (:class:`anns_lab.indexes.graph.Graph`) whose row ``u`` holds first
the ``nfix[u]`` repair edges, newest first (their escape hardness in ``eh[u]``), then the base graph's links. The
repairs of one training query change the graph the next one is judged on, so the queries are taken one after the
other, in order (the reference code runs them on threads under per-node locks, in no fixed order): a build is
deterministic.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from anns_lab.indexes.graph.search import search_one
from anns_lab.indexes.graph.simd import dot

EH_INF = 65535  # escape hardness of a pair that no path within the query's top-S keys joins
RFIX_EH = 201  # a reachability edge's hardness: above any finite one (lists of ≤ 100 keys judged within 200), MAX_S + 1
RFIX_OUT = 6  # reachability edges per stuck node at most, after the occlusion rule (the reference's)
RFIX_NQ = 10  # RFix's beam from the entry point, and the rank its result must reach (the reference's)
ONE = np.uint64(1)


@njit(cache=True, nogil=True, inline="always")
def _has(f, i, j):
    return (f[i, j >> 6] >> np.uint64(j & 63)) & ONE


@njit(cache=True, nogil=True, inline="always")
def _set(f, i, j):
    f[i, j >> 6] |= ONE << np.uint64(j & 63)


@njit(cache=True, nogil=True)
def escape_hardness(nbrs, degree, gt, nq, s, rank_of, f, H):
    """``H[i, j]`` (i, j < nq) = the least h such that a path from the query's i-th key to its j-th runs through keys
    of rank ≤ h only, inside its top ``s`` keys ``gt[:s]`` (max(i, j) for an edge, EH_INF when none): the rank-ordered
    Floyd–Warshall closure on bitsets ``f`` ((≥ s, ≥ ⌈s/64⌉) uint64, cleared here). ``rank_of`` (n,) is -1
    everywhere and left so."""
    W = (s + 63) >> 6
    for i in range(s):
        rank_of[gt[i]] = i
        for w in range(W):
            f[i, w] = 0
    for i in range(nq):
        for j in range(nq):
            H[i, j] = EH_INF
    for i in range(s):
        _set(f, i, i)
        if i < nq:
            H[i, i] = i
        u = gt[i]
        for t in range(degree[u]):
            j = rank_of[nbrs[u, t]]
            if j >= 0:
                _set(f, i, j)
                if i < nq and j < nq and max(i, j) < H[i, j]:
                    H[i, j] = max(i, j)
    for h in range(s):  # intermediates in rank order: a pair first joined through h has hardness max(i, j, h)
        for i in range(s):
            if not _has(f, i, h):
                continue
            for w in range(W):
                new = f[h, w] & ~f[i, w]
                if new == 0:
                    continue
                f[i, w] |= new
                if i < nq:
                    for b in range(64):
                        j = w * 64 + b
                        if j >= nq:
                            break
                        if (new >> np.uint64(b)) & ONE:
                            H[i, j] = max(max(i, j), h)
    for i in range(s):
        rank_of[gt[i]] = -1


@njit(cache=True, nogil=True)
def add_fix_edge(nbrs, degree, nfix, eh, u, v, e):
    """Add the repair edge u → v of hardness ``e`` at the front of u's row (the newest repair first, then the older
    ones, then the base links, as the reference lays a row out); when u's ``eh.shape[1]`` repair slots are full it
    takes the slot of the easiest repair (the first in row order among equals) if ``e`` is at least as hard, else it is
    dropped (the reference's rule). An edge u already has is not added twice. Returns 1 if the edge was placed."""
    for t in range(degree[u]):
        if nbrs[u, t] == v:
            return 0
    mex = eh.shape[1]
    if nfix[u] == mex:
        low = 0
        for t in range(1, mex):
            if eh[u, t] < eh[u, low]:
                low = t
        if e < eh[u, low]:
            return 0
        nbrs[u, low] = v
        eh[u, low] = e
        return 1
    for t in range(degree[u], 0, -1):
        nbrs[u, t] = nbrs[u, t - 1]
    for t in range(nfix[u], 0, -1):
        eh[u, t] = eh[u, t - 1]
    nbrs[u, 0] = v
    eh[u, 0] = e
    nfix[u] += 1
    degree[u] += 1
    return 1


@njit(cache=True, nogil=True)
def ngfix(keys, nbrs, degree, nfix, eh, gt, nq, s, rank_of, f, H):
    """NGFix for one query of top keys ``gt`` (best first): every pair of its first ``nq`` keys whose escape hardness
    exceeds ``nq`` (within its top ``s``), closest pairs first (key · key), gets an edge unless the edges added before
    already join it; returns the edges placed (a full row drops an edge easier than all it holds)."""
    escape_hardness(nbrs, degree, gt, nq, s, rank_of, f, H)
    W = (nq + 63) >> 6
    g = np.zeros((nq, W), np.uint64)  # joined: hardness ≤ nq
    npairs = 0
    for i in range(nq):
        for j in range(nq):
            if H[i, j] <= nq:
                _set(g, i, j)
            else:
                npairs += 1
    if npairs == 0:
        return 0
    src = np.empty(npairs, np.int64)
    dst = np.empty(npairs, np.int64)
    sim = np.empty(npairs, np.float32)
    p = 0
    for i in range(nq):
        for j in range(nq):
            if H[i, j] > nq:
                src[p] = i
                dst[p] = j
                sim[p] = dot(keys[gt[i]], keys[gt[j]])
                p += 1
    added = 0
    for p in np.argsort(-sim, kind="mergesort"):  # stable: equal similarities in (i, j) order, as the reference sorts
        a, b = src[p], dst[p]
        if _has(g, a, b):
            continue
        added += add_fix_edge(nbrs, degree, nfix, eh, gt[a], gt[b], H[a, b])
        _set(g, a, b)
        for i in range(nq):  # whatever reached a now reaches what b reaches
            if _has(g, i, a):
                for w in range(W):
                    g[i, w] |= g[b, w]
    return added


@njit(cache=True, nogil=True)
def rfix(keys, nbrs, degree, nfix, eh, query, gt, nq, entry, ef, ws, epoch):
    """RFix for one query: when a search of beam ``nq`` from ``entry`` ends at a key u worse than the query's
    ``nq``-th (it never reached the query's neighbourhood), the keys better than u among the best ``ef`` that a
    search of beam ``ef`` from u scans, nearest to u first and thinned by the occlusion rule to at most
    :data:`RFIX_OUT`, get edges from u. Returns (edges placed, the epoch after the searches)."""
    g = (keys, nbrs, degree)
    stop = (0, 0.0, 0)
    one_id = np.empty(1, np.int64)
    one_s = np.empty(1, np.float32)
    entries = np.empty(1, np.int64)
    entries[0] = entry
    epoch += 1
    search_one(g, query, entries, nq, ws, epoch, one_id, one_s, stop)
    u = one_id[0]
    if u < 0 or one_s[0] >= dot(keys[gt[nq - 1]], query):
        return 0, epoch
    ids = np.empty(ef, np.int64)
    sc = np.empty(ef, np.float32)
    entries[0] = u
    epoch += 1
    search_one(g, query, entries, ef, ws, epoch, ids, sc, stop)
    m = 0
    for t in range(ef):
        if ids[t] >= 0 and ids[t] != u and sc[t] > one_s[0]:
            ids[m] = ids[t]
            m += 1
    near = np.empty(m, np.float32)
    for t in range(m):
        near[t] = dot(keys[u], keys[ids[t]])
    order = np.argsort(-near, kind="mergesort")
    kept = np.empty(RFIX_OUT, np.int64)
    nk = 0
    for t in order:
        if nk == RFIX_OUT:
            break
        c = ids[t]
        ok = True
        if m >= RFIX_OUT:  # the reference keeps every candidate when there are fewer than the cap
            for r in range(nk):
                if dot(keys[kept[r]], keys[c]) > near[t]:  # c is nearer a kept key than u: occluded
                    ok = False
                    break
        if ok:
            kept[nk] = c
            nk += 1
    placed = 0
    for r in range(nk):
        placed += add_fix_edge(nbrs, degree, nfix, eh, u, kept[r], RFIX_EH)
    return placed, epoch


@njit(cache=True, nogil=True)
def fix_graph(keys, nbrs, degree, nfix, eh, queries, gt, fixes, entry, rfix_ef, rfix_nq, ws):
    """Repair the graph with each training query in turn (its top keys ``gt``, best first): NGFix with each list
    length of ``fixes`` (on its top 2 × that many keys), then RFix (``rfix_ef`` 0: none). Returns the edges placed by
    NGFix and by RFix (one that takes a full row's easiest slot counts too)."""
    n = keys.shape[0]
    rank_of = np.full(n, -1, np.int64)
    s_max = min(2 * fixes.max(), gt.shape[1])
    f = np.zeros((s_max, (s_max + 63) >> 6), np.uint64)
    H = np.empty((s_max, s_max), np.int64)
    epoch = 0
    n_ng = n_rf = 0
    for r in range(queries.shape[0]):
        for nq in fixes:
            s = min(2 * nq, gt.shape[1])
            n_ng += ngfix(keys, nbrs, degree, nfix, eh, gt[r], min(nq, s), s, rank_of, f, H)
        if rfix_ef > 0:
            nq = min(rfix_nq, gt.shape[1])
            added, epoch = rfix(keys, nbrs, degree, nfix, eh, queries[r], gt[r], nq, entry, rfix_ef, ws, epoch)
            n_rf += added
    return n_ng, n_rf
