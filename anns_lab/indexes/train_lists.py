"""The training queries' top-k key lists of the query-aware builds: exact, or exact at anchors and re-ranked between.

The exact lists cost m × n inner products (every training query against every key): at 32K keys
and 32K queries of dimension 256 that is ~8 s of one core, most of a roargraph build, and it grows
as n² with the context. Neighbouring prefill queries share most of their top keys (the sinks, the
heavy hitters, the passage being read), so :func:`anchored_topk` computes exact lists only for
*anchor* queries (every ``stride``-th, counted back from the newest, plus the newest ``exact_tail``)
and ranks, for each query between two anchors, the union of the lists of the ``span`` anchors on
either side by its exact inner products: m·n/stride + m·2·span·k products instead of m·n.

Rows of anchors are exact (:func:`topk.topk_ip`'s); rows between them are the exact order of
their candidates, so a key is missed only when no nearby anchor has it in its list.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from anns_lab.indexes.graph.simd import dot4
from anns_lab.indexes.topk import topk_ip


def anchor_ids(m: int, stride: int, exact_tail: int) -> np.ndarray:
    """Sorted ids of the anchor queries among ``m``: every ``stride``-th counted back from the newest
    (m - 1), the first, and the newest ``exact_tail`` (decode queries resemble the newest most)."""
    if stride <= 1 or m <= 2:
        return np.arange(m, dtype=np.int64)
    ids = np.r_[0, np.arange(m - 1, -1, -stride), np.arange(max(0, m - exact_tail), m)]
    return np.unique(ids).astype(np.int64)


def anchored_topk(queries: np.ndarray, keys: np.ndarray, k: int, stride: int, span: int = 2,
                  exact_tail: int = 256, n_threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(lists (m, k) int32 best first, exact (m,) bool): exact lists at the anchors (:func:`anchor_ids`),
    elsewhere the top ``k`` by exact inner product among the keys listed by the ``span`` anchors on either side.

    ``stride`` ≤ 1 is :func:`topk.topk_ip` for every query (all rows exact).
    """
    queries = np.ascontiguousarray(queries, np.float32)
    keys = np.ascontiguousarray(keys, np.float32)
    m = len(queries)
    k = min(k, len(keys))
    anchors = anchor_ids(m, stride, exact_tail)
    exact = np.zeros(m, np.bool_)
    exact[anchors] = True
    if len(anchors) == m:
        return topk_ip(queries, keys, k), exact
    out = np.empty((m, k), np.int32)
    a_lists = topk_ip(queries[anchors], keys, k)
    out[anchors] = a_lists
    gaps = np.flatnonzero(np.diff(anchors) > 1)  # anchor pairs with queries between them
    n_chunks = max(1, min(len(gaps), n_threads))
    widest = int(np.diff(anchors).max()) - 1  # most queries in one gap
    _rerank_gaps(queries, keys, a_lists, anchors, gaps, max(1, span), out, n_chunks, widest)
    return out, exact


@njit(cache=True, nogil=True, parallel=True)
def _rerank_gaps(queries, keys, a_lists, anchors, gaps, span, out, n_chunks, widest):
    """For each gap g (queries strictly between anchors[g] and anchors[g + 1], at most ``widest``): candidates = the
    lists of anchors g - span + 1 … g + span (deduplicated), scored against each of the gap's queries; each query
    keeps its top k, best first."""
    n = keys.shape[0]
    na, k = a_lists.shape
    for c in prange(n_chunks):
        stamp = np.full(n, -1, np.int64)
        cand = np.empty(2 * span * k, np.int64)
        s = np.empty((widest + 3, 2 * span * k), np.float32)
        sort_keys = np.empty(2 * span * k, np.uint64)
        order = np.empty(k, np.int64)
        for gi in range(c, gaps.shape[0], n_chunks):
            g = gaps[gi]
            t = 0
            for a in range(max(0, g - span + 1), min(na, g + span + 1)):
                for j in range(k):
                    v = a_lists[a, j]
                    if stamp[v] != g:
                        stamp[v] = g
                        cand[t] = v
                        t += 1
            lo, hi = anchors[g] + 1, anchors[g + 1]
            # Candidate-major: each key row is read once and scored against all the gap's queries, four at a time
            # (graph.simd.dot4: the same bits as dot; a short last group repeats the gap's last query). Not numba's
            # BLAS: on these small blocks its calls cost ~15x more (OpenBLAS's thread pool on a loaded machine).
            for i in range(t):
                row = keys[cand[i]]
                for r in range(0, hi - lo, 4):
                    s[r, i], s[r + 1, i], s[r + 2, i], s[r + 3, i] = dot4(
                        row, queries[lo + r], queries[min(lo + r + 1, hi - 1)], queries[min(lo + r + 2, hi - 1)],
                        queries[min(lo + r + 3, hi - 1)])
            for r in range(hi - lo):
                _top_sorted(s[r, :t], k, sort_keys, order)
                for j in range(k):
                    out[lo + r, j] = cand[order[j]]


@njit(cache=True, nogil=True)
def _top_sorted(s, k, keys, out):
    """``out[:k]`` = indices of the ``k`` largest entries of ``s``, largest first, ties by smaller index (what a
    stable sort of −s gives), from 64-bit keys in the caller's buffer ``keys`` (the score's bits made
    order-preserving and negated, above the index): a partition at k and a sort of those k, ~1.7x faster than a
    partition and an argsort of k floats."""
    u = s.view(np.uint32)
    for i in range(s.shape[0]):
        b = np.uint64(u[i]) if s[i] != 0 else np.uint64(0)  # -0.0 ties with +0.0
        up = (b ^ np.uint64(0xFFFFFFFF)) if b >> np.uint64(31) else (b | np.uint64(0x80000000))  # ascending as s
        keys[i] = ((up ^ np.uint64(0xFFFFFFFF)) << np.uint64(32)) | np.uint64(i)  # descending score, then index
    kk = keys[: s.shape[0]]
    if kk.shape[0] > k:  # keys are distinct (the index is in them): the k smallest, then their order
        kk = np.partition(kk, k - 1)[:k]
    kk.sort()
    for j in range(k):
        out[j] = np.int64(kk[j] & np.uint64(0xFFFFFFFF))
