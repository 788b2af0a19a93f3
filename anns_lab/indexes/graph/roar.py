"""RoarGraph's passes: the bipartite query→key lists projected onto keys, descent links, the upkeep of
the kept queries' top lists on ``add``, and connectivity by search (see ``indexes/roargraph.py``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph.edges import merge_into_rows, proposals_by_row
from anns_lab.indexes.graph.prune import prune_ordered, robust_prune
from anns_lab.indexes.graph.search import search_one
from anns_lab.indexes.graph.simd import common_bits, dot, dot2x4, dot4, dot_rows, prefetch_keys
from anns_lab.indexes.graph.utils import append_new, kth_largest, kth_scratch, run_chunks


class Bipartite(NamedTuple):
    """The training queries' top key lists and their reverse side, as :func:`project_rows` reads them."""

    knn: np.ndarray  # (m, c) int32: query q's top keys, best first
    weights: np.ndarray  # (m,) float32: query weights in the co-occurrence merge
    ptr: np.ndarray  # (n + 1,) int64: key p's (query, rank) pairs are occ_q/occ_r[ptr[p]:ptr[p + 1]]
    occ_q: np.ndarray  # int32, sorted by rank, newest query first
    occ_r: np.ndarray  # int32
    key_weight: np.ndarray  # (n,) float32: (the key's occurrences + 1)^-idf


def bipartite(knn: np.ndarray, weights: np.ndarray, n: int, max_rank: int, idf: float) -> Bipartite:
    """The :class:`Bipartite` of lists ``knn`` over n keys, ranks below ``max_rank``: for key p, the (query,
    rank) pairs with knn[query, rank] == p, sorted by rank, newest query first."""
    ptr, occ_q, occ_r = _occurrences(knn, min(max_rank, knn.shape[1]), n, OCC_BUCKET_BITS)
    key_weight = np.ones(n, np.float32)
    if idf > 0:  # down-weight keys that are in every list (sinks) in each pivot's candidate order
        key_weight = (np.diff(ptr).astype(np.float32) + 1.0) ** np.float32(-idf)
    return Bipartite(knn, np.ascontiguousarray(weights, np.float32), ptr, occ_q, occ_r, key_weight)


OCC_BUCKET_BITS = 9  # _occurrences: keys per bucket of its first pass, as bits (512: ~255 write streams at 128K keys, each bucket ~2 MB to sort)


@njit(cache=True, nogil=True)
def _occurrences(knn, P, n, bucket_bits):
    """(ptr, occ_q, occ_r) of :class:`Bipartite` for the first P ranks of ``knn``: a counting sort by key, filled
    rank-major, newest query first (so each key's pairs come sorted by rank, newest first); negative ids left out.

    The fill runs in two passes for memory locality (a direct fill writes to ~n places at once, one cache miss per
    pair: ~1 s of a 128K build): the pairs go first, in fill order, to the regions of buckets of 2^``bucket_bits``
    keys (few write streams), the key's low bits packed above the rank; then each bucket's region, a few MB, is
    counting-sorted by key in place (stable: the fill order within each key is kept)."""
    m = knn.shape[0]
    ptr = np.zeros(n + 1, np.int64)
    for q in range(m):
        for r in range(P):
            if knn[q, r] >= 0:
                ptr[knn[q, r] + 1] += 1
    for v in range(n):
        ptr[v + 1] += ptr[v]
    occ_q = np.empty(ptr[n], np.int32)
    occ_r = np.empty(ptr[n], np.int32)
    rank_bits = 1
    while (1 << rank_bits) < P:
        rank_bits += 1
    shift = min(bucket_bits, 31 - rank_bits)  # the key's low bits and the rank share occ_r's 31 bits
    size = 1 << shift
    n_buckets = (n + size - 1) >> shift
    fill = np.empty(max(n_buckets, size), np.int64)
    for b in range(n_buckets):
        fill[b] = ptr[b << shift]
    for r in range(P):
        for q in range(m - 1, -1, -1):
            v = knn[q, r]
            if v >= 0:
                b = v >> shift
                i = fill[b]
                occ_q[i] = q
                occ_r[i] = r | ((v & (size - 1)) << rank_bits)
                fill[b] = i + 1
    widest = 0
    for b in range(n_buckets):
        widest = max(widest, ptr[min(n, (b + 1) << shift)] - ptr[b << shift])
    tq = np.empty(widest, np.int32)
    tr = np.empty(widest, np.int32)
    low = (1 << rank_bits) - 1
    for b in range(n_buckets):
        v0 = b << shift
        v1 = min(n, v0 + size)
        lo, hi = ptr[v0], ptr[v1]
        tq[: hi - lo] = occ_q[lo:hi]
        tr[: hi - lo] = occ_r[lo:hi]
        fill[: v1 - v0] = ptr[v0:v1]
        for i in range(hi - lo):
            x = tr[i]
            k = x >> rank_bits
            j = fill[k]
            occ_q[j] = tq[i]
            occ_r[j] = x & low
            fill[k] = j + 1
    return ptr, occ_q, occ_r


def project_rows(g: Graph, bip: Bipartite, sizes: tuple, alpha: float, n_threads: int, rows=None) -> None:
    """Projection of the bipartite graph onto keys, one row per key p, in place.

    ``sizes`` = (n_pivots, n_sel, n_cand, max_cand, M). p is a pivot for the queries where it ranks
    below ``n_pivots``; it takes the first ``n_sel`` of them (best rank first) and their first ``n_cand``
    keys as candidates, merges them by id with summed query weights times ``key_weight``, keeps the
    ``max_cand`` heaviest (ties: larger ip with p) and RobustPrunes them in that order to ``M``
    (``alpha`` = 0: no pruning, the heaviest M). Rows of keys that are nobody's pivot stay empty.
    The merge uses a dense per-chunk accumulator and computes ip(p, ·) only for the candidates heavy
    enough to be kept. ``rows`` (int64), when given, restricts the pass to those keys.
    """
    rows = np.arange(g.data.shape[0], dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    run_chunks(_project_chunk, (g, bip, rows, tuple(int(s) for s in sizes), float(alpha)), len(rows), n_threads)


@njit(cache=True, nogil=True)
def _project_chunk(g, bip, rows, sizes, alpha, c, n_chunks):
    """Rows ``rows[c::n_chunks]`` of :func:`project_rows` (interleaved: heavy rows, the sinks, spread over chunks)."""
    data, nbrs, degree = g
    n_pivots, n_sel, n_cand, max_cand, M = sizes
    n = data.shape[0]
    acc = np.full(n, -1.0, np.float32)  # summed weights of row p's candidates; -1: not a candidate (weights are ≥ 0)
    touched = np.empty(n + 1, np.int32)  # + 1: _co_occurrences writes each key one past the distinct ones, even when all n are
    # per-row scratch, allocated once per chunk (a row has at most n candidates)
    uw, w, sim = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float32)
    uid = np.empty(n, np.int32)
    key = np.empty(n, np.float64)
    out = np.empty(M, np.int32)
    kth = kth_scratch(n, max_cand)
    for ri in range(c, rows.shape[0], n_chunks):
        p = rows[ri]
        lo = hi = bip.ptr[p]
        while hi < min(bip.ptr[p + 1], lo + n_sel) and bip.occ_r[hi] < n_pivots:
            hi += 1
        t = _co_occurrences(bip, p, lo, hi, min(n_cand, bip.knn.shape[1]), acc, touched)
        if t == 0:
            degree[p] = 0
            continue
        for i in range(t):
            v = touched[i]
            uw[i] = acc[v] * bip.key_weight[v]
            acc[v] = -1.0  # reset by the touched list: one array read per update (was a stamp array beside it)
        thr = kth_largest(uw[:t], max_cand, kth) if t > max_cand else -np.inf
        m = 0
        for i in range(t):
            if uw[i] >= thr:
                uid[m] = touched[i]
                w[m] = uw[i]
                m += 1
        dot_rows(data[p], data, uid[:m], sim[:m])
        for i in range(m):
            key[i] = -(w[i] * 1e6 + sim[i] * 1e-3)  # weight first, similarity breaks ties
        o = np.argsort(key[:m], kind="mergesort")[: min(m, max_cand)]
        if alpha > 0:
            kept = prune_ordered(data, p, uid[o], sim[o], alpha, M, out, 0)
        else:
            kept = min(M, o.shape[0])
            out[:kept] = uid[o[:kept]]
        nbrs[p, :kept] = out[:kept]
        degree[p] = kept


@njit(cache=True, nogil=True, inline="always")
def _co_occurrences(bip, p, lo, hi, C, acc, touched):
    """Merge the first C keys of the queries ``occ_q[lo:hi]`` by id into ``acc`` (summed query weights; entries
    < 0 are keys not seen yet); the distinct keys but p go to ``touched`` (room for n + 1), in the order first seen;
    returns how many.
    Branch-free per key (every key is written to ``touched``, the count advances on a first sighting): whether a
    key was seen before is a coin flip to the branch predictor on real lists."""
    t = 0
    for o in range(lo, hi):
        q = bip.occ_q[o]
        w = bip.weights[q]
        if o + 1 < hi:  # the next query's list: a random row of a large array, fetched while this one is merged
            prefetch_keys(bip.knn, bip.occ_q[o + 1:o + 2], 1)
        row = bip.knn[q]
        for j in range(C):
            # Unsigned indices: list ids and t are never negative, and numba's wraparound test on a signed index
            # (two per key) cost ~40% of this loop (11/2 at 128K: 2.3 -> 1.3 s of merging).
            v = np.uint32(row[j])
            a = acc[v]
            touched[np.uint64(t)] = v
            t += a < 0
            acc[v] = max(a, np.float32(0.0)) + w
    if acc[p] >= 0:  # p is in its own queries' lists: not its own candidate
        acc[p] = -1.0
        i = 0
        while touched[i] != p:
            i += 1
        touched[i:t - 1] = touched[i + 1:t]
        t -= 1
    return t


def link_unlisted(g: Graph, own: Bipartite, group: Bipartite, sizes: tuple, alpha: float, in_edges: int,
                  n_threads: int = 1) -> np.ndarray:
    """Rows for the keys in none of the head's own lists (``own``), from the other heads' lists (``group``), in place;
    returns those keys. Each is projected from the group's lists as :func:`project_rows` projects (``sizes``,
    ``alpha``; a key the group lists only past its pivot rank keeps its empty row), and the first ``in_edges`` keys
    of its new row gain it at their row's end where the row has room: a key the own lists cover keeps its edges and
    their order (another head's lists change a pivot's candidates, which costs the head's own search)."""
    unlisted = np.flatnonzero(own.ptr[1:] == own.ptr[:-1])
    project_rows(g, group, sizes, alpha, n_threads, rows=unlisted)
    if in_edges > 0:
        _append_reverse(g.nbrs, g.degree, unlisted, in_edges)
    return unlisted


@njit(cache=True, nogil=True)
def _append_reverse(nbrs, degree, rows, per_row):
    """For each u of ``rows`` and v among the first ``per_row`` of u's row: u appended to v's row if it has room and
    lacks u (serial: rows are shared)."""
    R = nbrs.shape[1]
    for u in rows:
        for j in range(min(per_row, degree[u])):
            v = nbrs[u, j]
            if degree[v] < R:
                degree[v] = append_new(nbrs[v], degree[v], u)


def connect_by_search(g: Graph, entries, L: int, prune: tuple, n_threads: int, targets=None, prune_full=False,
                      keep_order=False) -> None:
    """Connectivity enhancement, in place: each target is searched for on the graph and linked *from* the
    nodes it found (RobustPruned to ``R_link``; ``prune`` = (alpha, R, R_link); ``keep_order``:
    ``edges.merge_into_rows``), so a search that reaches that region reaches it. A target with an empty row also
    gets the found nodes as out-edges. Two-phase: all searches, then the row merges."""
    alpha, R, R_link = prune
    n = g.data.shape[0]
    targets = np.arange(n, dtype=np.int64) if targets is None else np.asarray(targets, np.int64)
    props = np.full((len(targets), R_link), -1, np.int32)
    search = (np.asarray(entries, np.int64), L, max(L, 1) * 4)
    run_chunks(_search_chunk, (tuple(g), search, targets, alpha, props), len(targets), n_threads)
    for i, t in enumerate(targets):  # out-edges for rows that have none (new or isolated keys)
        if g.degree[t] == 0:
            row = props[i][props[i] >= 0][:R]
            g.nbrs[t, : len(row)] = row
            g.degree[t] = len(row)
    rows, ptr, src = proposals_by_row(props, targets, n)
    merge_into_rows(g, rows, ptr, src, alpha, R, prune_full, n_threads, keep_order)


@njit(cache=True, nogil=True)
def _search_chunk(g, search, targets, alpha, props, c, n_chunks):
    """Targets [c·nt/n_chunks, (c+1)·nt/n_chunks): search for the target's own vector, RobustPrune the
    expanded nodes, write them to its row of ``props``."""
    entries, L, width = search
    data = g[0]
    nt, n = targets.shape[0], data.shape[0]
    ws = (np.zeros(n, np.int32), np.empty(n + L, np.float32), np.empty(n + L, np.int64), np.empty(width, np.int64),
          np.empty(0, np.float32))  # no memo: full rows
    no_ids, no_scores = np.empty(0, np.int64), np.empty(0, np.float32)
    out = np.empty(props.shape[1], np.int32)
    lo = c * nt // n_chunks
    for i in range(lo, (c + 1) * nt // n_chunks):
        t = targets[i]
        _, _, n_exp = search_one(g, data[t], entries, L, ws, i - lo + 1, no_ids, no_scores, (0, 0.0, 0))  # full rows
        kept = robust_prune(data, t, ws[3][:n_exp], alpha, props.shape[1], out)
        props[i, :kept] = out[:kept]


def link_descent(g: Graph, knn: np.ndarray, depth: int, per_key: int, prune: tuple, n_threads: int = 1) -> int:
    """In-edges along the training queries' top lists, in place: wherever key u at rank r of a query's
    top-``depth`` has no in-neighbour ranked above it in that list (a search for that query, which
    expands the keys above u first, has no way to u), u is proposed to the row of the key ranked above
    it most similar to u. Each u takes its ``per_key`` most-proposed sources (ties: smaller id); the
    sources' rows gain u, RobustPruned over R (``prune`` = (alpha, R)). Returns the number of gaps."""
    n = g.data.shape[0]
    knn = np.ascontiguousarray(knn[:, :min(depth, knn.shape[1])])
    gaps = descent_gaps(g, knn, n_threads)
    targets, props, n_gaps = _most_proposed(gaps, knn, n, per_key)
    if n_gaps == 0:
        return 0
    rows, rptr, rsrc = proposals_by_row(props, targets, n)
    merge_into_rows(g, rows, rptr, rsrc, prune[0], prune[1], True, n_threads)
    return n_gaps


@njit(cache=True, nogil=True)
def _most_proposed(gaps, knn, n, per_key):
    """(targets (t,) int64 ascending, props (t, per_key) int32, gaps): each key u proposed by ``gaps`` (u = knn[q, r],
    source gaps[q, r] ≥ 0) with its ``per_key`` most frequent sources, most first, ties by smaller id, -1 padded.
    (A counting sort by target, then each target's few sources sorted: was np.unique and lexsort over all the pairs.)"""
    m, depth = gaps.shape
    ptr = np.zeros(n + 1, np.int64)
    for q in range(m):
        for r in range(depth):
            if gaps[q, r] >= 0:
                ptr[knn[q, r] + 1] += 1
    n_targets = 0
    for u in range(n):
        n_targets += ptr[u + 1] > 0
        ptr[u + 1] += ptr[u]
    src = np.empty(ptr[n], np.int32)
    fill = ptr[:n].copy()
    for q in range(m):
        for r in range(depth):
            if gaps[q, r] >= 0:
                u = knn[q, r]
                src[fill[u]] = gaps[q, r]
                fill[u] += 1
    targets = np.empty(n_targets, np.int64)
    props = np.full((n_targets, per_key), -1, np.int32)
    t = 0
    for u in range(n):
        lo, hi = ptr[u], ptr[u + 1]
        if hi == lo:
            continue
        vs = np.sort(src[lo:hi])
        targets[t] = u
        for j in range(per_key):  # the most frequent source not taken yet (runs in ascending id: ties keep the smaller)
            best, best_count, i = -1, 0, 0
            while i < vs.shape[0]:
                e = i
                while e < vs.shape[0] and vs[e] == vs[i]:
                    e += 1
                if e - i > best_count and vs[i] >= 0:
                    best, best_count = i, e - i
                i = e
            if best < 0:
                break
            props[t, j] = vs[best]
            vs[best:best + best_count] = -1  # taken (the run stays sorted: its ids are skipped above)
        t += 1
    return targets, props, ptr[n]


RARE_BITSET_BYTES = 128 << 20  # drop_rare_edges: memory for the list bitsets of the keys held by the most lists (a real 128K head: 6,653 keys in ≥ m/64 lists, 109 MB; 64 MB cost 1.37 s against 0.94)


def drop_rare_edges(g: Graph, bip: Bipartite, min_frac: float, n_threads: int = 1) -> int:
    """Query-judged edges, in place: drop edge p → u where fewer than ``min_frac`` of the training lists that
    hold p also hold u (a search that reaches p for such a query scans u in vain); a row keeps at least
    its most co-occurring edge, in order. ``bip`` gives each key's lists (``bipartite`` over the whole
    lists). Rows of keys in no list are left alone. Returns the number of edges dropped.

    Counting an edge costs the lists of its side held by fewer: a key in at least m/64 of the m lists (the
    sinks and heavy hitters, in up to half of them) has a bitset of its lists, so an edge between two such
    keys is a popcount of m/64 words and an edge to one of them tests the other side's lists in its bitset
    (counting by u's lists alone cost ~0.3 s per 32K head, most of it on edges into sinks)."""
    m = bip.knn.shape[0]
    dropped = np.zeros(g.data.shape[0], np.int64)
    run_chunks(_rare_chunk, (g, bip.ptr, bip.occ_q, _heavy_bitsets(bip), m, np.float64(min_frac), dropped),
               len(dropped), n_threads)
    return int(dropped.sum())


def _heavy_bitsets(bip: Bipartite) -> tuple:
    """:func:`_list_bitsets` of the keys in at least m/64 of the m lists (at most ``RARE_BITSET_BYTES`` of them,
    those in the most lists first)."""
    m = bip.knn.shape[0]
    occ = np.diff(bip.ptr)
    words = (m + 63) // 64
    heavy = np.flatnonzero(occ >= words)
    if len(heavy) * words * 8 > RARE_BITSET_BYTES:  # keep the keys in the most lists: the others are counted as before
        heavy = heavy[np.argsort(-occ[heavy], kind="stable")[: RARE_BITSET_BYTES // (words * 8)]]
    return _list_bitsets(bip.ptr, bip.occ_q, heavy.astype(np.int64), words, len(occ))


@njit(cache=True, nogil=True)
def _list_bitsets(ptr, occ_q, heavy, words, n):
    """(bits (len(heavy), words) uint64: bit q of row h set when query q's list holds key heavy[h]; slot (n,): each
    key's row in bits, -1 for keys without one)."""
    slot = np.full(n, -1, np.int64)
    bits = np.zeros((heavy.shape[0], words), np.uint64)
    for h in range(heavy.shape[0]):
        p = heavy[h]
        slot[p] = h
        for j in range(ptr[p], ptr[p + 1]):
            q = occ_q[j]
            bits[h, q >> 6] |= np.uint64(1) << np.uint64(q & 63)
    return bits, slot


RARE_BLOCK = 64  # _rare_chunk counts an edge's common lists in blocks of this many, stopping once it has enough


@njit(cache=True, nogil=True, inline="always")
def _in_bitset(occ_q, lo, hi, bits, need):
    """How many of the queries ``occ_q[lo:hi]`` have their bit set in ``bits``, or a count ≥ ``need`` once it
    reaches that (counted in blocks of RARE_BLOCK)."""
    s = 0
    for b in range(lo, hi, RARE_BLOCK):
        for j in range(b, min(hi, b + RARE_BLOCK)):
            q = np.uint32(occ_q[j])
            s += (bits[q >> 6] >> np.uint64(q & 63)) & np.uint64(1)
        if s >= need:
            break
    return s


@njit(cache=True, nogil=True, inline="always")
def _edge_counts(nbrs, degree, p, ptr, occ_q, lists, own, need, count):
    """``count[t]`` = how many of key p's training lists also hold its t-th neighbour (t < degree[p]), or a count
    ≥ ``need`` once it reaches that (``need`` = inf: exact counts). ``own`` (⌈m/64⌉,) uint64, zero before and after,
    is scratch for p's lists as a bitset when p has none in ``lists``: m bits (16 KB at 128K) stay in L1, where one
    int32 stamp per query (512 KB) sat in L2 (~35% of the counts' time at 128K)."""
    bits, slot = lists
    hp = slot[p]
    filled = False
    for t in range(degree[p]):
        u = nbrs[p, t]
        hu = slot[u]
        if hp >= 0 and hu >= 0:
            s = common_bits(bits[hp], bits[hu])
        elif hu >= 0:  # p is in fewer lists than u
            s = _in_bitset(occ_q, ptr[p], ptr[p + 1], bits[hu], need)
        elif hp >= 0:
            s = _in_bitset(occ_q, ptr[u], ptr[u + 1], bits[hp], need)
        else:
            if not filled:
                for j in range(ptr[p], ptr[p + 1]):
                    q = np.uint32(occ_q[j])
                    own[q >> 6] |= np.uint64(1) << np.uint64(q & 63)
                filled = True
            s = _in_bitset(occ_q, ptr[u], ptr[u + 1], own, need)
        count[t] = s
    if filled:
        for j in range(ptr[p], ptr[p + 1]):
            own[np.uint32(occ_q[j]) >> 6] = 0


@njit(cache=True, nogil=True)
def _rare_chunk(g, ptr, occ_q, lists, m, min_frac, dropped, c, n_chunks):
    """Rows p ≡ c (mod n_chunks) of :func:`drop_rare_edges` (a row is read and written by its owner only)."""
    _, nbrs, degree = g
    own = np.zeros((m + 63) // 64, np.uint64)  # _edge_counts' scratch
    count = np.empty(nbrs.shape[1], np.int64)
    for p in range(c, nbrs.shape[0], n_chunks):
        if ptr[p + 1] == ptr[p] or degree[p] == 0:
            continue
        # A count stops once it reaches `need` (the edge is kept): the same edges, since the most co-occurring edge
        # that a row keeps anyway matters only when no count reaches `need`, and then every count is exact.
        need = min_frac * (ptr[p + 1] - ptr[p])
        _edge_counts(nbrs, degree, p, ptr, occ_q, lists, own, need, count)
        best = 0
        for t in range(degree[p]):
            if count[t] > count[best]:
                best = t
        kept = 0
        for t in range(degree[p]):
            if count[t] >= need or t == best:
                nbrs[p, kept] = nbrs[p, t]
                kept += 1
        dropped[p] = degree[p] - kept
        nbrs[p, kept:degree[p]] = -1
        degree[p] = kept


def order_rows_by_cooc(g: Graph, bip: Bipartite, n_threads: int = 1) -> None:
    """Sort each row, in place, by how many of the key's training lists also hold the neighbour, most first
    (ties keep their order): the order in which the search's row stop (``graph.search``) walks a row.
    Rows of keys in no list are left as they are. The edges do not change."""
    m = bip.knn.shape[0]
    run_chunks(_order_chunk, (g, bip.ptr, bip.occ_q, _heavy_bitsets(bip), m), g.data.shape[0], n_threads)


@njit(cache=True, nogil=True)
def _order_chunk(g, ptr, occ_q, lists, m, c, n_chunks):
    """Rows p ≡ c (mod n_chunks) of :func:`order_rows_by_cooc`."""
    _, nbrs, degree = g
    own = np.zeros((m + 63) // 64, np.uint64)  # _edge_counts' scratch
    count = np.empty(nbrs.shape[1], np.int64)
    for p in range(c, nbrs.shape[0], n_chunks):
        d = degree[p]
        if ptr[p + 1] == ptr[p] or d < 2:
            continue
        _edge_counts(nbrs, degree, p, ptr, occ_q, lists, own, np.inf, count)
        o = np.argsort(-count[:d], kind="mergesort")
        nbrs[p, :d] = nbrs[p, :d][o]


def descent_gaps(g: Graph, knn: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """(m, depth) int32: for key ``knn[q, r]`` with no in-neighbour ranked above it in query q's list, the
    key ranked above it with the largest inner product with it; -1 elsewhere (and at rank 0)."""
    gaps = np.full(knn.shape, -1, np.int32)
    run_chunks(_gaps_chunk, (g, np.ascontiguousarray(knn), gaps), len(knn), n_threads)
    return gaps


@njit(cache=True, nogil=True)
def _gaps_chunk(g, knn, out, c, n_chunks):
    """Queries q ≡ c (mod n_chunks) of :func:`descent_gaps`. A list is walked down its ranks, stamping the rows of
    the keys passed: key u at rank r has an in-neighbour ranked above it exactly when one of those rows holds it.
    (Was: u's in-edges scanned for a key above it; a heavy hitter has thousands, ~half the pass at 8K.) The gaps found,
    the keys above each are scored two gaps at a time (:func:`_best_above`)."""
    data, nbrs, degree = g
    m, depth = knn.shape
    reach = np.full(data.shape[0], -1, np.int32)  # reach[v] == q: v is in the row of a key passed in q's list
    at = np.empty(depth, np.int64)
    for q in range(c, m, n_chunks):
        row = knn[q]
        n_gaps = 0
        for r in range(depth):
            u = row[r]
            if r > 0 and reach[u] != q:
                at[n_gaps] = r
                n_gaps += 1
            for j in range(degree[u]):
                reach[nbrs[u, j]] = q
        for i in range(0, n_gaps, 2):
            r0 = at[i]
            r1 = at[i + 1] if i + 1 < n_gaps else r0
            out[q, r0], out[q, r1] = _best_above(data, row, r0, r1)


@njit(cache=True, nogil=True, inline="always")
def _best_above(data, row, r0, r1):
    """(the key of ``row[:r0]`` of largest inner product with key ``row[r0]``, the same for ``r1`` ≥ r0; first on ties),
    each score :func:`dot`'s bits: the keys above both are scored against the two at once (:func:`dot2x4`: eight
    accumulators, where one key's four (``dot_rows``) wait on their adds), the rest four at a time (:func:`dot4`)."""
    a0, a1 = data[row[r0]], data[row[r1]]
    b0 = b1 = np.float32(-np.inf)
    s0 = s1 = 0
    s = 0
    while s + 4 <= r0:
        x = dot2x4(a0, a1, data[row[s]], data[row[s + 1]], data[row[s + 2]], data[row[s + 3]])
        for h, v in enumerate(x[:4]):
            if v > b0:
                b0, s0 = v, s + h
        for h, v in enumerate(x[4:]):
            if v > b1:
                b1, s1 = v, s + h
        s += 4
    while s < r0:  # r0's last few: both
        x0, x1 = dot4(data[row[s]], a0, a1, a1, a1)[:2]
        if x0 > b0:
            b0, s0 = x0, s
        if x1 > b1:
            b1, s1 = x1, s
        s += 1
    while s < r1:  # r1's alone
        last = r1 - 1
        x = dot4(a1, data[row[s]], data[row[min(s + 1, last)]], data[row[min(s + 2, last)]], data[row[min(s + 3, last)]])
        for h, v in enumerate(x):
            if h < r1 - s and v > b1:
                b1, s1 = v, s + h
        s += 4
    return row[s0], row[s1]


@njit(cache=True, nogil=True)
def list_scores(queries, keys, ids, out):
    """``out[q, j]`` = ip(queries[q], keys[ids[q, j]]) (:func:`dot`'s sums; no gather of the listed key rows)."""
    for q in range(ids.shape[0]):
        dot_rows(queries[q], keys, ids[q], out[q])


@njit(cache=True, nogil=True)
def merge_topk(ids, scores, queries, new_keys, first_id):
    """Row q of (``ids``, ``scores``) is query q's top keys, best first (padded -1 / -inf): merge in, in place,
    the new keys ``first_id + j`` whose inner product with ``queries[q]`` beats the row's last score.
    Returns which rows changed. The rows stay each query's exact top-K over every key added so far,
    for the cost of scoring the new keys only."""
    nq, K = ids.shape
    t = new_keys.shape[0]
    changed = np.zeros(nq, np.bool_)
    s = np.empty(t, np.float32)
    cj = np.empty(t, np.int64)
    cs = np.empty(t, np.float32)
    for q in range(nq):
        cnt = 0
        for j in range(t):
            s[j] = dot(queries[q], new_keys[j])
            if s[j] > scores[q, K - 1]:
                cj[cnt] = j
                cs[cnt] = s[j]
                cnt += 1
        if cnt == 0:
            continue
        changed[q] = True
        order = np.argsort(-cs[:cnt], kind="mergesort")
        old_i = ids[q].copy()
        old_s = scores[q].copy()
        a = b = 0
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
