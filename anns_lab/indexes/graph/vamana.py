"""The Vamana insertion pass (DiskANN) and OOD-DiskANN's RobustStitch."""

from __future__ import annotations

import numpy as np
from numba import njit

from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph.prune import robust_prune
from anns_lab.indexes.graph.search import search_one
from anns_lab.indexes.graph.utils import append_new, run_chunks


@njit(cache=True, nogil=True)
def random_graph(n, R, seed):
    """A random graph with min(R, n-1) distinct out-neighbours per node (no self loops), seeded."""
    np.random.seed(seed)
    r = min(R, n - 1)
    nbrs = np.full((n, R), -1, np.int32)
    degree = np.full(n, r, np.int32)
    for i in range(n):
        filled = 0
        while filled < r:
            c = np.random.randint(0, n)
            if c != i:
                filled = append_new(nbrs[i], filled, c)
    return nbrs, degree


def vamana_pass(g: Graph, order: np.ndarray, entry: int, alpha: float, R: int, L: int, n_free: int | None = None) -> None:
    """One Vamana pass, in place: for each p in ``order``, search for p from ``entry``, RobustPrune the
    expanded nodes and p's row, add back-edges. Sequential, so a seeded build is deterministic.

    Rows ≥ ``n_free`` are fixed (OOD-DiskANN's query nodes): such a p keeps its preset row unpruned
    and only proposes back-edges to its neighbours; no back-edge is ever written into a fixed row.
    """
    _vamana_pass(tuple(g), order, entry, alpha, R, L, len(g.degree) if n_free is None else n_free)


@njit(cache=True, nogil=True)
def _vamana_pass(g, order, entry, alpha, R, L, n_free):
    data, nbrs, degree = g
    n = data.shape[0]
    ws = (np.zeros(n, np.int32), np.empty(n + L, np.float32), np.empty(n + L, np.int64), np.empty(n, np.int64),
          np.empty(0, np.float32))  # no memo: full rows
    entries = np.array([entry], np.int64)
    no_ids, no_scores = np.empty(0, np.int64), np.empty(0, np.float32)
    pruned = np.empty(R, np.int32)
    tmp = np.empty(R, np.int32)  # back-edge prunes write here, never into `pruned` (being iterated)
    cand = np.empty(n + R, np.int64)
    for step in range(order.shape[0]):
        p = order[step]
        if p < n_free:
            _, _, n_exp = search_one(g, data[p], entries, L, ws, step + 1, no_ids, no_scores, (0, 0.0, 0))  # full rows
            cand[:n_exp] = ws[3][:n_exp]
            m = n_exp + degree[p]
            cand[n_exp:m] = nbrs[p, :degree[p]]
            kept = robust_prune(data, p, cand[:m], alpha, R, pruned)
            nbrs[p, :kept] = pruned[:kept]
            degree[p] = kept
        else:
            kept = degree[p]
            pruned[:kept] = nbrs[p, :kept]
        for t in range(kept):
            if pruned[t] < n_free:
                _back_edge(g, pruned[t], p, alpha, R, tmp)


@njit(cache=True, nogil=True)
def _back_edge(g, j, p, alpha, R, tmp):
    """Add p to row j unless present; a full row is RobustPruned over its edges and p (into ``tmp``)."""
    data, nbrs, degree = g
    for u in range(degree[j]):
        if nbrs[j, u] == p:
            return
    if degree[j] < R:
        nbrs[j, degree[j]] = p
        degree[j] += 1
        return
    back = np.empty(degree[j] + 1, np.int64)
    back[: degree[j]] = nbrs[j, : degree[j]]
    back[degree[j]] = p
    kept = robust_prune(data, j, back, alpha, R, tmp)
    nbrs[j, :kept] = tmp[:kept]
    degree[j] = kept


def robust_stitch(g: Graph, n_keys: int, q_nbrs: np.ndarray, alpha: float, R: int, n_threads: int):
    """OOD-DiskANN's RobustStitch: in each key row, every query node (id ≥ ``n_keys``) is replaced by that
    query's keys (``q_nbrs[id - n_keys]``), then the row is RobustPruned to R over keys only. Returns the
    keys-only graph's (nbrs, degree) (n_keys rows); rows in chunks (each owns its row)."""
    out = (np.full((n_keys, R), -1, np.int32), np.zeros(n_keys, np.int32))
    run_chunks(_stitch_chunk, (g, n_keys, q_nbrs, alpha, R, out), n_keys, n_threads)
    return out


@njit(cache=True, nogil=True)
def _stitch_chunk(g, n_keys, q_nbrs, alpha, R, out, c, n_chunks):
    data, nbrs, degree = g
    out_nbrs, out_deg = out
    for p in range(c, n_keys, n_chunks):
        cand = np.empty(degree[p] * (1 + q_nbrs.shape[1]), np.int64)
        m = 0
        has_query = False
        for j in range(degree[p]):
            v = nbrs[p, j]
            if v < n_keys:
                cand[m] = v
                m += 1
            else:
                has_query = True
                cand[m:m + q_nbrs.shape[1]] = q_nbrs[v - n_keys]
                m += q_nbrs.shape[1]
        if has_query:
            kept = robust_prune(data, p, cand[:m], alpha, R, out_nbrs[p])
        else:
            kept = m
            out_nbrs[p, :m] = cand[:m]
        out_deg[p] = kept
