"""RobustPrune with inner-product similarity: the one occlusion rule of every graph build.

A candidate v of node p is occluded by a kept neighbour u when ip(u, v) − ip(p, v) > (α − 1)·|ip(p, v)|,
i.e. v is more similar to u than to p by a margin. For ip(p, v) ≥ 0 this is DiskANN's INNER_PRODUCT
rule ip(u, v) > α·ip(p, v) (and at α = 1 hnswlib's heuristic for space 'ip'); the |·| keeps
"α > 1 prunes less" true for negative similarities.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from anns_lab.indexes.graph.simd import dot


@njit(cache=True, nogil=True)
def prune_ordered(data, p, cand, sim_p, alpha, R, out, start):
    """RobustPrune over candidates in the caller's priority order (``sim_p[i]`` = ip(p, cand[i])): each is
    kept unless a neighbour kept before it occludes it. The first ``start`` entries of ``out`` are kept
    neighbours that already occlude; p itself and repeats are skipped. Returns the number kept (≤ R)."""
    kept = start
    for i in range(cand.shape[0]):
        if kept >= R:
            break
        u = cand[i]
        if u == p:
            continue
        ok = True
        for t in range(kept):
            w = out[t]
            if w == u or dot(data[w], data[u]) - sim_p[i] > (alpha - 1.0) * abs(sim_p[i]):
                ok = False
                break
        if ok:
            out[kept] = u
            kept += 1
    return kept


@njit(cache=True, nogil=True)
def robust_prune(data, p, candidates, alpha, R, out):
    """Write at most R diverse neighbours of ``p`` into ``out``, taking the candidates most similar to p
    first (ties by id, so deterministic); duplicates and p are ignored. Returns how many were kept."""
    cand = np.unique(candidates)
    m = 0
    for i in range(cand.shape[0]):  # drop p in place
        if cand[i] != p:
            cand[m] = cand[i]
            m += 1
    cand = cand[:m]
    sim_p = np.empty(m, np.float32)
    for i in range(m):
        sim_p[i] = dot(data[p], data[cand[i]])
    order = np.argsort(-sim_p, kind="mergesort")  # stable: ties resolved by id
    return prune_ordered(data, p, cand[order], sim_p[order], alpha, R, out, 0)
