"""RetroInfer-style clustered estimate (VLDB 2026): exact tokens of the best clusters, the next from centroids.

Keys are grouped by k-means (faiss, ``nlist`` clusters; ``nlist ≥ n`` makes every key its own
cluster). A query scores every centroid and splits the clusters, best first, into RetroInfer's
zones: every key of the ``nprobe`` best is attended exactly (the top-k of them as ``ids``, the
others as samples of weight 1); the next ``round(estimation_budget·C)`` (C: the non-empty clusters of the
``nlist``, which k-means may leave some of empty; the reference counts ``nlist``) are estimated from
their centroids (the mean of a cluster's keys): ``n_c·e^{l_c}`` in the normaliser and
``e^{l_c}·Σ_{i∈c} v_i`` in the numerator, the value sums the consumer's, from :meth:`summaries`
(members per cluster); the rest are dropped. ``estimation_budget`` is the reference's (a share of
all clusters, 0.232 by default, microsoft/RetrievalAttention's RetroInfer config); 1 estimates
every cluster not attended. Not unbiased: every member of an estimated cluster is given its
centroid's logit. With single-key clusters and every cluster estimated it is exact.

RetroInfer ranks a KV head's clusters once for its group (the softmax of the centroid scores summed over the
group's query heads); here each query head ranks its own, as for every index of the lab.

Two choices of ours, measured (BENCHMARKS "Estimators"): faiss L2 k-means over all keys where the
reference runs segmented spherical (inner-product) k-means, no better at 8K; and until session 48
every other cluster was estimated (``estimation_budget`` 1, what tables swept before it measured).

Counting: ``n_scanned`` = the non-empty clusters' centroids (``nlist`` when none is empty) + the probed clusters'
keys; ``bytes_read`` = those
vectors, the values of the exact keys beyond the top-k and the estimated clusters' value sums, as float32, and the
index data read to find them: 8 bytes per probed key's id in its cluster's member list (as ivf and clusterkv charge)
and 8 per estimated cluster's member count (uncharged until session 47: ~3% of the bytes at d = 64).
"""

from __future__ import annotations

import faiss
import numpy as np

from anns_lab.indexes import KeyRowsIndex, Param
from anns_lab.indexes.estimate import Estimate, Summaries
from anns_lab.indexes.persist import expect, expect_ids


class RetroInfer(KeyRowsIndex):
    """k-means clusters in RetroInfer's zones: nprobe exact, estimation_budget from centroid and value sum, rest dropped."""

    build_params = {
        "nlist": Param(0, 0, 1 << 24, help="k-means clusters; 0 = auto (n/16, RetroInfer's ~16 keys per cluster); "
                                           "≥ n: one cluster per key"),
        "niter": Param(10, 1, 1000, help="k-means iterations"),
        "seed": Param(1234, 0, 2**31 - 1, help="k-means seed"),
        "estimation_budget": Param(0.232, 0.0, 1.0, help="share of all clusters estimated from centroid and value sum, "
                                                         "best first after the nprobe attended (RetroInfer's default); "
                                                         "the rest are dropped; 1 = every other cluster"),
    }
    search_params = {
        "nprobe": Param(8, 1, 1 << 24, help="clusters attended exactly (clipped to nlist)"),
    }
    search_grid = {"nprobe": (1, 2, 4, 8, 16, 32, 64, 128)}
    build_params_before = {"estimation_budget": 1.0}  # tables swept before session 48 estimated every other cluster
    auto_rules = {"nlist": "2026-11-30"}
    estimates = True

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        n, d = keys.shape
        nlist = self.params["nlist"] or max(1, n // 16)
        if nlist >= n:
            assign = np.arange(n)
        else:
            km = faiss.Kmeans(d, nlist, niter=self.params["niter"], seed=self.params["seed"],
                              min_points_per_centroid=1, max_points_per_centroid=1 << 30)
            km.train(keys)
            assign = km.index.search(keys, 1)[1][:, 0]
        self._set(keys, assign)

    def _set(self, keys: np.ndarray, assign: np.ndarray) -> None:
        self._hold_keys(keys)
        members = np.argsort(assign, kind="stable").astype(np.int64)
        counts = np.bincount(assign, minlength=assign.max() + 1)
        sums = np.zeros((len(counts), keys.shape[1]), np.float64)
        np.add.at(sums, assign, keys)
        used = counts > 0  # empty clusters (k-means may leave some) are dropped
        keep = np.flatnonzero(used)
        centroids = (sums[keep] / counts[keep, None]).astype(np.float32)
        offsets = np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64)
        self._summ = Summaries(centroids, offsets, members)
        self._assign = assign

    def summaries(self) -> Summaries:
        return self._summ

    def _search(self, queries: np.ndarray, k: int, nprobe: int):
        summ = self._summ
        n_c = len(summ.keys)
        nprobe = min(nprobe, n_c)
        n_est = min(round(self.params["estimation_budget"] * n_c), n_c - nprobe)  # the reference's es_cluster_num
        cscores = queries @ summ.keys.T
        order = np.argsort(-cscores, axis=1, kind="stable")
        nq, d = queries.shape
        ids = np.full((nq, k), -1, np.int64)
        scores = np.full((nq, k), -np.inf, np.float32)
        samples, summary_ids = [], []
        n_scanned = np.zeros(nq, np.int64)
        n_index = np.zeros(nq, np.int64)  # bytes of index data read: member ids, member counts
        for row, q in enumerate(queries):
            probed = order[row, :nprobe]
            exact = np.concatenate([summ.members[summ.offsets[c]: summ.offsets[c + 1]] for c in probed])
            s = self._keys[exact] @ q
            best = np.argsort(-s, kind="stable")
            top = best[:k]
            ids[row, : len(top)], scores[row, : len(top)] = exact[top], s[top]
            samples.append(np.sort(exact[best[k:]]))
            summary_ids.append(order[row, nprobe: nprobe + n_est])
            n_scanned[row] = n_c + len(exact)
            n_index[row] = 8 * len(exact) + 8 * len(summary_ids[-1])
        estimate = Estimate.make(samples, [np.ones(len(s)) for s in samples], summary_ids, nq=nq)
        return ids, scores, n_scanned, (n_scanned + estimate.n_terms()) * 4 * d + n_index, estimate

    def grid(self) -> list[dict]:
        n_c = len(self._summ.keys)
        return [{"nprobe": v} for v in sorted({min(v, n_c) for v in self.search_grid["nprobe"]} | {n_c})]

    def max_scanned(self) -> int:
        return self.n_keys + len(self._summ.keys)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys, "assign": self._assign}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        # From a file: checked as build makes them (finite float32 keys, one cluster id in [0, n) per key).
        keys = expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True)
        self._set(keys, expect_ids("assign", expect(arrays, "assign", np.int64, (self.n_keys,)), 0, self.n_keys))
