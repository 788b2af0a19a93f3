"""Entry points of the query-aware graphs: the keys that the training queries' k-means centroids point at."""

from __future__ import annotations

import faiss
import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.persist import expect, expect_ids

HUB_BLOCK = 256  # centroids scored against every key at once (256 x 128K float32 = 128 MiB)
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
    # Matmuls of HUB_BLOCK centroids (faiss's kNN took 3x longer at k = 1 for the default 32): the scores of
    # all n_hubs at once would be n_hubs x n floats (2 GiB at 4096 hubs on 128K keys).
    top = np.concatenate([np.argmax(km.centroids[i:i + HUB_BLOCK] @ keys.T, axis=1) for i in range(0, c, HUB_BLOCK)])
    hubs = [mean_top] + [int(h) for h in top]
    return np.array(list(dict.fromkeys(hubs)), np.int64)  # unique, order kept


def saved_hubs(arrays: dict[str, np.ndarray], n: int) -> np.ndarray:
    """A saved index's ``hubs`` (int64 key ids in [0, n), at least one), or IndexConfigError."""
    hubs = expect_ids("hubs", expect(arrays, "hubs", np.int64, (None,)), 0, n)
    if len(hubs) == 0:
        raise IndexConfigError("array 'hubs' is empty: a search needs an entry point")
    return hubs
