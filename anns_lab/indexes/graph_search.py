"""Counted graph search: beam search (maximum inner product) and reachability.

A graph is a fixed-width adjacency array ``nbrs`` (n, R) int32 with ``degree`` (n,) int32
(row i's neighbours are ``nbrs[i, :degree[i]]``). Every inner product a search computes is
counted (``n_scanned``), entry points included.

Style as in pynndescent: ``@njit(cache=True, nogil=True)``, ``prange`` over independent
queries, the candidate list as parallel arrays, and an epoch-stamped visited array per thread
(so it is cleared by bumping an integer, not by an O(n) fill per query).
"""

from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types as nbtypes
from numba.extending import intrinsic, overload

_LANES = 8  # float32 lanes of the explicit SIMD accumulator (one AVX register)


@intrinsic
def _simd_dot(typingctx, a, b):
    """Inner product of two C-contiguous float32 vectors with an explicit 8-lane vector accumulator.

    The summation order is written out in the IR (lane j sums elements j, j+8, …; then a fixed
    pairwise tree over the lanes; then the tail in order) and carries no fast-math flags, so LLVM
    may not reorder it: every kernel that calls :func:`dot` gets the same bits, vectorised.
    """
    if not all(isinstance(x, nbtypes.Array) and x.ndim == 1 and x.layout == "C" and x.dtype == nbtypes.float32
               for x in (a, b)):
        return None
    sig = nbtypes.float32(a, b)

    def codegen(context, builder, signature, args):
        va_ = context.make_array(signature.args[0])(context, builder, args[0])
        vb_ = context.make_array(signature.args[1])(context, builder, args[1])
        n = builder.extract_value(va_.shape, 0)
        vec = ir.VectorType(ir.FloatType(), _LANES)
        width = ir.Constant(n.type, _LANES)
        acc = cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * _LANES))
        n_vec = builder.udiv(n, width)
        with cgutils.for_range(builder, n_vec) as loop:
            i = builder.mul(loop.index, width)
            x = builder.load(builder.bitcast(builder.gep(va_.data, [i]), vec.as_pointer()), align=4)
            y = builder.load(builder.bitcast(builder.gep(vb_.data, [i]), vec.as_pointer()), align=4)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(x, y)), acc)
        v = builder.load(acc)
        lanes = [builder.extract_element(v, ir.Constant(ir.IntType(32), j)) for j in range(_LANES)]
        while len(lanes) > 1:
            half = len(lanes) // 2
            lanes = [builder.fadd(lanes[j], lanes[j + half]) for j in range(half)]
        total = cgutils.alloca_once_value(builder, lanes[0])
        with cgutils.for_range_slice(builder, builder.mul(n_vec, width), n, ir.Constant(n.type, 1), inc=True) as (i, _):
            xy = builder.fmul(builder.load(builder.gep(va_.data, [i])), builder.load(builder.gep(vb_.data, [i])))
            builder.store(builder.fadd(builder.load(total), xy), total)
        return builder.load(total)

    return sig, codegen


@intrinsic
def _prefetch(typingctx, arr, i, j):
    """Hint the cache line holding ``arr[i, j]`` (2-D) or ``arr[i]`` (1-D, j ignored) into the caches."""
    if not isinstance(arr, nbtypes.Array) or arr.ndim not in (1, 2):
        return None
    sig = nbtypes.void(arr, i, j)

    def codegen(context, builder, signature, args):
        aryty, ity, jty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = [context.cast(builder, args[1], ity, nbtypes.intp)]
        if aryty.ndim == 2:
            idx.append(context.cast(builder, args[2], jty, nbtypes.intp))
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


def _dot_any(a, b):
    """Typing stub of :func:`dot`'s two implementations."""


@overload(_dot_any, inline="always")
def _dot_any_impl(a, b):
    if all(isinstance(x, nbtypes.Array) and x.layout == "C" and x.dtype == nbtypes.float32 for x in (a, b)):
        return lambda a, b: _simd_dot(a, b)

    def sequential(a, b):
        s = np.float32(0.0)
        for i in range(a.shape[0]):
            s += a[i] * b[i]
        return s

    return sequential


@njit(cache=True, nogil=True, inline="always")
def dot(a: np.ndarray, b: np.ndarray) -> float:
    """Inner product of two float32 vectors (no BLAS call overhead): explicit 8-lane SIMD for contiguous rows.

    About 4x faster at d = 64 than the plain sequential loop (which LLVM cannot vectorise without
    fast-math reassociation, and with it vectorises differently in different callers). Here the
    order is fixed (:func:`_simd_dot`), so the query-time searches and the builds agree bit for
    bit. Non-contiguous inputs use the sequential sum.
    """
    return _dot_any(a, b)

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


# -- query-time search: best-first with two binary heaps ------------------------------------------
#
# hnswlib's two-heap best-first search: a min-heap of the L best nodes scanned (the beam) and a
# max-heap of the beam's nodes not yet expanded (the frontier); stop when the frontier's best is
# worse than the worst of a full beam. It visits what beam_search visits, but every insertion is
# O(log L) where the sorted list shifts O(L) entries: at L = 150–300 that shifting, not the 64-dim
# inner products, was most of a query's time. With L < k a third heap keeps the k best of every
# node scanned, so a narrow beam still returns k keys.


@njit(cache=True, nogil=True, inline="always")
def _push_min(hs, hi, n, s, v):
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
def _sift_min(hs, hi, n, s, v):
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


@njit(cache=True, nogil=True, inline="always")
def _push_max(hs, hi, n, s, v):
    """Push (s, v) on the max-heap of size n; return the new size."""
    i = n
    while i > 0:
        p = (i - 1) >> 1
        if hs[p] >= s:
            break
        hs[i] = hs[p]
        hi[i] = hi[p]
        i = p
    hs[i] = s
    hi[i] = v
    return n + 1


@njit(cache=True, nogil=True, inline="always")
def _pop_max(hs, hi, n):
    """Drop the root of the max-heap of size n; return the new size."""
    n -= 1
    s = hs[n]
    v = hi[n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and hs[c + 1] > hs[c]:
            c += 1
        if hs[c] <= s:
            break
        hs[i] = hs[c]
        hi[i] = hi[c]
        i = c
    if n > 0:
        hs[i] = s
        hi[i] = v
    return n


def heap_slots(n: int, L: int, k: int) -> int:
    """Workspace slots (per heap array) that :func:`search_one` / :func:`search_heads` need for n keys, beam L, top-k."""
    return n + L + (k if L < k else 0)


@njit(cache=True, nogil=True, inline="always")
def _fresh(cands, visited, epoch, fresh):
    """Copy the nodes of ``cands`` not yet visited (``-1`` skipped) into ``fresh`` in order, marking them; return how many."""
    m = 0
    for v in cands:
        if v >= 0 and visited[v] != epoch:
            visited[v] = epoch
            fresh[m] = v
            m += 1
    return m


@njit(cache=True, nogil=True, inline="always")
def _offer(rs, ri, cs, ci, nr, nc, L, s, v):
    """Offer scanned node v (score s) to the beam (min-heap ``rs``/``ri`` of the L best, size nr); if it
    enters, push it on the frontier (max-heap ``cs``/``ci``, size nc). Returns (nr, nc)."""
    if nr < L:
        nr = _push_min(rs, ri, nr, s, v)
    elif s > rs[0]:
        _sift_min(rs, ri, nr, s, v)
    else:
        return nr, nc
    return nr, _push_max(cs, ci, nc, s, v)


@njit(cache=True, nogil=True, inline="always")
def _pop_next(rs, cs, ci, nr, nc, L):
    """Pop the next node to expand: (node, nc), node -1 when the search is done (the frontier is empty, or its
    best is worse than the worst of a full beam: every node of the beam is expanded)."""
    if nc == 0 or (nr == L and cs[0] < rs[0]):
        return -1, nc
    node = ci[0]
    return node, _pop_max(cs, ci, nc)


@njit(cache=True, nogil=True, inline="always")
def _drain(hs, hi, n, out_ids, out_scores):
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
            _sift_min(hs, hi, n, hs[n], hi[n])


@njit(cache=True, nogil=True)
def search_one(data, nbrs, degree, query, entries, L, visited, epoch, heap_s, heap_i, out_ids, out_scores):
    """Best-first beam search of one query; writes its top-k (k = ``len(out_ids)``) and returns n_scanned.

    The same search as :func:`beam_search` (keep the ``L`` best nodes seen, expand the best
    unexpanded one until all ``L`` are expanded: it stops when the best candidate left is worse
    than the L-th best), with the beam as a min-heap and the frontier as a max-heap instead of a
    sorted list (O(log L) per insert). The entry points are scored and offered first, in order
    (``-1`` and repeats skipped); only those that enter the beam go on the frontier. Every inner
    product (:func:`dot`) is counted once, entry points included.

    L ≥ k: the output is the beam's best k. L < k: a third heap keeps the k best of every node
    scanned (entry points included) and gives the output, so a narrow beam still returns k keys
    (on a query-aware graph the rest of a query's top keys are neighbours of the best L); the
    search itself (what is expanded, when it stops) is the same.

    ``visited`` (≥ n,) int32 is marked with ``epoch`` (callers bump it per query, so it needs no
    clearing); ``heap_s``/``heap_i`` are a workspace of at least :func:`heap_slots` (n + L, plus k
    when L < k). ``out_ids``/``out_scores`` get the k best by descending score, padded with -1 / -inf.
    """
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
    m = _fresh(entries, visited, epoch, fresh)  # the entry points: scored and offered as an expanded row's
    n_scanned = m
    nr = nt = nc = 0
    while True:
        # All the inner products first, with no branch between them, so that their key rows load in parallel
        # (the search is memory-bound); then the heap updates in order (the same result as one pass).
        for j in range(m):
            fresh_s[j] = dot(data[fresh[j]], query)
        for j in range(m):
            if kt > 0:  # written out: as an inline helper of its own this cost ~16 ns more per node (numba 0.68)
                if nt < kt:
                    nt = _push_min(ts, ti, nt, fresh_s[j], fresh[j])
                elif fresh_s[j] > ts[0]:
                    _sift_min(ts, ti, nt, fresh_s[j], fresh[j])
            nr, nc = _offer(rs, ri, cs, ci, nr, nc, L, fresh_s[j], fresh[j])
        node, nc = _pop_next(rs, cs, ci, nr, nc, L)
        if node < 0:
            break
        m = _fresh(nbrs[node, :degree[node]], visited, epoch, fresh)
        n_scanned += m
    if kt > 0:
        _drain(ts, ti, nt, out_ids, out_scores)
    else:
        _drain(rs, ri, nr, out_ids, out_scores)
    return n_scanned


def search_single(data, nbrs, degree, query, entries, L: int, k: int):
    """One query on the calling thread (batch 1, the decoding case) with this thread's workspace
    (:func:`_workspace`: no n-sized allocation per query): (ids (1, k), scores (1, k), n_scanned (1,))."""
    visited, heap_s, heap_i, epoch = _workspace(1, data.shape[0], L, k)
    ids = np.empty((1, k), np.int64)
    scores = np.empty((1, k), np.float32)
    n = search_one(data, nbrs, degree, query, entries, L, visited[0], epoch, heap_s[0], heap_i[0], ids[0], scores[0])
    return ids, scores, np.array([n], np.int64)


@njit(cache=True, nogil=True, parallel=True)
def beam_search_batch(data, nbrs, degree, queries, entries, L, k, n_threads):
    """Search each query (row of ``entries`` = its entry nodes, ``-1`` = none) on ``n_threads``; top-k, padded with -1/-inf.

    Best-first search with beam ``L`` (:func:`search_one`; L < k returns the k best of every node
    scanned). ``n_threads`` is passed in (``numba.get_num_threads()``) because reading it inside
    would stop caching.
    """
    nq = queries.shape[0]
    out_ids = np.full((nq, k), -1, np.int64)
    out_scores = np.full((nq, k), -np.inf, np.float32)
    n_scanned = np.zeros(nq, np.int64)
    n_chunks = max(1, min(nq, n_threads))
    slots = data.shape[0] + L + (k if L < k else 0)  # heap_slots
    for c in prange(n_chunks):
        visited = np.zeros(data.shape[0], np.int32)  # one per thread, reused through epochs
        heap_s = np.empty(slots, np.float32)  # workspace of search_one
        heap_i = np.empty(slots, np.int64)
        lo = c * nq // n_chunks
        hi = (c + 1) * nq // n_chunks
        for qi in range(lo, hi):
            n_scanned[qi] = search_one(data, nbrs, degree, queries[qi], entries[qi], L, visited, qi - lo + 1,
                                       heap_s, heap_i, out_ids[qi], out_scores[qi])
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


@njit(cache=True, nogil=True, inline="always")
def _prefetch_keys(data, fresh, m):
    """Prefetch the key rows of the m nodes ``fresh[:m]``."""
    for j in range(m):
        for c in range(0, data.shape[1], 16):
            _prefetch(data, fresh[j], c)


@njit(cache=True, nogil=True, inline="always")
def _prefetch_row(nbrs, degree, node):
    """Prefetch ``node``'s adjacency row and degree."""
    _prefetch(degree, node, 0)
    for c in range(0, nbrs.shape[1], 16):
        _prefetch(nbrs, node, c)


@njit(cache=True, nogil=True)
def search_heads(keys, nbrs, degree, entries, queries, L, visited, epoch, heap_s, heap_i, out_ids, out_scores, n_scanned):
    """Search graph i (``keys[i]``, ``nbrs[i]``, ``degree[i]``, ``entries[i]``: numba typed Lists) with ``queries[i]``:
    one call for all the query heads of a layer, on the calling thread, the searches interleaved.

    In the decoder a layer's graphs are cold (30 layers' keys and rows cycle through the caches
    every token), so a search is a chain of dependent DRAM misses: the expanded node's row, then
    its new neighbours' key rows. Here head i runs one stage and prefetches what its next stage
    reads, and every other head runs a stage before head i comes back, so the misses of all heads
    overlap. Stage A: read the popped node's row (first: the entry points), mark its unvisited
    neighbours, prefetch their keys. Stage B: score them, update the heaps, pop the next node,
    prefetch its row. Each head performs exactly :func:`search_one`'s operations in the same order
    (same results and counts) for L ≥ k (k = ``out_ids.shape[1]``); L < k (a top-k heap besides
    the beam) is search_one's alone.

    ``visited`` (H, ≥ n) int32 (a row per head: the searches run at once) marked with ``epoch``;
    ``heap_s``/``heap_i`` (H, ≥ n + L).
    """
    if out_ids.shape[1] > L:
        raise ValueError("search_heads needs L >= k: search_one keeps the top-k heap of L < k")
    nh = queries.shape[0]
    width = 1
    for h in range(nh):
        width = max(width, nbrs[h].shape[1], entries[h].shape[0])
    fresh = np.empty((nh, width), np.int64)
    fresh_s = np.empty(width, np.float32)
    nf = np.zeros(nh, np.int64)
    node_of = np.zeros(nh, np.int64)
    nr = np.zeros(nh, np.int64)
    nc = np.zeros(nh, np.int64)
    stage = np.ones(nh, np.int8)  # 0: A next, 1: B next, 2: finished
    for h in range(nh):  # stage A of the entry points (the same hubs every step)
        nf[h] = _fresh(entries[h], visited[h], epoch, fresh[h])
        _prefetch_keys(keys[h], fresh[h], nf[h])
        n_scanned[h] = 0
    active = nh
    while active > 0:
        for h in range(nh):
            if stage[h] == 0:
                node = node_of[h]
                nf[h] = _fresh(nbrs[h][node, :degree[h][node]], visited[h], epoch, fresh[h])
                _prefetch_keys(keys[h], fresh[h], nf[h])
                stage[h] = 1
            elif stage[h] == 1:
                data = keys[h]
                q = queries[h]
                rs = heap_s[h, :L]
                ri = heap_i[h, :L]
                cs = heap_s[h, L:]
                ci = heap_i[h, L:]
                m = nf[h]
                for j in range(m):  # as in search_one: the inner products, then the heap updates
                    fresh_s[j] = dot(data[fresh[h, j]], q)
                n_scanned[h] += m
                a = nr[h]
                b = nc[h]
                for j in range(m):
                    a, b = _offer(rs, ri, cs, ci, a, b, L, fresh_s[j], fresh[h, j])
                node, b = _pop_next(rs, cs, ci, a, b, L)
                nr[h] = a
                nc[h] = b
                if node >= 0:
                    node_of[h] = node
                    _prefetch_row(nbrs[h], degree[h], node)
                    stage[h] = 0
                else:
                    stage[h] = 2
                    active -= 1
    for h in range(nh):  # each beam, best first, padded
        _drain(heap_s[h, :L], heap_i[h, :L], nr[h], out_ids[h], out_scores[h])


class GraphGroup:
    """The arrays of several graph indexes, cached for :func:`search_heads` (one search per index, one call).

    Each index exposes ``graph_arrays()`` → (keys, nbrs, degree) and ``entries_for(queries)``;
    the entry points are assumed not to depend on the query (roargraph: hubs + newest keys), so
    they are read once here. Build the group once after the indexes are built and call
    :meth:`refresh` after any ``add`` (which reallocates keys/nbrs and may add entry points);
    :meth:`current` says whether that is needed. Indexes of a GQA group share one key array
    (``KeyStore``): the typed list holds that array once per head, without copying it.

    The visited rows and heaps are a per-thread workspace shared by every group (the decoder's
    worker searches one layer after another) and by :func:`search_single`, sized by the largest
    search seen.
    """

    def __init__(self, indexes) -> None:
        import weakref

        self._refs = [weakref.ref(ix) for ix in indexes]  # weak: a cached group must not keep its indexes alive
        self.refresh()

    @property
    def indexes(self) -> list:
        return [ref() for ref in self._refs]

    def refresh(self) -> None:
        from numba import typed, types

        def ro(dtype, ndim):  # read-only element types: writable arrays go in as they are, read-only ones too
            return types.Array(dtype, ndim, "C", readonly=True)

        self.keys = typed.List.empty_list(ro(types.float32, 2))
        self.nbrs = typed.List.empty_list(ro(types.int32, 2))
        self.degree = typed.List.empty_list(ro(types.int32, 1))
        self.entries = typed.List.empty_list(ro(types.int64, 1))
        self._seen = []  # (nbrs, degree, n) per index, to tell when an add() has replaced them
        for index in self.indexes:
            keys, nbrs, degree = index.graph_arrays()
            self.keys.append(np.ascontiguousarray(keys, dtype=np.float32))
            self.nbrs.append(np.ascontiguousarray(nbrs, dtype=np.int32))
            self.degree.append(np.ascontiguousarray(degree, dtype=np.int32))
            probe = np.zeros((1, keys.shape[1]), np.float32)
            self.entries.append(np.ascontiguousarray(index.entries_for(probe)[0], dtype=np.int64))
            self._seen.append((nbrs, degree, keys.shape[0]))
        self.n_max = max((k.shape[0] for k in self.keys), default=0)

    def current(self) -> bool:
        """True when no index has changed its arrays since the last refresh."""
        for index, (nbrs, degree, n) in zip(self.indexes, self._seen):
            if index is None:
                return False
            keys, nb, dg = index.graph_arrays()
            if nb is not nbrs or dg is not degree or keys.shape[0] != n:
                return False
        return True

    def search(self, queries: np.ndarray, k: int, L: int, out_ids: np.ndarray | None = None):
        """Top-k of index i for ``queries[i]`` with beam L (:func:`search_heads`; L < k, the k best of every
        node scanned: :func:`search_one` per index); ``SearchResult`` of (H, k) ids, scores, (H,) n_scanned.

        ``out_ids`` (H, k) int64, C-contiguous, may be given to receive the ids in place.
        """
        from anns_lab.indexes.base import SearchResult

        h = len(self._refs)
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.ndim != 2 or q.shape[0] != h:
            raise ValueError(f"GraphGroup: {h} indexes need {h} queries, got shape {q.shape}")
        visited, heap_s, heap_i, epoch = _workspace(h, self.n_max, L, k)
        ids = np.empty((h, k), np.int64) if out_ids is None else out_ids
        scores = np.empty((h, k), np.float32)
        n_scanned = np.empty(h, np.int64)
        if L < k:  # not the decoder's case: one search after another (each index's own search: the same kernel)
            for i in range(h):
                n_scanned[i] = search_one(self.keys[i], self.nbrs[i], self.degree[i], q[i], self.entries[i], L, visited[i],
                                          epoch, heap_s[i], heap_i[i], ids[i], scores[i])
        else:
            search_heads(self.keys, self.nbrs, self.degree, self.entries, q, L, visited, epoch, heap_s, heap_i, ids,
                         scores, n_scanned)
        return SearchResult(ids, scores, n_scanned)


_LOCAL = threading.local()


def _workspace(h: int, n: int, L: int, k: int = 0):
    """This thread's (visited (≥h, ≥n) int32, heap_s, heap_i (≥h, ≥ heap_slots(n, L, k))) and a fresh epoch,
    for one search_heads call or one search_one per row."""
    ws = getattr(_LOCAL, "ws", None)
    slots = heap_slots(n, L, k)
    if ws is None or ws[0].shape[0] < h or ws[0].shape[1] < n or ws[1].shape[1] < slots:
        hh = max(h, ws[0].shape[0] if ws else 0)
        nn = max(n, ws[0].shape[1] if ws else 0)
        width = max(nn + slots - n, ws[1].shape[1] if ws else 0)
        ws = [np.zeros((hh, nn), np.int32), np.empty((hh, width), np.float32), np.empty((hh, width), np.int64), 0]
        _LOCAL.ws = ws
    if ws[3] >= 2**31 - 2:
        ws[0][:] = 0
        ws[3] = 0
    ws[3] += 1
    return ws[0], ws[1], ws[2], ws[3]


_GROUPS: "weakref.WeakKeyDictionary" = None  # first index → (ids of all, GraphGroup), for search_graphs


def search_graphs(indexes, queries: np.ndarray, k: int, L: int):
    """Search graph ``indexes[i]`` (exposing ``graph_arrays()`` and ``entries_for(q)``) with ``queries[i]``, in one kernel call.

    Returns a ``SearchResult`` of ids (H, k), scores (H, k), n_scanned (H,): exactly what
    ``indexes[i].search(queries[i:i+1], k, L=L)`` returns for each i (for roargraph, whose search is
    :func:`search_one`, the same operations in the same order; tests check it). The :class:`GraphGroup`
    of the same list of indexes is kept between calls (weakly, by the first index) and
    refreshed when an index has changed; a caller searching the same indexes every step may
    hold its own group instead and skip that check.
    """
    import weakref

    global _GROUPS
    if _GROUPS is None:
        _GROUPS = weakref.WeakKeyDictionary()
    indexes = list(indexes)
    tag = tuple(id(ix) for ix in indexes)
    stamp = tuple(ix.n_keys for ix in indexes)  # a graph's arrays change only in add(), which raises n_keys
    hit = _GROUPS.get(indexes[0])
    if hit is not None and hit[0] == tag and all(a is b for a, b in zip(hit[1].indexes, indexes)):  # ids alone could be reused
        group = hit[1]
        if hit[2] == stamp:  # cheaper than current(): the decoder calls this for every layer and step
            return group.search(queries, k, L)
        group.refresh()
    else:
        group = GraphGroup(indexes)
    _GROUPS[indexes[0]] = (tag, group, stamp)
    return group.search(queries, k, L)
