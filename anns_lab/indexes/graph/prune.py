"""RobustPrune with inner-product similarity: the one occlusion rule of every graph build.

A candidate v of node p is occluded by a kept neighbour u when ip(u, v) − ip(p, v) > (α − 1)·|ip(p, v)|,
i.e. v is more similar to u than to p by a margin. For ip(p, v) ≥ 0 this is DiskANN's INNER_PRODUCT
rule ip(u, v) > α·ip(p, v) (and at α = 1 hnswlib's heuristic for space 'ip'); the |·| keeps
"α > 1 prunes less" true for negative similarities.

Where p has copies (equal vectors), a copy among its candidates equal to a kept copy is occluded too: copies
of p are as similar to each other as to p, so the rule never fires among them, and a key with R or more copies
linked only its copies, a closed clique (34 equal keys among 3,000 left vamana's search from one of them at recall
0 for any beam). Equal vectors give bit-equal inner products (``simd.dot``), so the vectors are compared only on
an exact tie, ip(w, u) = ip(p, u), which holds for every u where the kept w is a copy of p. (Copies of another
key, not of p, are left to the rule: they may take several of p's slots, but open no clique.)
"""

from __future__ import annotations

import numpy as np
from numba import njit

from anns_lab.indexes.graph.simd import dot


@njit(cache=True, nogil=True)
def prune_ordered(data, p, cand, sim_p, alpha, R, out, start):
    """RobustPrune over candidates in the caller's priority order (``sim_p[i]`` = ip(p, cand[i])): each is
    kept unless a neighbour kept before it occludes it (or, a copy of p, is the same vector). The first ``start``
    entries of ``out`` are kept neighbours that already occlude; p itself and repeats are skipped. Returns the number
    kept (≤ R)."""
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
            if w == u:
                ok = False
                break
            s = dot(data[w], data[u])
            if s - sim_p[i] > (alpha - 1.0) * abs(sim_p[i]) or (s == sim_p[i] and _equal(data[w], data[u])):
                ok = False
                break
        if ok:
            out[kept] = u
            kept += 1
    return kept


@njit(cache=True, nogil=True, inline="always")
def _equal(a, b):
    """Whether two vectors are equal element by element."""
    for j in range(a.shape[0]):
        if a[j] != b[j]:
            return False
    return True


@njit(cache=True, nogil=True)
def robust_prune(data, p, candidates, alpha, R, out):
    """Write at most R diverse neighbours of ``p`` into ``out``, taking the candidates most similar to p
    first (ties by id from p on, wrapping round, so deterministic); duplicates and p are ignored. Returns how many
    were kept."""
    ids = np.unique(candidates)
    # Ids above p first, then those below: where copies of p tie, each links the next, a ring through all of them
    # (ascending ids from 0 sent every copy to the lowest, which then had the only way in)
    cand = np.empty_like(ids)
    m = 0
    for i in range(ids.shape[0]):
        if ids[i] > p:
            cand[m] = ids[i]
            m += 1
    for i in range(ids.shape[0]):
        if ids[i] < p:
            cand[m] = ids[i]
            m += 1
    cand = cand[:m]
    sim_p = np.empty(m, np.float32)
    for i in range(m):
        sim_p[i] = dot(data[p], data[cand[i]])
    order = np.argsort(-sim_p, kind="mergesort")  # stable: ties resolved by id
    return prune_ordered(data, p, cand[order], sim_p[order], alpha, R, out, 0)
