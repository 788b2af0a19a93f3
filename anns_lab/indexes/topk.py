"""Exact top-k by inner product: faiss's brute-force kNN, the ground truth of the graph builds."""

from __future__ import annotations

import faiss
import numpy as np


def topk_ip(queries: np.ndarray, keys: np.ndarray, k: int) -> np.ndarray:
    """Exact top-``k`` keys (int32 ids, best first) of each query by inner product.

    faiss's brute-force kNN: blocked matmul plus heaps, so memory stays at a block of
    queries × keys, never the whole m × n matrix (the 32K case).
    """
    k = min(k, keys.shape[0])
    _, ids = faiss.knn(np.ascontiguousarray(queries, np.float32), np.ascontiguousarray(keys, np.float32), k,
                       metric=faiss.METRIC_INNER_PRODUCT)
    return ids.astype(np.int32)
