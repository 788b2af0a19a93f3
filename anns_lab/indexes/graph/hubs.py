"""Entry points of the query-aware graphs: the keys that the training queries' k-means centroids point at."""

from __future__ import annotations

import faiss
import numpy as np
from numba import njit

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.graph.simd import dot2x4, dot4
from anns_lab.indexes.persist import expect, expect_ids

KMEANS_POINTS = 64  # training points per hub centroid (faiss subsamples): 256 took a quarter of the build


def query_hubs(keys: np.ndarray, queries: np.ndarray, n_hubs: int, seed: int) -> np.ndarray:
    """Up to ``n_hubs`` + 1 distinct keys (one for ``n_hubs`` 1): the key of largest inner product with the mean query,
    always first, and the top-1 key of each of ``n_hubs`` k-means centroids of ``queries``."""
    keys = np.ascontiguousarray(keys, np.float32)
    mean = np.ascontiguousarray(queries.mean(axis=0, dtype=np.float32)[None])
    if n_hubs <= 1 or len(queries) < 2:
        return top_keys(mean, keys)
    c = min(n_hubs, len(queries))
    km = faiss.Kmeans(queries.shape[1], c, niter=10, seed=seed, verbose=False, min_points_per_centroid=1,
                      max_points_per_centroid=KMEANS_POINTS)
    km.train(np.ascontiguousarray(queries))
    hubs = top_keys(np.concatenate([mean, km.centroids]), keys)
    return np.array(list(dict.fromkeys(hubs.tolist())), np.int64)  # unique, order kept


def top_keys(vectors: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Each of ``vectors``' key of largest inner product (int64; the first on ties), by :func:`graph.simd.dot`'s sums.

    Not numpy's matmul: on a loaded machine (the decoder's builds run beside its prefill) a call waits for OpenBLAS's
    second thread to be scheduled, spinning: ~8 ms of CPU per product here for 0.06 ms of work, twice per head.
    Key-major (each key row read once for all the vectors), two keys against four vectors per step (``dot2x4``)."""
    v = np.ascontiguousarray(vectors, np.float32)
    nv = len(v)
    v = np.concatenate([v, np.repeat(v[-1:], -nv % 4, axis=0)]) if nv % 4 else v  # whole groups of four
    best = np.full(len(v), -np.inf, np.float32)
    arg = np.full(len(v), -1, np.int64)
    _top_keys(v, np.ascontiguousarray(keys, np.float32), best, arg)
    return arg[:nv]


@njit(cache=True, nogil=True)
def _top_keys(v, keys, best, arg):
    n = keys.shape[0]
    for j in range(0, n - 1, 2):
        for i in range(0, v.shape[0], 4):
            s = dot2x4(keys[j], keys[j + 1], v[i], v[i + 1], v[i + 2], v[i + 3])
            for t in range(4):
                if s[t] > best[i + t]:
                    best[i + t], arg[i + t] = s[t], j
            for t in range(4):
                if s[4 + t] > best[i + t]:
                    best[i + t], arg[i + t] = s[4 + t], j + 1
    if n % 2:
        for i in range(0, v.shape[0], 4):
            s = dot4(keys[n - 1], v[i], v[i + 1], v[i + 2], v[i + 3])
            for t in range(4):
                if s[t] > best[i + t]:
                    best[i + t], arg[i + t] = s[t], n - 1


def saved_hubs(arrays: dict[str, np.ndarray], n: int) -> np.ndarray:
    """A saved index's ``hubs`` (int64 key ids in [0, n), at least one), or IndexConfigError."""
    hubs = expect_ids("hubs", expect(arrays, "hubs", np.int64, (None,)), 0, n)
    if len(hubs) == 0:
        raise IndexConfigError("array 'hubs' is empty: a search needs an entry point")
    return hubs
