"""One kernel call that searches the graphs of several heads (a layer's query heads in the decoder).

A decoder's graphs are cold (30 layers' keys and rows cycle through the caches every token), so
one search is a chain of dependent DRAM misses: the expanded node's row, then its new neighbours'
key rows. Here the searches are interleaved: head h runs one stage and prefetches what its next
stage reads, and every other head runs a stage before h comes back, so the misses of all heads
overlap. Each head performs exactly :func:`search.search_one`'s operations in the same order.
"""

from __future__ import annotations

import weakref

import numpy as np
from numba import njit

from anns_lab.indexes.base import SearchResult
from anns_lab.indexes.graph.search import bytes_read, mark_added, row_need, score_fresh, search_one, walk_row
from anns_lab.indexes.graph.simd import prefetch_keys, prefetch_row
from anns_lab.indexes.graph.utils import drain, mark_fresh, offer_all, pop_next, thread_workspace


@njit(cache=True, nogil=True, inline="always")
def _walk(row, pos, deg, need, full, first_added, visited, memo, epoch, worst, fresh):
    """One stage of an expansion's walk along ``row[:deg]`` from ``pos`` (``search_one``'s step): the whole row
    (``full``), the added keys (ids ≥ ``first_added``) of its rest once the walk has stopped (``need`` ≤ 0), or
    :func:`search.walk_row`. Returns (fresh nodes, next position, hits, misses, adjacency words read)."""
    if full:
        return mark_fresh(row[:deg], visited, epoch, fresh), deg, 0, 0, deg
    if need <= 0:
        return mark_added(row[pos:deg], first_added, visited, epoch, fresh), deg, 0, 0, deg - pos
    m, at, a, x = walk_row(row[:deg], pos, need, visited, epoch, memo, worst, fresh)
    return m, at, a, x, at - pos


@njit(cache=True, nogil=True)
def search_heads(graphs, queries, L, stop, ws, epoch, out, hints):
    """Search graph h of ``graphs`` = (keys, nbrs, degree, entries, added) (tuples of arrays, one per head;
    ``added`` (H,): the first id added after each build) with ``queries[h]``, all heads on the calling thread,
    interleaved, row stop ``stop`` = (C, ρ) (A = ``added[h]``); writes ``out`` = (ids (H, k), scores (H, k),
    n_scanned (H,), n_words (H,)). ``hints`` (E,) int64: ids every head also enters at, after its own entry
    points (the decoder's copy hints; empty: none; each must be < every head's number of keys).

    A head's turn is one stage. A: the expanded node's row has arrived: walk its first stage (mark the unvisited
    neighbours, prefetch their keys). B: score them, update the heaps; if the walk goes on along the same row
    (in cache now), walk its next stage at once and prefetch those keys; else pop the next node and prefetch its
    row. ``ws`` is a :class:`utils.Workspace` with a row per head ((H, ≥ n) visited and memo, (H, ≥ n + L) heaps)
    stamped with ``epoch``. Needs L ≥ k (the top-k heap of L < k is search_one's alone).

    The per-head arrays come as tuples, not numba typed lists: a typed list's item is a call into numba's C
    helpers (and a reference count) on every access, ~12% of a cold layer's search (BENCHMARKS "CPU side per
    layer"); a tuple is compiled per head count.
    """
    if out[0].shape[1] > L:
        raise ValueError("search_heads needs L >= k: search_one keeps the top-k heap of L < k")
    nbrs, entries, nh = graphs[1], graphs[3], queries.shape[0]
    width = 1
    for h in range(nh):
        width = max(width, nbrs[h].shape[1], entries[h].shape[0] + hints.shape[0])
    scratch = (np.empty((nh, width), np.int64), np.empty(width, np.float32), np.zeros((9, nh), np.int64),
               np.ones(nh, np.int8))
    _search_heads(graphs, queries, L, stop, ws, epoch, out, scratch, hints)


@njit(cache=True, nogil=True, _nrt=False)
def _search_heads(graphs, queries, L, stop, ws, epoch, out, scratch, hints):
    """:func:`search_heads` on its allocated ``scratch`` = (fresh (H, width), their scores (width,), per-head state
    (9, H) zeros, stage (H,) ones). Compiled without numba's reference counting (``_nrt=False``: it allocates
    nothing): each array view the loop takes (a head's workspace row, heap, key row) would otherwise cost an
    atomic increment and decrement, ~10% of a cold layer's search (BENCHMARKS "CPU side per layer")."""
    keys, nbrs, degree, entries, added = graphs
    visited, heap_s, heap_i, _, memo = ws
    out_ids, out_scores, n_scanned, n_words = out
    fresh, fresh_s, state, stage = scratch  # stage: 0: A next, 1: B next, 2: finished
    full = stop[0] <= 0
    nh = queries.shape[0]
    nf, nr, nc = state[0], state[1], state[2]  # per head: fresh nodes, beam and frontier sizes; the node being
    node_of, pos, deg = state[3], state[4], state[5]  # expanded, its row position and degree, its walk's hits and
    hits, misses, need = state[6], state[7], state[8]  # misses, and the misses that stop its first stage
    for h in range(nh):  # stage A of the entry points (the same hubs every step), then the step's hints
        node_of[h] = -1
        m = mark_fresh(entries[h], visited[h], epoch, fresh[h])
        nf[h] = m + mark_fresh(hints, visited[h], epoch, fresh[h, m:])
        prefetch_keys(keys[h], fresh[h], nf[h])
        n_scanned[h] = n_words[h] = 0
    active = nh
    while active > 0:
        for h in range(nh):
            st = stage[h]
            if st == 2:
                continue
            data = keys[h]
            if st == 0:
                worst = heap_s[h, 0] if nr[h] == L else -np.inf
                m, at, a, x, w = _walk(nbrs[h][node_of[h]], 0, deg[h], need[h], full, added[h], visited[h], memo[h],
                                       epoch, worst, fresh[h])
                nf[h] = m
                n_words[h] += w
                pos[h], hits[h], misses[h] = at, hits[h] + a, misses[h] + x
                prefetch_keys(data, fresh[h], m)
                stage[h] = 1
                continue
            m = nf[h]
            score_fresh(data, queries[h], fresh[h], m, fresh_s)
            n_scanned[h] += m
            if not full:
                for j in range(m):
                    memo[h, fresh[h, j]] = fresh_s[j]
            rs, ri = heap_s[h, :L], heap_i[h, :L]
            cs, ci = heap_s[h, L:], heap_i[h, L:]
            a, b = offer_all(rs, ri, cs, ci, nr[h], nc[h], fresh[h, :m], fresh_s[:m])
            hits[h] += b - nc[h]  # a node enters the frontier exactly when it enters the beam
            misses[h] += m - (b - nc[h])
            nr[h] = a
            nc[h] = b
            node = node_of[h]
            if node >= 0 and pos[h] < deg[h]:
                nd = row_need((stop[0], stop[1], added[h]), hits[h], misses[h])
                if nd > 0 or added[h] < data.shape[0]:  # the walk goes on along the same row, or its added keys
                    worst = rs[0] if a == L else -np.inf
                    m, at, x1, x2, w = _walk(nbrs[h][node], pos[h], deg[h], nd, full, added[h], visited[h], memo[h],
                                             epoch, worst, fresh[h])
                    nf[h] = m
                    n_words[h] += w
                    pos[h], hits[h], misses[h] = at, hits[h] + x1, misses[h] + x2
                    prefetch_keys(data, fresh[h], m)
                    continue
            node, b = pop_next(rs, cs, ci, a, b, L)
            nc[h] = b
            if node >= 0:
                node_of[h] = node
                dg = degree[h]
                deg[h] = dg[node]
                pos[h] = hits[h] = misses[h] = 0
                need[h] = row_need((stop[0], stop[1], added[h]), 0, 0)
                n_words[h] += 1
                prefetch_row(nbrs[h], dg, node)
                stage[h] = 0
            else:
                stage[h] = 2
                active -= 1
    for h in range(nh):  # each beam, best first, padded
        drain(heap_s[h, :L], heap_i[h, :L], nr[h], out_ids[h], out_scores[h])


def own_defaults(cls, L: int | None, stop: tuple | None) -> tuple[int, tuple]:
    """(L, row stop (C, ρ)) with each None replaced by the index class ``cls``'s own default search parameters (``L``, and
    ``row_misses``/``row_credit`` where it declares them, else full rows): a group search with defaults is then the
    index's own default search, and the defaults live in one place, the index class's ``search_params``."""
    params = cls.search_params
    if L is None:
        L = params["L"].default
    if stop is None:
        stop = (params["row_misses"].default, params["row_credit"].default) if "row_misses" in params else (0, 0.0)
    return L, stop


def _kernel_array(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as :func:`search_heads`' tuples hold it: C-contiguous, aligned, ``dtype``, a read-only view (no copy
    where it already is so), so that every head's array has one numba type and a tuple of them is homogeneous."""
    view = np.require(a, dtype, ["C", "A"]).view()
    view.flags.writeable = False
    return view


class GraphGroup:
    """The arrays of several graph indexes (``graph_arrays()``, ``entries_for(q)``), cached for :func:`search_heads`.

    The entry points must not depend on the query (roargraph: hubs + newest keys): they are read
    once. Call :meth:`refresh` after any ``add`` (:meth:`current` says whether one is needed). A GQA
    group's shared key array is held once per head without a copy (read-only views); the workspace is the thread's.
    """

    def __init__(self, indexes) -> None:
        self._refs = [weakref.ref(ix) for ix in indexes]  # weak: a cached group must not keep its indexes alive
        self._cls = type(indexes[0])  # whose search_params give the defaults (own_defaults)
        self.refresh()

    @property
    def indexes(self) -> list:
        return [ref() for ref in self._refs]

    def refresh(self) -> None:
        keys, nbrs, degree, entries, seen = [], [], [], [], []
        self.added = np.empty(len(self._refs), np.int64)  # the first key id each index added after its build
        for i, index in enumerate(self.indexes):
            k, nb, dg = index.graph_arrays()
            keys.append(_kernel_array(k, np.float32))
            nbrs.append(_kernel_array(nb, np.int32))
            degree.append(_kernel_array(dg, np.int32))
            probe = np.zeros((1, k.shape[1]), np.float32)
            entries.append(_kernel_array(index.entries_for(probe)[0], np.int64))
            self.added[i] = getattr(index, "n_built", k.shape[0])
            seen.append((nb, dg, k.shape[0]))
        self._seen = seen  # (nbrs, degree, n) per index, to tell when an add() has replaced them
        self.keys, self.nbrs, self.degree, self.entries = tuple(keys), tuple(nbrs), tuple(degree), tuple(entries)
        self.lists = (self.keys, self.nbrs, self.degree, self.entries, self.added)
        self.n_entries = np.array([len(e) for e in entries], np.int64)
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

    def search(self, queries: np.ndarray, k: int, L: int | None = None, stop: tuple | None = None,
               hints: np.ndarray | None = None) -> SearchResult:
        """Top-k of index i for ``queries[i]`` with beam L and row stop ``stop`` = (C, ρ) (:func:`search_heads`; L < k,
        the k best of every node scanned: :func:`search_one` per index), each None: the indexes' own default
        (:func:`own_defaults`): (H, k) ids and scores, (H,) n_scanned and bytes_read. ``hints``: key ids every
        search also enters at (scanned and counted like the entry points; ids outside every index are dropped)."""
        L, stop = own_defaults(self._cls, L, stop)
        hints = self._hints(hints)
        h = len(self._refs)
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.ndim != 2 or q.shape[0] != h:
            raise ValueError(f"GraphGroup: {h} indexes need {h} queries, got shape {q.shape}")
        ws, rows, epoch = thread_workspace(h, self.n_max, L, k)
        stop = (int(stop[0]), float(stop[1]), 0)
        ids = np.empty((h, k), np.int64)
        scores = np.empty((h, k), np.float32)
        n_scanned, n_words = np.empty(h, np.int64), np.empty(h, np.int64)
        if L < k:  # not the decoder's case: one search after another (each index's own search: the same kernel)
            for i in range(h):
                g = (self.keys[i], self.nbrs[i], self.degree[i])
                entries = np.concatenate([self.entries[i], hints]) if len(hints) else self.entries[i]
                n_scanned[i], n_words[i], _ = search_one(g, q[i], entries, L, rows[i], epoch, ids[i], scores[i],
                                                         (stop[0], stop[1], int(self.added[i])))
        else:
            search_heads(self.lists, q, L, stop, ws, epoch, (ids, scores, n_scanned, n_words), hints)
        # one numpy call for all heads (µs per layer)
        n_bytes = bytes_read(q.shape[1], n_scanned, n_words, self.n_entries + len(hints))
        return SearchResult(ids, scores, n_scanned, n_bytes)

    def _hints(self, hints: np.ndarray | None) -> np.ndarray:
        """``hints`` as the kernels take them: int64 ids below every index's number of keys, first occurrence kept."""
        if hints is None:
            return _NO_HINTS
        h = np.asarray(hints, np.int64).ravel()
        n_min = min(k.shape[0] for k in self.keys)
        h = h[(h >= 0) & (h < n_min)]
        _, first = np.unique(h, return_index=True)
        return np.ascontiguousarray(h[np.sort(first)])


_NO_HINTS = np.empty(0, np.int64)
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # first index → (ids of all, GraphGroup)


def search_graphs(indexes, queries: np.ndarray, k: int, L: int | None = None, stop: tuple | None = None,
                  hints: np.ndarray | None = None):
    """Search graph index ``indexes[i]`` with ``queries[i]`` in one kernel call, beam L and row stop ``stop`` = (C, ρ) (None:
    the indexes' own defaults), entering also at the key ids ``hints`` (:meth:`GraphGroup.search`): without hints, a
    ``SearchResult`` equal to each index's own search of ``queries[i:i+1]`` with them. The
    :class:`GraphGroup` of the same indexes is kept between calls (weakly, by the first index) and refreshed when an index
    has changed."""
    indexes = list(indexes)
    tag = tuple(id(ix) for ix in indexes)
    stamp = tuple(ix.n_keys for ix in indexes)  # a graph's arrays change only in add(), which raises n_keys
    hit = _GROUPS.get(indexes[0])
    if hit is not None and hit[0] == tag and all(a is b for a, b in zip(hit[1].indexes, indexes)):  # ids alone could be reused
        group = hit[1]
        if hit[2] == stamp:  # cheaper than current(): the decoder calls this for every layer and step
            return group.search(queries, k, L, stop, hints)
        group.refresh()
    else:
        group = GraphGroup(indexes)
    _GROUPS[indexes[0]] = (tag, group, stamp)
    return group.search(queries, k, L, stop, hints)
