"""``vamana``: DiskANN's graph (greedy search + RobustPrune with α, R, L), in our own numba.

Inner product is the similarity throughout: the greedy search that inserts a key looks for
the keys of largest inner product with it, and RobustPrune uses DiskANN's INNER_PRODUCT
occlusion rule (see ``graph.prune``), rather than a Euclidean graph over norm-augmented keys
(the other MIPS route, which scanned more for the same recall: ``docs/notes/graph-indexes.md``).

Build: a seeded random R-regular graph, then two sequential passes over a seeded permutation
(α = 1, then the given α), entry point = the key of largest inner product with the keys'
mean. Search: the best-first search of :mod:`graph.search` with beam max(L, k) from that entry;
``n_scanned`` counts every node whose inner product with the query was computed (the entry included),
once each; ``bytes_read`` (``graph.search.bytes_read``): each scanned key (4·dim bytes), each expanded
node's adjacency row (degree + neighbour ids, 4 bytes each) and the entry id (8 bytes).
"""

from __future__ import annotations

import numba
import numpy as np

from anns_lab.indexes.base import KeyRowsIndex, Param
from anns_lab.indexes.graph import Graph, HoldsAdjacency, saved_graph
from anns_lab.indexes.graph.search import bytes_read, search_batch
from anns_lab.indexes.graph.vamana import random_graph, vamana_pass
from anns_lab.indexes.persist import expect, expect_ids


def entry_point(keys: np.ndarray) -> int:
    """The key with the largest inner product with the mean key: a well-connected start for MIPS."""
    return int(np.argmax(keys @ keys.mean(axis=0)))


class VamanaIndex(HoldsAdjacency, KeyRowsIndex):
    """Vamana (DiskANN) graph for maximum inner product; searched by counted beam search."""

    name = "vamana"
    restores_exactly = True  # tests/test_build_processes.py
    build_params = {
        "R": Param(32, 2, 512, help="maximum out-degree"),
        "L": Param(64, 1, 4096, help="beam width while building"),
        "alpha": Param(1.2, 1.0, 4.0, help="RobustPrune α of the second pass (α > 1 keeps longer edges)"),
        "seed": Param(0, 0, 2**31 - 1, help="seed of the random initial graph and insertion order"),
    }
    search_params = {"L": Param(100, 1, 1 << 16, help="beam width (the search uses max(L, k))")}
    search_grid = {"L": (100, 150, 200, 300, 400, 600, 800, 1200, 1600)}

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        R, L, seed = self.params["R"], self.params["L"], self.params["seed"]
        nbrs, degree = random_graph(len(keys), R, seed)
        self.entry = entry_point(keys)
        order = np.random.default_rng(seed).permutation(len(keys)).astype(np.int64)
        for alpha in (1.0, self.params["alpha"]):
            vamana_pass(Graph(keys, nbrs, degree), order, self.entry, alpha, R, L)
        self._hold_keys(keys)
        self._hold_graph(nbrs, degree, len(keys))

    def _add(self, keys: np.ndarray) -> None:
        # Insert the new rows with one α pass over them (the old rows keep their edges).
        n0 = self.n_keys
        allkeys = self._append_keys(keys)
        self._expose(len(allkeys))
        order = np.arange(n0, len(allkeys), dtype=np.int64)
        vamana_pass(Graph(allkeys, self._nbrs, self._degree), order, self.entry, self.params["alpha"], self.params["R"],
                    self.params["L"])

    def _search(self, queries: np.ndarray, k: int, L: int):
        entries = np.full((len(queries), 1), self.entry, np.int64)
        ids, scores, scanned, words = search_batch(Graph(self._keys, self._nbrs, self._degree), queries, entries, max(L, k),
                                                   k, numba.get_num_threads())
        return ids, scores, scanned, bytes_read(self.dim, scanned, words, 1)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys, "nbrs": self._nbrs, "degree": self._degree, "entry": np.array([self.entry], np.int64)}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        keys, nbrs, degree = saved_graph(arrays, self.n_keys, self.dim, self.params["R"])
        self._hold_graph(nbrs, degree, self.n_keys)
        self._hold_keys(keys)
        self.entry = int(expect_ids("entry", expect(arrays, "entry", np.int64, (1,)), 0, self.n_keys)[0])
