"""Cluster-based KV retrieval: k-means of the keys, clusters chosen by the query's score against their
centroids, the keys of the chosen clusters scored exactly.

- ``clusterkv`` (Liu et al., "ClusterKV: Manipulating LLM KV Cache in Semantic Space for Recallable
  Compression", DAC 2025): ``nlist`` k-means centroids of the keys (400 clusters, 20 iterations: its reference
  code's defaults, sjtu-zhao-lab/ClusterKV; 200 until session 47, which cost it ~31% of its bytes at recall 0.95 on
  Gemma-3 32K), each key in the cluster of the centroid most like it by cosine (as ClusterKV assigns); a query ranks
  the clusters by q·centroid and takes the fewest best clusters holding at least ``budget`` keys, all of them read
  and charged (the reference cuts the chosen keys to the budget in member-list order: at a budget of 256 on SmolLM2
  8K, recall 0.843 at 169.2 KiB here against 0.833 at 166.0 so cut). The reference fits
  its k-means under cosine, this one under L2: on SmolLM2 8K the two read alike (335.5 and 335.3 KiB at 0.95).
- ``squeezed`` (Hooper et al., "Squeezed Attention: Accelerating Long Context Length LLM Inference",
  ACL 2025, hierarchical variant): fine centroids as above (k-means, L2 assignment) grouped by a
  second k-means into ``n_coarse`` coarse centroids; a query scores the coarse centroids, expands the
  best coarse clusters until their fine clusters hold ``expand`` × budget keys, scores only those fine
  centroids and takes the fewest best fine clusters holding ``budget`` keys. The paper picks clusters by a
  calibrated threshold on their centroid scores; ``expand`` × budget is a budget-driven stand-in for it.

Counting: every centroid scored is a full inner product, so ``n_scanned`` = centroids scored (coarse and
fine) + keys scored. ``bytes_read`` = 4·d per centroid scored + (4·d + 8) per key scored (its float32
vector and its int64 id in the cluster's member list) + for ``squeezed``, 4 bytes per fine-centroid id
read from an expanded coarse cluster's member list.
"""

from __future__ import annotations

import faiss
import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes import KeyRowsIndex, Param
from anns_lab.indexes.growable import Growable
from anns_lab.indexes.persist import expect, expect_ids

BUDGETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)


def kmeans(x: np.ndarray, k: int, niter: int, seed: int) -> np.ndarray:
    """(k, d) k-means centroids of ``x`` (faiss, L2)."""
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, verbose=False, min_points_per_centroid=1)
    km.train(np.ascontiguousarray(x, dtype=np.float32))
    return np.ascontiguousarray(km.centroids)


def nearest(x: np.ndarray, centroids: np.ndarray, cosine: bool) -> np.ndarray:
    """Row of ``centroids`` nearest each row of ``x``: by cosine, or by L2."""
    if cosine:
        c = centroids / np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-30)
        index = faiss.IndexFlatIP(x.shape[1])
        index.add(np.ascontiguousarray(c, dtype=np.float32))
        xn = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
        return index.search(np.ascontiguousarray(xn, dtype=np.float32), 1)[1][:, 0]
    index = faiss.IndexFlatL2(x.shape[1])
    index.add(centroids)
    return index.search(x, 1)[1][:, 0]


def members(assign: np.ndarray, n_lists: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of the clusters: (member ids grouped by cluster, offsets (n_lists + 1,))."""
    order = np.argsort(assign, kind="stable").astype(np.int64)
    return order, np.concatenate([[0], np.cumsum(np.bincount(assign, minlength=n_lists))]).astype(np.int64)


def joined(order: np.ndarray, offsets: np.ndarray, first: int, assign: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`members` after keys ``first, first + 1, ...`` join clusters ``assign``: each goes after its cluster's
    members (their ids are the largest, as a stable sort places them), one pass over the list where a sort of all of
    it cost O(n log n) an add."""
    new = np.argsort(assign, kind="stable")
    sizes = np.bincount(assign, minlength=len(offsets) - 1)
    order = np.insert(order, offsets[1:][assign[new]], first + new)
    return order, offsets + np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def take_until(order: np.ndarray, sizes: np.ndarray, budget: int) -> np.ndarray:
    """The first clusters of ``order`` whose sizes add up to at least ``budget`` (all of them if they never do)."""
    cum = np.cumsum(sizes[order])
    return order[: min(int(np.searchsorted(cum, budget)) + 1, len(order))]


class _Clustered(KeyRowsIndex):
    """Shared by both: keys grouped by fine cluster (CSR), the search over chosen clusters, add, persistence."""

    search_params = {"budget": Param(1024, 1, 1 << 30, help="keys read: the fewest best clusters holding at least this many")}
    search_grid = {"budget": BUDGETS}
    cosine = False

    def check_keys(self, n_keys: int) -> None:
        if (nlist := self._nlist(n_keys)) > n_keys:
            raise IndexConfigError(f"{self._owner()}: nlist={nlist} is larger than the number of keys ({n_keys})")

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        self._hold_keys(keys)
        self._centroids = kmeans(keys, self._nlist(len(keys)), self.params["niter"], self.params["seed"])
        self._group(nearest(keys, self._centroids, self.cosine))

    def _nlist(self, n: int) -> int:
        return self.params["nlist"]

    def _group(self, assign: np.ndarray) -> None:
        self._assign = Growable.of(assign, dtype=np.int64)
        self._order, self._offsets = members(self._assign.table, len(self._centroids))

    def _choose(self, q: np.ndarray, budget: int) -> tuple[np.ndarray, int, int]:
        """(fine clusters chosen, centroids scored, extra index bytes read) for one query."""
        raise NotImplementedError

    def _search(self, queries: np.ndarray, k: int, budget: int):
        d = queries.shape[1]
        ids = np.full((len(queries), k), -1, np.int64)
        scores = np.full((len(queries), k), -np.inf, np.float32)
        n_scanned = np.zeros(len(queries), np.int64)
        n_bytes = np.zeros(len(queries), np.int64)
        for row, q in enumerate(queries):  # one query at a time: a batch gives what single queries give
            chosen, n_centroids, extra = self._choose(q, budget)
            cand = np.concatenate([self._order[self._offsets[c]:self._offsets[c + 1]] for c in chosen])
            s = self._keys[cand] @ q
            top = np.argsort(-s, kind="stable")[:k]
            ids[row, : len(top)], scores[row, : len(top)] = cand[top], s[top]
            n_scanned[row] = n_centroids + len(cand)
            n_bytes[row] = 4 * d * n_centroids + (4 * d + 8) * len(cand) + extra
        return ids, scores, n_scanned, n_bytes

    def grid(self) -> list[dict]:
        return [{"budget": b} for b in sorted({min(b, self.n_keys) for b in self.search_grid["budget"]} | {self.n_keys})]

    def _add(self, keys: np.ndarray) -> None:
        # New keys join the cluster of their nearest centroid (the centroids stay those of the build).
        n0 = self.n_keys
        self._append_keys(keys)
        self._order, self._offsets = joined(self._order, self._offsets, n0,
                                            self._assign.append(nearest(keys, self._centroids, self.cosine))[n0:])

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys, "centroids": self._centroids, "assign": self._assign.table}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        # From a file: checked as build makes them (an empty centroid list is refused by the assignment's range).
        self._hold_keys(expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True))
        self._centroids = expect(arrays, "centroids", np.float32, (None, self.dim), finite=True)
        self._group(expect_ids("assign", expect(arrays, "assign", np.int64, (self.n_keys,)), 0, len(self._centroids)))


class ClusterKV(_Clustered):
    """ClusterKV: k-means of the keys (cosine assignment), the best clusters by q·centroid up to a key budget."""

    build_params = {
        "nlist": Param(400, 1, 1 << 20, help="k-means clusters (ClusterKV's reference code: 400)"),
        "niter": Param(20, 1, 1000, help="k-means iterations (ClusterKV: 20)"),
        "seed": Param(1234, 0, 2**31 - 1, help="k-means seed"),
    }
    cosine = True

    def _choose(self, q: np.ndarray, budget: int):
        ranked = np.argsort(-(self._centroids @ q), kind="stable")
        return take_until(ranked, np.diff(self._offsets), budget), len(self._centroids), 0

    def max_scanned(self) -> int:
        return self.n_keys + len(self._centroids)


class SqueezedHierarchical(_Clustered):
    """Squeezed Attention, hierarchical: coarse centroids over fine ones; only the best coarse clusters' fine centroids scored."""

    build_params = {
        "nlist": Param(0, 0, 1 << 20, help="fine clusters; 0 = auto: n/16 keys (many small clusters, where two levels pay)"),
        "n_coarse": Param(0, 0, 1 << 20, help="coarse clusters over the fine centroids; 0 = auto: √nlist"),
        "expand": Param(4.0, 1.0, 1000.0, help="coarse clusters expanded until their fine clusters hold expand × budget keys"),
        "niter": Param(20, 1, 1000, help="k-means iterations"),
        "seed": Param(1234, 0, 2**31 - 1, help="k-means seed"),
    }
    auto_rules = {"nlist": "2026-11-30", "n_coarse": "2026-11-30"}

    def _nlist(self, n: int) -> int:
        return self.params["nlist"] or max(1, n // 16)

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        super()._build(keys, train_queries)
        self._build_coarse()

    def _build_coarse(self) -> None:
        nlist = len(self._centroids)
        n_coarse = min(self.params["n_coarse"] or max(1, round(nlist ** 0.5)), nlist)
        self._coarse = kmeans(self._centroids, n_coarse, self.params["niter"], self.params["seed"])
        self._group_coarse(nearest(self._centroids, self._coarse, False))

    def _group_coarse(self, coarse_assign: np.ndarray) -> None:
        self._coarse_assign = np.ascontiguousarray(coarse_assign, dtype=np.int64)
        self._fine_order, self._fine_offsets = members(self._coarse_assign, len(self._coarse))

    def _choose(self, q: np.ndarray, budget: int):
        sizes = np.diff(self._offsets)
        coarse_sizes = np.bincount(self._coarse_assign, weights=sizes, minlength=len(self._coarse))
        expanded = take_until(np.argsort(-(self._coarse @ q), kind="stable"), coarse_sizes,
                              int(np.ceil(self.params["expand"] * budget)))
        fine = np.concatenate([self._fine_order[self._fine_offsets[c]:self._fine_offsets[c + 1]] for c in expanded])
        ranked = fine[np.argsort(-(self._centroids[fine] @ q), kind="stable")]
        return take_until(ranked, sizes, budget), len(self._coarse) + len(fine), 4 * len(fine)

    def max_scanned(self) -> int:
        return self.n_keys + len(self._centroids) + len(self._coarse)

    def _arrays(self) -> dict[str, np.ndarray]:
        return super()._arrays() | {"coarse": self._coarse, "coarse_assign": self._coarse_assign}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        super()._restore(arrays)
        self._coarse = expect(arrays, "coarse", np.float32, (None, self.dim), finite=True)
        coarse_assign = expect(arrays, "coarse_assign", np.int64, (len(self._centroids),))
        self._group_coarse(expect_ids("coarse_assign", coarse_assign, 0, len(self._coarse)))
