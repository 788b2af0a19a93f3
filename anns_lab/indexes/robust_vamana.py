"""``robust-vamana``: OOD-DiskANN (Jaiswal et al. 2022), a Vamana graph built with sample queries.

Build, on keys K (n, d) and training queries Q:

1. Sample ``n_queries`` training queries (seeded; the newest ``recent_frac`` of them first
   when set) and add them as extra nodes: the build runs on [K; Q_s].
2. A query node's row is its exact top-``R`` keys by inner product, kept unpruned and never
   changed (``graph.vamana.vamana_pass``). Key nodes are inserted as in Vamana: greedy
   search, RobustPrune (inner-product rule, α) over keys *and* query nodes, back-edges (never
   into a query row). Two sequential passes (α = 1, then ``alpha``) over a seeded permutation
   of all nodes, as ``vamana`` does.
3. RobustStitch (``graph.vamana.robust_stitch``): in every key row each query neighbour is
   replaced by that query's keys and the row RobustPruned to R, so the final graph holds keys
   only and the query vectors are dropped.

Search: beam search of width max(L, k) from the entry points (the key of largest inner
product with the mean training query, plus the top keys of ``n_hubs`` centroids when ``n_hubs`` > 1, as in ``roargraph``); every
inner product is counted (entries included); ``bytes_read`` as ``vamana``'s (keys scanned, adjacency rows of the
expanded nodes, the entry list). ``add`` inserts new keys with one Vamana pass
over them (queries are no longer part of the graph). After build and add, any key not reachable
from the entries gets an in-edge (``graph.edges.link_unreachable``; where no reachable node near it in the graph has
room, from the reachable key of largest inner product: among every key at build, among a stride of ``FAR_POOL`` at
an add, which strands ~a third of its keys). Keys are read from the
``key_store.KeyStore`` given to ``build`` (the decoder's: one copy per GQA group), or the index's own.
"""

from __future__ import annotations

import numba
import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.base import KeyRowsIndex, Param
from anns_lab.indexes.graph import Graph, HoldsAdjacency, saved_graph
from anns_lab.indexes.graph.edges import FAR_POOL, link_unreachable
from anns_lab.indexes.graph.hubs import query_hubs, saved_hubs
from anns_lab.indexes.graph.search import bytes_read, search_batch
from anns_lab.indexes.graph.vamana import random_graph, robust_stitch, vamana_pass
from anns_lab.indexes.topk import topk_ip


class RobustVamanaIndex(HoldsAdjacency, KeyRowsIndex):
    """OOD-DiskANN: Vamana over keys plus sample queries, RobustStitched to a keys-only graph."""

    name = "robust-vamana"
    restores_exactly = True  # tests/test_build_processes.py
    uses_train_queries = True
    build_params = {
        "R": Param(32, 2, 512, help="maximum out-degree (a query node keeps its R nearest keys)"),
        "L": Param(64, 1, 4096, help="beam width while building"),
        "alpha": Param(1.2, 1.0, 4.0, help="RobustPrune α of the second pass"),
        "n_queries": Param(1024, 1, 1 << 20, help="training queries sampled as extra graph nodes"),
        "recent_frac": Param(0.0, 0.0, 1.0, help="sample from the newest fraction of training queries only (0 = all)"),
        "n_hubs": Param(1, 1, 4096, help="entry points (1 = one entry, as in DiskANN)"),
        "seed": Param(0, 0, 2**31 - 1, help="seed of the sample, random initial graph and insertion order"),
    }
    search_params = {"L": Param(100, 1, 1 << 16, help="beam width (the search uses max(L, k))")}
    search_grid = {"L": (100, 150, 200, 300, 400, 600, 800, 1200, 1600)}

    def check_keys(self, n_keys: int) -> None:
        if self.params["R"] >= n_keys:
            raise IndexConfigError(f"{self._owner()}: R={self.params['R']} must be smaller than the number of keys ({n_keys})")

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        p = self.params
        n, R = len(keys), p["R"]
        rng = np.random.default_rng(p["seed"])
        pool = train_queries
        if p["recent_frac"] > 0:
            pool = train_queries[len(train_queries) - max(1, int(round(p["recent_frac"] * len(train_queries)))):]
        take = min(p["n_queries"], len(pool))
        sample = np.ascontiguousarray(pool[np.sort(rng.choice(len(pool), take, replace=False))])
        q_nbrs = topk_ip(sample, keys, R)
        data = np.ascontiguousarray(np.vstack([keys, sample]))  # build-time only; the final graph holds keys
        nbrs, degree = random_graph(n + take, R, p["seed"])
        nbrs[n:], degree[n:] = q_nbrs, R
        self.hubs = query_hubs(keys, train_queries, p["n_hubs"], p["seed"])
        entry = int(self.hubs[0])
        order = rng.permutation(n + take).astype(np.int64)
        for alpha in (1.0, p["alpha"]):
            vamana_pass(Graph(data, nbrs, degree), order, entry, alpha, R, p["L"], n_free=n)
        self._hold_graph(*robust_stitch(Graph(data, nbrs, degree), n, q_nbrs, p["alpha"], R, numba.get_num_threads()), n)
        link_unreachable(Graph(keys, self._nbrs, self._degree), self.hubs, R, 0)  # every key a candidate source (FAR_POOL's stride: best recall -0.003 to -0.05 on Gemma-3 32K's layers 5 and 11)
        self._hold_keys(keys)

    def _add(self, keys: np.ndarray) -> None:
        n0, t, R = self.n_keys, len(keys), self.params["R"]
        allkeys = self._append_keys(keys)
        self._expose(n0 + t)
        order = np.arange(n0, n0 + t, dtype=np.int64)
        g = Graph(allkeys, self._nbrs, self._degree)
        vamana_pass(g, order, int(self.hubs[0]), self.params["alpha"], R, self.params["L"])
        link_unreachable(g, self.hubs, R, FAR_POOL)  # back-edge prunes strand ~a third of the new keys: a stride, not a scan each

    def _search(self, queries: np.ndarray, k: int, L: int):
        entries = np.ascontiguousarray(np.broadcast_to(self.hubs, (len(queries), len(self.hubs))))
        ids, scores, scanned, words = search_batch(Graph(self._keys, self._nbrs, self._degree), queries, entries,
                                                   max(L, k), k, numba.get_num_threads())
        return ids, scores, scanned, bytes_read(self.dim, scanned, words, len(self.hubs))

    @property
    def nbytes(self) -> int:
        return self._rows.held(self.n_keys).nbytes + self._adjacency.nbytes + self.hubs.nbytes

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys, "nbrs": self._nbrs, "degree": self._degree, "hubs": self.hubs}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        keys, nbrs, degree = saved_graph(arrays, self.n_keys, self.dim, self.params["R"])
        self._hold_graph(nbrs, degree, self.n_keys)
        self._hold_keys(keys)
        self.hubs = saved_hubs(arrays, self.n_keys)
