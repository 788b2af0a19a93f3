"""``roargraph``: an attention-aware key graph built from the prefill queries (RoarGraph, Chen et al. VLDB 2024).

Build, on keys K (n, d) and training queries Q (m, d):

1. **Bipartite graph.** Each training query's exact top-``M_sq`` keys by inner product
   (``graph_build.topk_ip``: blocked matmul, never an m × n matrix).
2. **Projection onto keys.** RoarGraph hangs each query's neighbours on its top-1 key (the
   pivot). On real attention the top-1 keys are a few hundred sinks and heavy hitters, which
   starves every other key, so here *each of the query's first* ``n_pivots`` *keys* is a pivot
   (``n_pivots = 1`` is the published rule). A pivot's candidates are the other keys of the
   queries it pivots for, merged by id with summed query weights (co-occurrence) times
   (the key's occurrences in all lists)^−``idf`` — sinks sit in every list and would head every
   pivot's order — the ``max_cand`` heaviest kept, then RobustPrune (inner-product rule, ``alpha``) to ``M`` in
   that order (``graph_build.project_rows``, parallel over keys).
3. **Reverse edges**, rows over ``R`` RobustPruned (two-phase, lock-free). Capping them at ``R``
   rather than ``M`` lets a heavy hitter link back to the many mid-ranked keys that chose it.
4. **Reachability.** About half the keys of a real head are in no training query's top list and
   have empty rows: they get their nearest keys as out-edges (``link_stranded``, one blocked
   kNN), then every key not reachable from the entry points gets an in-edge
   (``link_unreachable``). The published connectivity enhancement (every key searched for on
   the graph and linked from what it found, beam ``enhance_L``) is off by default: on real
   heads it filled rows with links to keys no query wants, costing scans, not recall.

Search: best-first search with a beam of width ``L`` (two heaps, ``graph_search.search_one``) started
from all entry points at once; the k best of every node scanned are returned, so ``L`` < k is a valid,
cheaper operating point (the beam expands the best L, the rest of a query's top keys are their
neighbours). The entry points are ``n_hubs`` hub keys — the top-1 key of each k-means centroid of
the training queries (a coarse step: each hub's inner product is computed and counted like any
node) — plus the ``recent_entries`` newest keys. ``n_scanned`` counts every inner product: hubs,
recent entries and every node evaluated, once each.

Training-query weighting: the newest ``recent_frac`` of the training queries weigh
``recent_weight`` times more in the co-occurrence merge (decode queries look like late
prefill queries more than like early ones: post-RoPE drift).

Decoder-facing: ``add`` costs what the new keys cost, not what the index holds. The build caches
the top-``M_sq`` keys and scores of each kept recent query (``keep_queries``); ``add`` scores those
queries against the new keys only and merges a new key into the lists of the queries whose last
score it beats (it is *selected*; the lists stay each query's exact top-``M_sq``). A selected key's
row is projected from the selecting queries' lists as the build projects (co-occurrence, idf,
RobustPrune; every rank a pivot, as the kept queries are few) and its neighbours get reverse edges
(RobustPrune when full). Every new key is then searched for on the graph and linked from what the
search finds (its out-edges too when no kept query selected it, as the build's stranded keys get
their nearest keys), and reachability from the hubs is restored (a pruned row may have cut a key's
only way in). Only new rows and their neighbours' rows are written, in place; the adjacency grows
with spare capacity, so an add copies the graph only when it outgrows it. ``save``/``load`` (the cached lists
included); keys live in a :class:`key_store.KeyStore` shared by indexes built on the same array
(one GQA group).
"""

from __future__ import annotations

import faiss
import numba
import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes import graph_build as gb
from anns_lab.indexes import graph_search as gs
from anns_lab.indexes.base import Index, Param
from anns_lab.indexes.key_store import KeyStore

STRANDED_POOL = 8192  # candidate out-neighbours of a stranded key (see link_stranded)
ADD_SERIAL = 1024  # adds of up to this many keys run on the calling thread: a thread-pool launch costs ms on a loaded machine
ADD_SEARCH_L = 16  # beam of the search that links each added key (32: the same recall, 1.5x the time)
KMEANS_POINTS = 64  # training points per hub centroid (faiss subsamples): 256 took a quarter of the build


def query_hubs(keys: np.ndarray, queries: np.ndarray, n_hubs: int, seed: int) -> np.ndarray:
    """Up to ``n_hubs`` distinct keys: the top-1 key of each k-means centroid of ``queries`` (plus the
    key of largest inner product with the mean query, always first)."""
    mean_top = int(np.argmax(keys @ queries.mean(axis=0)))
    if n_hubs <= 1 or len(queries) < 2:
        return np.array([mean_top], np.int64)
    c = min(n_hubs, len(queries))
    km = faiss.Kmeans(queries.shape[1], c, niter=10, seed=seed, verbose=False, min_points_per_centroid=1,
                      max_points_per_centroid=KMEANS_POINTS)
    km.train(np.ascontiguousarray(queries))
    top = gb.topk_ip(km.centroids, keys, 1)[:, 0].astype(np.int64)
    hubs = [mean_top] + [int(h) for h in top]
    return np.array(list(dict.fromkeys(hubs)), np.int64)  # unique, order kept


def subsample(queries: np.ndarray, at_most: int) -> np.ndarray:
    """At most ``at_most`` rows of ``queries`` at an even stride, counted back from the newest (always kept):
    neighbouring prefill queries select nearly the same keys, so a stride loses little of the bipartite graph."""
    m = len(queries)
    if m <= at_most:
        return queries
    idx = np.round(np.linspace(m - 1, 0, at_most)).astype(np.int64)[::-1]
    return np.ascontiguousarray(queries[np.unique(idx)])


def link_stranded(keys: np.ndarray, nbrs: np.ndarray, degree: np.ndarray, entries: np.ndarray, k: int) -> None:
    """Out-edges for the keys that the projection left unreachable with an empty row (keys in no training
    query's top list: about half of them on real heads): their ``k`` nearest keys by inner product, one
    blocked kNN for all of them. ``link_unreachable`` then finds each an in-edge among its (or its
    neighbours') reachable neighbours instead of scanning every key per stranded key."""
    reach = gs.reachable_from(nbrs, degree, entries)
    stranded = np.flatnonzero(~reach & (degree == 0))
    if len(stranded) == 0:
        return
    # Nearest among (a stride of at most STRANDED_POOL) reachable keys: these keys are in no query's
    # list, so they need a way in, not a fine neighbourhood; at 32K a full kNN of 27K stranded keys
    # cost as much as the bipartite graph itself.
    pool = np.flatnonzero(reach)
    pool = pool[:: max(1, len(pool) // STRANDED_POOL)]
    near = pool[gb.topk_ip(keys[stranded], keys[pool], k)]
    for t, row in zip(stranded, near):
        row = row[row != t][:k]
        nbrs[t, : len(row)] = row
        degree[t] = len(row)


def link_tail(keys, nbrs, degree, knn, ptr, occ_q, occ_r, n_links, alpha, R):
    """In-edges for the keys left rowless (in some query's top list, nobody's pivot): from the key
    ranked just above it in each of its ``n_links`` best-ranked queries (a key a search for such a
    query is likely to have reached), appended where the source row has room."""
    tail = np.flatnonzero((degree == 0) & (np.diff(ptr) > 0))
    props = np.full((len(tail), n_links), -1, np.int32)
    for i, t in enumerate(tail):
        o = np.arange(ptr[t], min(ptr[t + 1], ptr[t] + n_links))
        r = occ_r[o]
        src = knn[occ_q[o], np.maximum(r - 1, 0)]
        props[i, : len(src)] = np.where(r > 0, src, -1)
    ptr_in, src_in = gb._props_to_incoming(props, tail.astype(np.int64), len(keys))
    return gb._merge_rows(keys, nbrs, degree, ptr_in, src_in, alpha, R, False)


class RoarGraphIndex(Index):
    """Projected query→key bipartite graph with connectivity enhancement; counted multi-entry beam search."""

    name = "roargraph"
    uses_train_queries = True
    build_params = {
        "M": Param(12, 2, 512, help="out-degree of the projection (RobustPrune target)"),
        "R": Param(24, 2, 1024, help="row capacity after reverse edges and linking (≥ M)"),
        "M_sq": Param(100, 1, 4096, help="keys per training query in the bipartite graph (its exact top-M_sq)"),
        "n_pivots": Param(30, 1, 4096, help="pivot rank: each of a query's first n_pivots keys takes its other keys as candidates (1 = RoarGraph)"),
        "idf": Param(0.25, 0.0, 4.0, help="candidate weight = co-occurrence × (key's total occurrences)^-idf"),
        "tail_links": Param(4, 0, 4096, help="in-edges of a rowless key from the key ranked just above it in its best queries"),
        "n_sel": Param(32, 1, 1 << 20, help="queries per pivot key (those where it ranks best; newest first on ties)"),
        "n_cand": Param(100, 2, 4096, help="how many of a query's keys are candidates of its pivots (≤ M_sq)"),
        "max_cand": Param(128, 2, 1 << 16, help="candidates per key kept (heaviest co-occurrence) before pruning"),
        "alpha": Param(1.2, 0.0, 4.0, help="RobustPrune α of the projection (inner-product rule; > 1 prunes less; 0 = no pruning)"),
        "max_train": Param(1 << 20, 1, 1 << 30, help="training queries used at most: an even stride over them, the newest always kept (build time)"),
        "enhance_L": Param(0, 0, 4096, help="beam width of the connectivity-enhancement search (0 = skip it)"),
        "M_link": Param(8, 1, 512, help="links per key from the enhancement search / out-edges of a stranded key"),
        "n_hubs": Param(32, 1, 4096, help="entry hubs: top key of each k-means centroid of the training queries (all counted)"),
        "recent_entries": Param(0, 0, 4096, help="the newest keys (highest ids) also used as entry points (counted)"),
        "recent_frac": Param(0.0, 0.0, 1.0, help="newest fraction of training queries given recent_weight"),
        "recent_weight": Param(1.0, 0.0, 1000.0, help="weight of those queries in the co-occurrence merge (0 drops them)"),
        "keep_queries": Param(256, 0, 1 << 20, help="newest training queries kept for add() (0 = link new keys by key search only)"),
        "seed": Param(0, 0, 2**31 - 1, help="k-means seed of the hubs"),
    }
    search_params = {"L": Param(100, 1, 1 << 16, help="beam width (L < k allowed: the k best of all scanned are returned)")}
    search_grid = {"L": (50, 60, 70, 80, 90, 100, 120, 150, 200, 250, 300, 400, 500, 600, 800, 1200)}

    # -- build -------------------------------------------------------------------------------------

    def _check(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        p = self.params
        if train_queries is None:
            raise IndexConfigError(f"{self._owner()}: this index is built from train_queries (the prefill queries); pass them to build()")
        n = len(keys)
        if p["M"] >= n:
            raise IndexConfigError(f"{self._owner()}: M={p['M']} must be smaller than the number of keys ({n})")
        if p["R"] < p["M"]:
            raise IndexConfigError(f"{self._owner()}: R={p['R']} must be at least M={p['M']}")

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        self._check(keys, train_queries)
        p = self.params
        n = len(keys)
        threads = numba.get_num_threads()
        m_sq = min(p["M_sq"], n)
        train_queries = subsample(train_queries, p["max_train"])
        knn = gb.topk_ip(train_queries, keys, m_sq)
        weights = np.ones(len(train_queries), np.float32)
        if p["recent_frac"] > 0:
            weights[len(weights) - int(round(p["recent_frac"] * len(weights))):] = p["recent_weight"]
        nbrs = np.full((n, p["R"]), -1, np.int32)
        degree = np.zeros(n, np.int32)
        ptr, occ_q, occ_r = gb.key_occurrences(knn, n, m_sq)
        key_weight = None
        if p["idf"] > 0:  # down-weight keys that are in every list (sinks) in each pivot's candidate order
            key_weight = (np.diff(ptr).astype(np.float32) + 1.0) ** np.float32(-p["idf"])
        gb.project_rows(keys, knn, weights, ptr, occ_q, occ_r, p["n_pivots"], p["n_sel"], p["n_cand"],
                        p["max_cand"], p["alpha"], p["M"], nbrs, degree, threads, key_weight)
        pa = max(p["alpha"], 1.0)  # the reverse/enhancement prunes always use the RobustPrune rule
        nbrs, degree = gb.add_reverse_edges(keys, nbrs, degree, pa, p["R"])
        if p["tail_links"] > 0:
            nbrs, degree = link_tail(keys, nbrs, degree, knn, ptr, occ_q, occ_r, p["tail_links"], pa, p["R"])
        self.hubs = query_hubs(keys, train_queries, p["n_hubs"], p["seed"])
        if p["enhance_L"] > 0:
            nbrs, degree = gb.connect_by_search(keys, nbrs, degree, self.hubs, p["enhance_L"], pa, p["R"],
                                                p["M_link"], threads)
        link_stranded(keys, nbrs, degree, self.hubs, p["M_link"])
        gb.link_unreachable(keys, nbrs, degree, self.hubs, p["R"])
        self._store = KeyStore.for_array(keys)
        self._nbrs_buf, self._deg_buf = nbrs, degree
        self._expose(n)
        keep = min(p["keep_queries"], len(train_queries))
        self._recent_q = np.ascontiguousarray(train_queries[len(train_queries) - keep:])
        self._cache_lists(keys, knn[len(knn) - keep:], weights[len(weights) - keep:])

    def _cache_lists(self, keys: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> None:
        """Keep each kept query's top keys ``ids`` with their scores, best first, padded to M_sq (-1 / -inf)
        for the keys to come: ``add`` compares a new key with the last of them."""
        q, K = self._recent_q, self.params["M_sq"]
        self._q_ids = np.full((len(q), K), -1, np.int32)
        self._q_scores = np.full((len(q), K), -np.inf, np.float32)
        if len(q):
            s = np.einsum("qd,qkd->qk", q, keys[ids])
            order = np.argsort(-s, axis=1, kind="stable")
            self._q_ids[:, : ids.shape[1]] = np.take_along_axis(ids, order, 1)
            self._q_scores[:, : ids.shape[1]] = np.take_along_axis(s, order, 1)
        self._q_w = np.ascontiguousarray(weights, np.float32)

    def _expose(self, n: int) -> None:
        """Rows [0, n) of the adjacency as ``_nbrs``/``_degree`` (views), growing the buffers with spare
        capacity so that an add does not copy the graph; rows past n are empty. Growth by a quarter:
        still amortised O(1) per key, and the hundreds of indexes of a decoder do not double their
        memory on their first add."""
        cap = len(self._deg_buf)
        if n > cap:
            grown = np.full((max(n, cap + cap // 4), self._nbrs_buf.shape[1]), -1, np.int32)
            grown[:cap] = self._nbrs_buf
            deg = np.zeros(len(grown), np.int32)
            deg[:cap] = self._deg_buf
            self._nbrs_buf, self._deg_buf = grown, deg
        self._nbrs, self._degree = self._nbrs_buf[:n], self._deg_buf[:n]

    @property
    def _keys(self) -> np.ndarray:
        return self._store.view(self.n_keys or self._store.n)

    # -- add ---------------------------------------------------------------------------------------

    def _add(self, keys: np.ndarray) -> None:
        p = self.params
        pa = max(p["alpha"], 1.0)
        n0, t = self.n_keys, len(keys)
        n = n0 + t
        self._store.append(n0, keys)
        data = self._store.view(n)
        self._expose(n)
        nbrs, degree = self._nbrs, self._degree  # written in place: only the new rows and their neighbours' change
        threads = 1 if t <= ADD_SERIAL else numba.get_num_threads()
        new = np.arange(n0, n, dtype=np.int64)
        if len(self._recent_q):
            changed = gb.merge_topk(self._q_ids, self._q_scores, self._recent_q, data[n0:], n0)
            if changed.any():
                m_sq = min(p["M_sq"], n)
                sel = np.ascontiguousarray(self._q_ids[changed, :m_sq])  # the selecting queries' updated lists
                ptr, occ_q, occ_r = gb.key_occurrences(sel, n, m_sq)
                rows = new[ptr[new + 1] > ptr[new]]
                key_weight = None
                if p["idf"] > 0:  # as the build, from the lists at hand
                    key_weight = (np.diff(ptr).astype(np.float32) + 1.0) ** np.float32(-p["idf"])
                gb.project_rows(data, sel, self._q_w[changed], ptr, occ_q, occ_r, m_sq, p["n_sel"], p["n_cand"],
                                p["max_cand"], p["alpha"], p["M"], nbrs, degree, threads, key_weight, rows=rows)
                gb.link_back(data, nbrs, degree, rows, pa, p["R"], threads)
        # Every new key is also searched for and linked from the keys it finds (out-edges too for those no
        # kept query selected): in-edges from its own neighbourhood reach it from queries unlike the kept
        # ones (decode queries drift). On SmolLM2 8K heads: new-key recall +0 to +2 points, ~1 ms per 64 keys.
        gb.connect_by_search(data, nbrs, degree, self.hubs, max(p["enhance_L"], ADD_SEARCH_L), pa, p["R"], p["M_link"],
                             threads, targets=new, prune_full=True)
        gb.link_unreachable(data, nbrs, degree, self.hubs, p["R"])  # a pruned row may have cut a key's only way in

    # -- search ------------------------------------------------------------------------------------

    def entries(self) -> np.ndarray:
        """Entry points of every search: the hubs, then the newest keys (cached per key count: a batch-1
        search should not rebuild them)."""
        cached = self.__dict__.get("_entries")
        if cached is not None and cached[0] == self.n_keys and cached[1] is self.hubs:
            return cached[2]
        r = min(self.params["recent_entries"], self.n_keys)
        recent = np.arange(self.n_keys - r, self.n_keys, dtype=np.int64)
        e = np.array(list(dict.fromkeys([*self.hubs.tolist(), *recent.tolist()])), np.int64)
        self._entries = (self.n_keys, self.hubs, e)
        return e

    def entries_for(self, queries: np.ndarray) -> np.ndarray:
        """Entry nodes (nq, E) int64 of each query's search (every one is counted as scanned)."""
        e = self.entries()
        return np.ascontiguousarray(np.broadcast_to(e, (len(queries), len(e))))

    def graph_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, nbrs, degree) as the search kernels take them (see :mod:`graph_search`)."""
        return self._keys, self._nbrs, self._degree

    def _search(self, queries: np.ndarray, k: int, L: int):
        keys, nbrs, degree = self.graph_arrays()
        if len(queries) == 1:  # batch 1 (decoding): on this thread, with its reused workspace
            return gs.search_single(keys, nbrs, degree, queries[0], self.entries(), L, k)
        return gs.beam_search_batch(keys, nbrs, degree, queries, self.entries_for(queries), L, k, numba.get_num_threads())

    @classmethod
    def search_group(cls, indexes, queries, k, L: int = 100):
        """One kernel call for the query heads of a layer (the decoder's per-step search).

        ``graph_search.search_graphs`` runs the heads' beam searches interleaved in one kernel: the same
        nodes and results as :meth:`search` (``graph_search.search_one``), L < k included."""
        return gs.search_graphs(indexes, queries, k, L)

    # -- persistence -------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return (self._keys.nbytes + self._nbrs_buf.nbytes + self._deg_buf.nbytes + self.hubs.nbytes  # spare rows included
                + self._recent_q.nbytes + self._q_ids.nbytes + self._q_scores.nbytes + self._q_w.nbytes)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys, "nbrs": self._nbrs, "degree": self._degree, "hubs": self.hubs,
                "recent_q": self._recent_q, "q_ids": self._q_ids, "q_scores": self._q_scores, "q_w": self._q_w}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        keys = np.ascontiguousarray(arrays["keys"], dtype=np.float32)
        self._store = KeyStore(keys)
        self._nbrs_buf = np.ascontiguousarray(arrays["nbrs"], dtype=np.int32)
        self._deg_buf = np.ascontiguousarray(arrays["degree"], dtype=np.int32)
        self._expose(len(keys))
        self.hubs = arrays["hubs"].astype(np.int64)
        self._recent_q = np.ascontiguousarray(arrays["recent_q"], dtype=np.float32)
        if "q_ids" in arrays:
            self._q_ids = np.ascontiguousarray(arrays["q_ids"], dtype=np.int32)
            self._q_scores = np.ascontiguousarray(arrays["q_scores"], dtype=np.float32)
            self._q_w = np.ascontiguousarray(arrays["q_w"], dtype=np.float32)
        else:  # saved before the lists were: recompute them (exact, as add keeps them)
            ids = gb.topk_ip(self._recent_q, keys, self.params["M_sq"]) if len(self._recent_q) else np.empty((0, 0), np.int32)
            self._cache_lists(keys, ids, np.ones(len(self._recent_q), np.float32))
