"""Edges as a whole: the one CSR builder, reverse edges, lock-free row merges and reachability."""

from __future__ import annotations

import numpy as np
from numba import njit

from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph.prune import robust_prune
from anns_lab.indexes.graph.simd import dot
from anns_lab.indexes.graph.utils import append_new, run_chunks

FAR_POOL = 512  # link_unreachable: in-edge sources of a key with no reachable node near it in the graph, a stride over all keys (roargraph's build with 0 = all: up to 0.4 s per 32K head, 141 s on a real 128K head; 2048 left 1.5-2.3 s there)


@njit(cache=True, nogil=True)
def group_by(u, n):
    """Stable counting sort of items i by ``u[i]`` in [0, n) (negative: left out): (ptr (n + 1,), order)
    where ``order[ptr[v]:ptr[v + 1]]`` are the items with u == v, in their original order."""
    ptr = np.zeros(n + 1, np.int64)
    for x in u:
        if x >= 0:
            ptr[x + 1] += 1
    for v in range(n):
        ptr[v + 1] += ptr[v]
    fill = ptr[:-1].copy()
    order = np.empty(ptr[n], np.int64)
    for i in range(u.shape[0]):
        if u[i] >= 0:
            order[fill[u[i]]] = i
            fill[u[i]] += 1
    return ptr, order


def incoming(g: Graph) -> tuple[np.ndarray, np.ndarray]:
    """CSR of reverse edges: (ptr, src) with ``src[ptr[u]:ptr[u + 1]]`` the nodes p with u in p's row, by p."""
    R = g.nbrs.shape[1]
    ptr, order = group_by(np.where(np.arange(R) < g.degree[:, None], g.nbrs, -1).ravel(), len(g.degree))
    return ptr, (order // R).astype(np.int32)


def proposals_by_row(props: np.ndarray, targets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Proposals (target ``targets[i]`` ← each u ≥ 0 in ``props[i]``) grouped by u, for :func:`merge_into_rows`:
    (rows u that receive one, ptr over all n rows, src); each row's sources keep the targets' order."""
    ptr, order = group_by(props.ravel(), n)
    src = np.asarray(targets, np.int32)[order // props.shape[1]]
    return np.flatnonzero(ptr[1:] > ptr[:-1]), ptr, src


def merge_into_rows(g: Graph, rows, ptr, src, alpha, R, prune_full, n_threads, keep_order: bool = False):
    """Each row u in ``rows``, in place: append the proposed edges ``src[ptr[u]:ptr[u + 1]]`` not already
    present; when the row would exceed R, either RobustPrune the union (``prune_full``) or keep the
    first R. ``keep_order``: a pruned row keeps the edges it kept in the row's order, the new ones after
    (roargraph's rows are in co-occurrence order, which its search walks). Lock-free: an iteration reads and
    writes its own row only (``rows`` unique)."""
    rows = np.asarray(rows, np.int64)
    run_chunks(_merge_chunk, (g, rows, (ptr, src), alpha, R, prune_full, keep_order), len(rows), n_threads)


@njit(cache=True, nogil=True)
def _merge_chunk(g, rows, csr, alpha, R, prune_full, keep_order, c, n_chunks):
    data, nbrs, degree = g
    ptr, src = csr
    for i in range(c, rows.shape[0], n_chunks):
        u = rows[i]
        lo, hi = ptr[u], ptr[u + 1]
        if hi == lo:
            continue
        cand = np.empty(degree[u] + hi - lo, np.int32)
        m = degree[u]
        cand[:m] = nbrs[u, :m]
        for t in range(lo, hi):
            v = src[t]
            if v != u:
                m = append_new(cand, m, v)
        if m <= R or not prune_full:
            kept = min(m, R)
            nbrs[u, :kept] = cand[:kept]
        else:
            out = np.empty(R, np.int32)
            kept = robust_prune(data, u, cand[:m].astype(np.int64), alpha, R, out)
            if keep_order:  # the kept edges in the candidates' order, not the prune's
                at = np.empty(kept, np.int64)
                for t in range(kept):
                    j = 0
                    while cand[j] != out[t]:
                        j += 1
                    at[t] = j
                out[:kept] = out[:kept][np.argsort(at)]
            nbrs[u, :kept] = out[:kept]
        degree[u] = kept


def add_reverse_edges(g: Graph, alpha: float, R: int, n_threads: int) -> None:
    """Make edges (nearly) symmetric, in place: every p→u proposes u→p; rows over R are RobustPruned."""
    ptr, src = incoming(g)
    merge_into_rows(g, np.arange(len(g.degree), dtype=np.int64), ptr, src, alpha, R, True, n_threads)


def link_back(g: Graph, rows: np.ndarray, alpha: float, R: int, n_threads: int = 1, keep_order: bool = False) -> None:
    """Reverse edges of the given ``rows`` only, in place: each u in row t's list gains t (RobustPrune over R;
    ``keep_order``: :func:`merge_into_rows`). Touches only the rows that gain an edge (``add``: the new keys'
    neighbours)."""
    rows = np.asarray(rows, np.int64)
    sub = g.nbrs[rows]
    sub[np.arange(g.nbrs.shape[1]) >= g.degree[rows][:, None]] = -1
    targets, ptr, src = proposals_by_row(sub, rows, len(g.degree))
    merge_into_rows(g, targets, ptr, src, alpha, R, True, n_threads, keep_order)


@njit(cache=True, nogil=True)
def reachable_from(g, entries):
    """Boolean mask of the nodes reachable from ``entries`` (BFS)."""
    n = g.nbrs.shape[0]
    seen = np.zeros(n, np.bool_)
    queue = np.empty(n, np.int64)
    for e in entries:
        mark_from(g, e, seen, queue)
    return seen


@njit(cache=True, nogil=True)
def mark_from(g, start, seen, queue):
    """BFS from ``start`` over nodes not yet ``seen``, marking them."""
    head = tail = 0
    if not seen[start]:
        seen[start] = True
        queue[tail] = start
        tail += 1
    while head < tail:
        u = queue[head]
        head += 1
        for j in range(g.degree[u]):
            v = g.nbrs[u, j]
            if not seen[v]:
                seen[v] = True
                queue[tail] = v
                tail += 1


@njit(cache=True, nogil=True)
def _source_near(g, t, seen, R):
    """A reachable node with a free slot among t's out-neighbours, else two hops out; -1 if none."""
    nbrs, degree = g.nbrs, g.degree
    for j in range(degree[t]):
        u = nbrs[t, j]
        if seen[u] and degree[u] < R:
            return u
    for j in range(degree[t]):
        w = nbrs[t, j]
        for i in range(degree[w]):
            u = nbrs[w, i]
            if u != t and seen[u] and degree[u] < R:
                return u
    return -1


@njit(cache=True, nogil=True)
def _source_far(g, t, seen, R, step):
    """The reachable node of largest inner product with t that has a free slot, else ``-2 - u`` for the
    reachable node u of largest inner product (whose last edge t will replace), among every ``step``-th node
    (all nodes when that stride holds no reachable one)."""
    src = _source_among(g, t, seen, R, step) if step > 1 else -1
    return src if src != -1 else _source_among(g, t, seen, R, 1)


@njit(cache=True, nogil=True, inline="always")
def _source_among(g, t, seen, R, step):
    """:func:`_source_far`'s choice among nodes 0, step, 2·step, …; -1 when none of them is reachable."""
    src = full = -1
    bs = fs = -np.inf
    for u in range(0, g.data.shape[0], step):
        if seen[u]:
            s = dot(g.data[u], g.data[t])
            if g.degree[u] < R and s > bs:
                bs = s
                src = u
            if s > fs:
                fs = s
                full = u
    return src if src >= 0 else -2 - full


@njit(cache=True, nogil=True)
def link_unreachable(g, entries, R, far_pool):
    """Guarantee reachability from ``entries``: each unreachable node t gets an in-edge, from a reachable
    node near t in the graph (:func:`_source_near`: t's out-neighbours are its similar keys), else by
    inner product (:func:`_source_far`, among a stride of about ``far_pool`` nodes when > 0, e.g. :data:`FAR_POOL`: a way in, not
    a fine neighbourhood). Reachability is updated incrementally (BFS from t only),
    so this is O(edges) plus a scan per node with no reachable out-neighbour. Returns how many
    in-edges were added."""
    n = g.data.shape[0]
    step = max(1, n // far_pool) if far_pool > 0 else 1
    seen = reachable_from(g, entries)
    queue = np.empty(n, np.int64)
    linked = 0
    for sweep in range(3):  # a replaced edge may strand a node: re-check
        replaced = 0
        for t in range(n):
            if not seen[t]:
                src = _source_near(g, t, seen, R)
                src = _source_far(g, t, seen, R, step) if src < 0 else src
                if src >= 0:
                    g.nbrs[src, g.degree[src]] = t
                    g.degree[src] += 1
                else:
                    g.nbrs[-2 - src, R - 1] = t
                    replaced += 1
                linked += 1
                mark_from(g, t, seen, queue)
        if replaced == 0:
            break  # edges were only added, so `seen` is still exact and now whole: no second BFS (add calls this each time)
        seen = reachable_from(g, entries)
        if seen.all():
            break
    return linked
