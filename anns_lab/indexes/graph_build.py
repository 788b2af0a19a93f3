"""Numba graph construction shared by the graph indexes: RobustPrune, the Vamana pass,
RobustStitch, and the query-aware projection and connectivity passes of roargraph.

Similarity is always the inner product, so RobustPrune uses DiskANN's inner-product occlusion
rule. Graph layout and search are in :mod:`anns_lab.indexes.graph_search`.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from anns_lab.indexes.graph_search import _mark_from, beam_search, dot, reachable_from


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
    _vamana_pass(data, nbrs, degree, order, entry, alpha, R, L, data.shape[0])


@njit(cache=True, nogil=True)
def vamana_pass_fixed(data, nbrs, degree, order, entry, alpha, R, L, n_free):
    """:func:`vamana_pass` where rows ≥ ``n_free`` are fixed (OOD-DiskANN's query nodes): such a p
    keeps its preset row unpruned and only proposes back-edges to its neighbours; no back-edge
    is ever written into a fixed row."""
    _vamana_pass(data, nbrs, degree, order, entry, alpha, R, L, n_free)


@njit(cache=True, nogil=True)
def _vamana_pass(data, nbrs, degree, order, entry, alpha, R, L, n_free):
    n = data.shape[0]
    visited = np.zeros(n, np.int32)
    expanded = np.empty(n, np.int64)
    entries = np.array([entry], np.int64)
    pruned = np.empty(R, np.int32)
    tmp = np.empty(R, np.int32)  # back-edge prunes write here, never into `pruned` (being iterated)
    cand = np.empty(n + R, np.int64)
    for step in range(order.shape[0]):
        p = order[step]
        if p < n_free:
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
        else:
            kept = degree[p]
            pruned[:kept] = nbrs[p, :kept]
        for t in range(kept):
            j = pruned[t]
            if j >= n_free:
                continue
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


@njit(cache=True, nogil=True, parallel=True)
def robust_stitch(data, nbrs, degree, n_keys, q_nbrs, alpha, R):
    """OOD-DiskANN's RobustStitch: in each key row, every query node (id ≥ ``n_keys``) is replaced
    by that query's keys (``q_nbrs[id - n_keys]``), then the row is RobustPruned to R over keys
    only. Returns the keys-only graph (n_keys rows). Parallel over rows (each owns its row)."""
    out_nbrs = np.full((n_keys, R), -1, np.int32)
    out_deg = np.zeros(n_keys, np.int32)
    for p in prange(n_keys):
        cand = np.empty(degree[p] * (1 + q_nbrs.shape[1]), np.int64)
        m = 0
        has_query = False
        for j in range(degree[p]):
            v = nbrs[p, j]
            if v < n_keys:
                cand[m] = v
                m += 1
            else:
                has_query = True
                for t in range(q_nbrs.shape[1]):
                    cand[m] = q_nbrs[v - n_keys, t]
                    m += 1
        row = np.empty(R, np.int32)
        if has_query:
            kept = robust_prune(data, p, cand[:m], alpha, R, row)
        else:
            kept = m
            for i in range(m):
                row[i] = cand[i]
        out_nbrs[p, :kept] = row[:kept]
        out_deg[p] = kept
    return out_nbrs, out_deg


# -- query-aware construction (roargraph, robust-vamana) ------------------------------------------
#
# Lock-free two-phase updates in the pynndescent manner: a parallel phase writes only into
# per-item slots whose positions were fixed beforehand by a cheap sequential counting pass
# (CSR offsets), then a second parallel phase owns one graph row per iteration. No thread ever
# writes a row another thread may read in the same phase, so no locks and a seeded build is
# deterministic whatever the thread count.


@njit(cache=True, nogil=True)
def robust_prune_ordered(data, p, cand, sim_p, alpha, R, out, start):
    """RobustPrune over candidates already in priority order (``sim_p[i]`` = ip(p, cand[i])).

    Same occlusion rule as :func:`robust_prune`, but the visiting order is the caller's (e.g.
    co-occurrence in query top-k lists) and the first ``start`` entries of ``out`` are kept
    neighbours that already occlude. Returns the new number kept (≤ R).
    """
    m = cand.shape[0]
    kept = start
    for i in range(m):
        if kept >= R:
            break
        u = cand[i]
        if u == p:
            continue
        ok = True
        for t in range(kept):
            w = out[t]
            if w == u:
                ok = False
                break
            if dot(data[w], data[u]) - sim_p[i] > (alpha - 1.0) * abs(sim_p[i]):
                ok = False
                break
        if ok:
            out[kept] = u
            kept += 1
    return kept


@njit(cache=True, nogil=True)
def _csr_offsets(counts):
    ptr = np.zeros(counts.shape[0] + 1, np.int64)
    for i in range(counts.shape[0]):
        ptr[i + 1] = ptr[i] + counts[i]
    return ptr


@njit(cache=True, nogil=True)
def key_occurrences(knn, n, max_rank):
    """CSR over keys of the bipartite graph's reverse side: for key p, the (query, rank) pairs
    with knn[query, rank] == p and rank < ``max_rank``, sorted by rank, newest query first."""
    m = knn.shape[0]
    P = min(max_rank, knn.shape[1])
    counts = np.zeros(n, np.int64)
    for q in range(m):
        for r in range(P):
            counts[knn[q, r]] += 1
    ptr = _csr_offsets(counts)
    fill = ptr[:-1].copy()
    occ_q = np.empty(ptr[n], np.int32)
    occ_r = np.empty(ptr[n], np.int32)
    for r in range(P):  # rank-major, newest query first: each key's slice comes out sorted
        for q in range(m - 1, -1, -1):
            p = knn[q, r]
            occ_q[fill[p]] = q
            occ_r[fill[p]] = r
            fill[p] += 1
    return ptr, occ_q, occ_r


def project_rows(data, knn, weights, ptr, occ_q, occ_r, n_pivots, n_sel, n_cand, max_cand, alpha, M, nbrs, degree,
                 n_threads=1, key_weight=None, rows=None):
    """Projection of the bipartite graph onto keys, one row per key p (rows split over ``n_threads`` chunks).

    p is a pivot for the queries where it ranks below ``n_pivots`` (its occurrence slice from
    ``key_occurrences`` is sorted by rank); it takes the first ``n_sel`` of them (best rank first) and
    their first ``n_cand`` keys as candidates, merges them by id with summed query weights
    (times ``key_weight[v]`` when given), keeps the ``max_cand`` heaviest (ties: larger ip with p) and RobustPrunes them in that
    order to ``M`` (``alpha`` = 0: no pruning, just the heaviest M). Rows of keys that are
    nobody's pivot stay empty (roargraph's ``link_tail`` and reachability passes link them).

    The merge uses a dense per-thread accumulator (O(candidates), no sort of the raw list) and
    computes ip(p, ·) only for the candidates heavy enough to be kept: this pass was a third
    of the build.

    ``rows`` (int64), when given, restricts the pass to those keys (``add``: the new keys only);
    every other row is left as it is.
    """
    rows = np.arange(data.shape[0], dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    n_chunks = max(1, min(len(rows), n_threads))
    args = (data, knn, weights, ptr, occ_q, occ_r, rows, n_pivots, n_sel, n_cand, max_cand, alpha, M, nbrs, degree,
            key_weight)
    if n_chunks == 1:
        _project_chunk(*args, 0, 1)  # on the calling thread: no thread-pool launch (ms on a loaded machine)
    else:
        _project_par(*args, n_chunks)


@njit(cache=True, nogil=True, parallel=True)
def _project_par(data, knn, weights, ptr, occ_q, occ_r, rows, n_pivots, n_sel, n_cand, max_cand, alpha, M, nbrs, degree,
                 key_weight, n_chunks):
    for c in prange(n_chunks):
        _project_chunk(data, knn, weights, ptr, occ_q, occ_r, rows, n_pivots, n_sel, n_cand, max_cand, alpha, M, nbrs,
                       degree, key_weight, c, n_chunks)


@njit(cache=True, nogil=True)
def _project_chunk(data, knn, weights, ptr, occ_q, occ_r, rows, n_pivots, n_sel, n_cand, max_cand, alpha, M, nbrs,
                   degree, key_weight, c, n_chunks):
    """Rows ``rows[c::n_chunks]`` of :func:`project_rows` (interleaved: heavy rows, the sinks, spread over chunks)."""
    n, nr = data.shape[0], rows.shape[0]
    C = min(n_cand, knn.shape[1])
    acc = np.zeros(n, np.float32)
    stamp = np.full(n, -1, np.int64)  # stamp[v] == p: v already a candidate of row p
    touched = np.empty(n, np.int32)
    out = np.empty(M, np.int32)
    for ri in range(c, nr, n_chunks):
        p = rows[ri]
        lo = ptr[p]
        hi = lo
        while hi < min(ptr[p + 1], lo + n_sel) and occ_r[hi] < n_pivots:
            hi += 1
        if hi == lo:
            degree[p] = 0
            continue
        t = 0
        for o in range(lo, hi):
            q = occ_q[o]
            w = weights[q]
            for j in range(C):
                v = knn[q, j]
                if v == p:
                    continue
                if stamp[v] != p:
                    stamp[v] = p
                    acc[v] = 0.0
                    touched[t] = v
                    t += 1
                acc[v] += w
        uw = np.empty(t, np.float32)
        for i in range(t):
            uw[i] = acc[touched[i]]
            if key_weight is not None:
                uw[i] *= key_weight[touched[i]]
        thr = np.partition(uw, t - max_cand)[t - max_cand] if t > max_cand else -np.inf
        m = 0
        uid = np.empty(t, np.int32)
        key = np.empty(t, np.float64)
        sim = np.empty(t, np.float32)
        for i in range(t):
            if uw[i] >= thr:
                v = touched[i]
                uid[m] = v
                sim[m] = dot(data[p], data[v])
                key[m] = -(uw[i] * 1e6 + sim[m] * 1e-3)  # weight first, similarity breaks ties
                m += 1
        o = np.argsort(key[:m], kind="mergesort")[: min(m, max_cand)]
        if alpha > 0:
            kept = robust_prune_ordered(data, p, uid[o], sim[o], alpha, M, out, 0)
        else:
            kept = min(M, o.shape[0])
            for i in range(kept):
                out[i] = uid[o[i]]
        nbrs[p, :kept] = out[:kept]
        degree[p] = kept


@njit(cache=True, nogil=True)
def _incoming(nbrs, degree, n):
    """CSR of reverse edges: for each node u, the nodes p with u in p's list."""
    counts = np.zeros(n, np.int64)
    for p in range(n):
        for j in range(degree[p]):
            counts[nbrs[p, j]] += 1
    ptr = _csr_offsets(counts)
    fill = ptr[:-1].copy()
    src = np.empty(ptr[n], np.int32)
    for p in range(n):
        for j in range(degree[p]):
            u = nbrs[p, j]
            src[fill[u]] = p
            fill[u] += 1
    return ptr, src


def _merge_rows(data, nbrs, degree, ptr, src, alpha, R, prune_full):
    """:func:`merge_into_rows` over every row, into copies of ``nbrs``/``degree`` (returned)."""
    new_nbrs, new_deg = nbrs.copy(), degree.copy()
    merge_into_rows(data, new_nbrs, new_deg, np.arange(data.shape[0], dtype=np.int64), ptr, src, alpha, R, prune_full,
                    numba.get_num_threads())
    return new_nbrs, new_deg


def merge_into_rows(data, nbrs, degree, rows, ptr, src, alpha, R, prune_full, n_threads):
    """Each row u = rows[i], in place: append the proposed edges ``src[ptr[i]:ptr[i+1]]`` not already
    present; when the row would exceed R, either RobustPrune the union (``prune_full``) or keep the
    first R. Lock-free over ``n_threads`` chunks: an iteration reads and writes its own row only
    (``rows`` unique)."""
    n_chunks = max(1, min(len(rows), n_threads))
    if n_chunks == 1:
        _merge_chunk(data, nbrs, degree, rows, ptr, src, alpha, R, prune_full, 0, 1)  # no thread-pool launch
    else:
        _merge_par(data, nbrs, degree, rows, ptr, src, alpha, R, prune_full, n_chunks)


@njit(cache=True, nogil=True, parallel=True)
def _merge_par(data, nbrs, degree, rows, ptr, src, alpha, R, prune_full, n_chunks):
    for c in prange(n_chunks):
        _merge_chunk(data, nbrs, degree, rows, ptr, src, alpha, R, prune_full, c, n_chunks)


@njit(cache=True, nogil=True)
def _merge_chunk(data, nbrs, degree, rows, ptr, src, alpha, R, prune_full, c, n_chunks):
    for i in range(c, rows.shape[0], n_chunks):
        u = rows[i]
        lo, hi = ptr[i], ptr[i + 1]
        if hi == lo:
            continue
        cand = np.empty(degree[u] + hi - lo, np.int32)
        m = 0
        for j in range(degree[u]):
            cand[m] = nbrs[u, j]
            m += 1
        for t in range(lo, hi):
            v = src[t]
            if v == u:
                continue
            dup = False
            for j in range(m):
                if cand[j] == v:
                    dup = True
                    break
            if not dup:
                cand[m] = v
                m += 1
        if m <= R or not prune_full:
            kk = min(m, R)
            nbrs[u, :kk] = cand[:kk]
            degree[u] = kk
        else:
            out = np.empty(R, np.int32)
            kept = robust_prune(data, u, cand[:m].astype(np.int64), alpha, R, out)
            nbrs[u, :kept] = out[:kept]
            degree[u] = kept


def incoming_rows(props, targets):
    """Proposals (target ``targets[i]`` ← each u ≥ 0 in ``props[i]``) grouped by u, for :func:`merge_into_rows`:
    (rows u, ptr, src). Only the rows that receive something appear, so the cost follows the proposals,
    not the graph size; each row's sources keep the targets' order."""
    u = props.ravel()
    src = np.repeat(np.asarray(targets, np.int32), props.shape[1])
    keep = u >= 0
    u, src = u[keep], src[keep]
    order = np.argsort(u, kind="stable")
    rows, counts = np.unique(u[order], return_counts=True)
    ptr = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(counts, out=ptr[1:])
    return rows.astype(np.int64), ptr, np.ascontiguousarray(src[order])


def add_reverse_edges(data, nbrs, degree, alpha, R):
    """Make edges (nearly) symmetric: every p→u proposes u→p; rows over R are RobustPruned. Two-phase, lock-free."""
    ptr, src = _incoming(nbrs, degree, data.shape[0])
    return _merge_rows(data, nbrs, degree, ptr, src, alpha, R, True)


def _search_self(data, nbrs, degree, entries, L, n_threads, targets, width, alpha, R_link):
    """Each target key t: beam search for t's own vector, RobustPrune the expanded nodes to ``R_link``,
    and propose edges u→t from them (written to row t of ``props`` only). Targets in ``n_threads`` chunks."""
    props = np.full((len(targets), R_link), -1, np.int32)
    n_chunks = max(1, min(len(targets), n_threads))
    if n_chunks == 1:
        _search_chunk(data, nbrs, degree, entries, L, targets, width, alpha, R_link, props, 0, 1)  # no thread-pool launch
    else:
        _search_par(data, nbrs, degree, entries, L, targets, width, alpha, R_link, props, n_chunks)
    return props


@njit(cache=True, nogil=True, parallel=True)
def _search_par(data, nbrs, degree, entries, L, targets, width, alpha, R_link, props, n_chunks):
    for c in prange(n_chunks):
        _search_chunk(data, nbrs, degree, entries, L, targets, width, alpha, R_link, props, c, n_chunks)


@njit(cache=True, nogil=True)
def _search_chunk(data, nbrs, degree, entries, L, targets, width, alpha, R_link, props, c, n_chunks):
    nt = targets.shape[0]
    visited = np.zeros(data.shape[0], np.int32)
    expanded = np.empty(width, np.int64)
    out = np.empty(R_link, np.int32)
    lo = c * nt // n_chunks
    hi = (c + 1) * nt // n_chunks
    for i in range(lo, hi):
        t = targets[i]
        _, _, _, _, n_exp = beam_search(data, nbrs, degree, data[t], entries, L, visited, i - lo + 1, expanded)
        kept = robust_prune(data, t, expanded[:n_exp], alpha, R_link, out)
        props[i, :kept] = out[:kept]


@njit(cache=True, nogil=True)
def _props_to_incoming(props, targets, n):
    """Proposals (target t ← its found nodes u) as CSR by u: u's rows gain t."""
    counts = np.zeros(n, np.int64)
    for i in range(props.shape[0]):
        for j in range(props.shape[1]):
            if props[i, j] >= 0:
                counts[props[i, j]] += 1
    ptr = _csr_offsets(counts)
    fill = ptr[:-1].copy()
    src = np.empty(ptr[n], np.int32)
    for i in range(props.shape[0]):
        for j in range(props.shape[1]):
            u = props[i, j]
            if u >= 0:
                src[fill[u]] = targets[i]
                fill[u] += 1
    return ptr, src


def link_back(data, nbrs, degree, rows, alpha, R, n_threads=1):
    """Reverse edges of the given ``rows`` only, in place: each u in row t's list gains t (RobustPrune over R).
    Touches only the rows that gain an edge (``add``: the new keys' neighbours)."""
    rows = np.asarray(rows, np.int64)
    targets, ptr, src = incoming_rows(nbrs[rows], rows)
    merge_into_rows(data, nbrs, degree, targets, ptr, src, alpha, R, True, n_threads)


def connect_by_search(data, nbrs, degree, entries, L, alpha, R, R_link, n_threads, targets=None, prune_full=False):
    """Connectivity enhancement: each target is searched for on the graph and linked *from* the
    nodes it found (pruned to ``R_link``), so a search that reaches that region reaches it.

    Also gives each target with an empty row the found nodes as its out-edges. Two-phase (all
    searches, then the row merges), in place; returns (nbrs, degree).
    """
    n = data.shape[0]
    targets = np.arange(n, dtype=np.int64) if targets is None else np.asarray(targets, np.int64)
    props = _search_self(data, nbrs, degree, np.asarray(entries, np.int64), L, n_threads, targets, max(L, 1) * 4, alpha, R_link)
    for i, t in enumerate(targets):  # out-edges for rows that have none (new or isolated keys)
        if degree[t] == 0:
            row = props[i][props[i] >= 0][:R]
            nbrs[t, : len(row)] = row
            degree[t] = len(row)
    rows, ptr, src = incoming_rows(props, targets)
    merge_into_rows(data, nbrs, degree, rows, ptr, src, alpha, R, prune_full, n_threads)
    return nbrs, degree


def link_descent(data, nbrs, degree, knn, depth, per_key, alpha, R, n_threads=1):
    """In-edges along the training queries' top lists, in place: wherever key u at rank r of a query's
    top-``depth`` has no in-neighbour ranked above it in that list (a search for that query, which
    expands the keys above u first, has no way to u), u is proposed to the row of the key ranked above it
    most similar to u (largest ip). Each u takes its ``per_key`` most-proposed sources (ties: smaller id);
    the sources' rows gain u, RobustPruned over R (so a proposal may lose to the row's own edges).
    Returns the number of (query, key) gaps found."""
    n = data.shape[0]
    depth = min(depth, knn.shape[1])
    ptr, src = _incoming(nbrs, degree, n)
    knn = np.ascontiguousarray(knn[:, :depth])
    gaps = _descent_gaps(data, knn, ptr, src, max(1, min(len(knn), n_threads)))
    qi, r = np.nonzero(gaps >= 0)
    if len(qi) == 0:
        return 0
    pair = gaps[qi, r].astype(np.int64) * n + knn[qi, r]
    pairs, count = np.unique(pair, return_counts=True)
    v, u = (pairs // n).astype(np.int32), (pairs % n).astype(np.int64)
    order = np.lexsort((v, -count, u))  # by target, most proposed first
    v, u = v[order], u[order]
    start = np.r_[True, u[1:] != u[:-1]]
    rank = np.arange(len(u)) - np.flatnonzero(start)[np.cumsum(start) - 1]
    keep = rank < per_key
    targets = u[start]
    props = np.full((len(targets), per_key), -1, np.int32)
    props[np.cumsum(start)[keep] - 1, rank[keep]] = v[keep]
    rows, rptr, rsrc = incoming_rows(props, targets)
    merge_into_rows(data, nbrs, degree, rows, rptr, rsrc, alpha, R, True, n_threads)
    return len(qi)


@njit(cache=True, nogil=True, parallel=True)
def _descent_gaps(data, knn, ptr_in, src_in, n_chunks):
    """(m, depth) int32: for key ``knn[q, r]`` with no in-neighbour ranked above it in query q's list,
    the key ranked above it with the largest inner product with it; -1 elsewhere (and at rank 0)."""
    m, depth = knn.shape
    n = data.shape[0]
    out = np.full((m, depth), -1, np.int32)
    for c in prange(n_chunks):
        mark = np.full(n, -1, np.int64)  # mark[v] == q: v is in query q's list, at rank rk[v]
        rk = np.zeros(n, np.int32)
        for q in range(c, m, n_chunks):
            for r in range(depth):
                mark[knn[q, r]] = q
                rk[knn[q, r]] = r
            for r in range(1, depth):
                u = knn[q, r]
                reached = False
                for t in range(ptr_in[u], ptr_in[u + 1]):
                    w = src_in[t]
                    if mark[w] == q and rk[w] < r:
                        reached = True
                        break
                if reached:
                    continue
                best = -np.inf
                for s in range(r):
                    sim = dot(data[knn[q, s]], data[u])
                    if sim > best:
                        best = sim
                        out[q, r] = knn[q, s]
    return out


@njit(cache=True, nogil=True)
def merge_topk(ids, scores, queries, new_keys, first_id):
    """Row q of (``ids``, ``scores``) is query q's top keys, best first (padded -1 / -inf): merge in,
    in place, the new keys ``first_id + j`` whose inner product with ``queries[q]`` beats the row's
    last score. Returns which rows changed. The rows stay each query's exact top-K over every key
    added so far, for the cost of scoring the new keys only (serial: a few hundred × t dots)."""
    nq, K = ids.shape
    t = new_keys.shape[0]
    changed = np.zeros(nq, np.bool_)
    s = np.empty(t, np.float32)
    cj = np.empty(t, np.int64)
    cs = np.empty(t, np.float32)
    for q in range(nq):
        thr = scores[q, K - 1]
        cnt = 0
        for j in range(t):
            s[j] = dot(queries[q], new_keys[j])
            if s[j] > thr:
                cj[cnt] = j
                cs[cnt] = s[j]
                cnt += 1
        if cnt == 0:
            continue
        changed[q] = True
        order = np.argsort(-cs[:cnt], kind="mergesort")
        old_i = ids[q].copy()
        old_s = scores[q].copy()
        a = 0
        b = 0
        for r in range(K):  # merge two sorted lists; an old key wins ties (a < K: at most r of them taken)
            if b < cnt and cs[order[b]] > old_s[a]:
                ids[q, r] = first_id + cj[order[b]]
                scores[q, r] = cs[order[b]]
                b += 1
            else:
                ids[q, r] = old_i[a]
                scores[q, r] = old_s[a]
                a += 1
    return changed


@njit(cache=True, nogil=True)
def link_unreachable(data, nbrs, degree, entries, R):
    """Guarantee reachability from ``entries``: each unreachable node t gets an in-edge, from a
    reachable out-neighbour of t (or one two hops out) with a free slot when there is one (t's
    out-neighbours are its similar keys), else from the reachable node of largest inner product with t that has a free
    slot, else that node's last edge is replaced. Reachability is updated incrementally (BFS
    from t only), so this is O(edges) plus a scan per node that has no reachable out-neighbour.
    Returns how many in-edges were added."""
    n = data.shape[0]
    seen = reachable_from(nbrs, degree, entries)
    queue = np.empty(n, np.int64)
    linked = 0
    for sweep in range(3):  # a replaced edge may strand a node: re-check
        before = linked
        for t in range(n):
            if seen[t]:
                continue
            src = -1
            for j in range(degree[t]):
                u = nbrs[t, j]
                if seen[u] and degree[u] < R:
                    src = u
                    break
            if src < 0:  # two hops out
                for j in range(degree[t]):
                    w = nbrs[t, j]
                    for i in range(degree[w]):
                        u = nbrs[w, i]
                        if u != t and seen[u] and degree[u] < R:
                            src = u
                            break
                    if src >= 0:
                        break
            if src < 0:
                bs = -np.inf
                full = -1
                fs = -np.inf
                for u in range(n):
                    if seen[u]:
                        s = dot(data[u], data[t])
                        if degree[u] < R and s > bs:
                            bs = s
                            src = u
                        if s > fs:
                            fs = s
                            full = u
                if src < 0:
                    nbrs[full, R - 1] = t
                    src = -2
            if src >= 0:
                nbrs[src, degree[src]] = t
                degree[src] += 1
            linked += 1
            _mark_from(nbrs, degree, t, seen, queue)
        if linked == before:
            break  # every node was reachable and the graph is unchanged: no second BFS (add calls this each time)
        seen = reachable_from(nbrs, degree, entries)
        if seen.all():
            break
    return linked
