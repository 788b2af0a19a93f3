"""Where roargraph's scans at recall@100 0.95 could still go: measurements on real heads, at today's build.

    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 oracle
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 shift
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15 --heads 1,4,7 cluster-rows --clusters 8
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 trajectory-rows [--boundary]
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15 --heads 0,4,8 shortcuts [--front]
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 feedback [--fed interleave] [--exact]
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 lonely-keys --via cosine
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 15 --heads 6,8 copy-hints
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 augment --spread 0.6
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 top-structure

The sweep's protocol in one process (``eval.heads.load_head``; one thread), each head built once at the defaults:

- ``oracle``: each decode query given the grid ``L`` that minimises the mean scans at mean recall ``--target``
  (a Lagrangian over the per-query (scans, recall) curves), against one ``L`` for all: the bound of any per-query
  stop or search length.
- ``shift``: the scanned fraction at the target for the decode queries, for 64 prefill queries of the second half
  held out of the training (moved to the serving positions as the training is) and for the newest 64 training
  queries: how much of the cost is the decode queries' shift from what the graph was trained on.
- ``cluster-rows``: the same edges, each row sorted by co-occurrence within the lists of the training queries of one
  of C k-means clusters (ties by all lists'); a decode query walks the order of its nearest centroid, the C
  centroid products counted as scanned.
- ``trajectory-rows``: the same edges, each row sorted by how often its neighbour was in the exact top-100 of a
  training query whose search (at ``--learn-L``, today's row stop) expanded the row's key (ties: the shared order);
  the signal co-occurrence lacks at the region's boundary, where a key outside a query's lists is expanded
  (``--boundary``: count only those expansions).
- ``shortcuts``: the same graph plus, for each training query searched at ``--learn-L`` (in order, each seeing the
  edges added before it), an edge to every key of its exact top-100 the search missed, from the best of its first
  ``--first`` found keys whose row has room, at the row's end (``--front``: its front).
- ``feedback``: a decoder feeding its decode queries back into the training (each step's query of the head and its
  top-M_sq list a training query of the later steps): ``--fed sequential`` (default): block b of ``--block`` steps
  served by the graph built again with the blocks before it and the lists that graph's searches found (the best M_sq
  of the keys a search at the serving L scanned: no product more; ``--feed-L``: a second search at that L; a search
  that scanned fewer feeds nothing; ``--exact``: their exact lists, which a decoder would pay a full scan for);
  ``half``: the first half of the steps fed with exact lists; ``interleave``: the even steps (an optimistic bound:
  each test step's neighbours on both sides trained). Against the graph as built on the same test steps, both on exact training lists, and IVF on them
  (its defaults and grid).
- ``lonely-keys``: the same graph plus, for each key with fewer than ``--below`` in-edges (on hard heads the decode
  queries' misses are such keys, in no training list), an in-edge from each of its ``--sources`` nearest keys
  (``--via`` ip or cosine), from the first keys of the training query whose top-M_sq list it comes closest to
  entering (``query``), or to and from the keys beside it in the text (``span``), where a row has room, at its end
  (``--front``: its front).
- ``augment``: the graph built from the build's own training queries plus ``--extra`` x as many synthetic ones, each a
  kept query moved by ``--spread`` x a draw of the kept queries' covariance (``--iso``: isotropic, of its mean
  variance): lists of the keys just beyond the real queries' lists.
- ``top-structure``: no other graph; what the decode queries' exact top-100 keys are (``top_structure``).
- ``copy-hints``: each decode step's search also entered at the decoder's copy hints (``decode.copy_hints``, from the
  dump's tokens; counted as scanned), against none: the sweep has no hints, the decoder does.

Prints one line per head and the median per-head ratio (oracle: to one L; cluster-rows, trajectory-rows: to the shared
order; shortcuts, feedback, lonely-keys, augment: to the graph as built; copy-hints: to no hints; shift: decode over trained).
"""

from __future__ import annotations

import argparse

import faiss
import numba
import numpy as np
import scipy.sparse as sp
from numba import njit

from anns_lab.decode.copy_hints import CopyHints
from anns_lab.dumps import rope
from anns_lab.dumps.store import open_dump
from anns_lab.eval.heads import load_head
from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph.multi import search_graphs
from anns_lab.indexes.graph.search import search_batch, search_one, typed_stop
from anns_lab.indexes.graph.utils import workspace
from anns_lab.indexes.registry import create
from anns_lab.indexes.roargraph import RoarGraphIndex, auto_lists, auto_train, subsample
from anns_lab.indexes.topk import topk_ip
from bench_build_scale import scan_at

K = 100
GRID = RoarGraphIndex.search_grid["L"]


def curves(search, queries: np.ndarray, keys: np.ndarray, grid=GRID) -> tuple[np.ndarray, np.ndarray]:
    """Per grid point and query: recall@K and keys scanned, (len(grid), nq) each; ``search(queries, L)`` → (ids, scanned)."""
    exact = topk_ip(queries, keys, K)
    recall, scanned = [], []
    for L in grid:
        ids, n = search(queries, L)
        recall.append([len(np.intersect1d(a[a >= 0], b)) / K for a, b in zip(ids, exact)])
        scanned.append(n)
    return np.array(recall), np.array(scanned, np.float64)


def at_target(recall: np.ndarray, scanned: np.ndarray, n_keys: int, target: float) -> float:
    """Scanned fraction (%) at mean recall ``target`` over the grid (interpolated as bench_query_aware.py's tables and
    the report's)."""
    return 100 * scan_at(list(zip(scanned.mean(axis=1) / n_keys, recall.mean(axis=1))), target)


def oracle(recall: np.ndarray, scanned: np.ndarray, target: float) -> float:
    """Least mean scans at mean recall ≥ ``target`` with each query at its own grid L (Lagrangian, bisection)."""
    lo, hi = 0.0, 1e9
    cols = np.arange(recall.shape[1])
    for _ in range(80):
        lam = (lo + hi) / 2
        pick = np.argmin(scanned - lam * recall, axis=0)
        lo, hi = (lo, lam) if recall[pick, cols].mean() >= target else (lam, hi)
    return float(scanned[np.argmin(scanned - hi * recall, axis=0), cols].mean())


def index_search(index, param: str = "L"):
    """``search(queries, value)`` → (ids, scanned) of ``index.search`` with its grid parameter ``param`` at value."""
    return lambda q, v: (lambda r: (r.ids, r.n_scanned))(index.search(q, K, **{param: v}))


def cluster_rows(index: RoarGraphIndex, data, clusters: int):
    """A search over ``clusters`` copies of the graph, rows ordered per training-query cluster (module doc)."""
    keys, n = data.keys, len(data.keys)
    rows = subsample(len(data.train_queries), auto_train(n), index.params["keep_queries"])
    train = data.train_queries if rows is None else data.train_queries[rows]
    m_sq = auto_lists(n)[0]
    lists = topk_ip(train, keys, m_sq).astype(np.int64)
    km = faiss.Kmeans(train.shape[1], clusters, niter=20, seed=1)
    km.train(np.ascontiguousarray(train))
    label = np.argmax(train @ km.centroids.T, axis=1)
    hold = sp.csr_matrix((np.ones(lists.size, np.float32), lists.ravel(), np.arange(0, lists.size + 1, m_sq)),
                         shape=(len(train), n))
    nbrs, degree = index._nbrs, index._degree
    valid = np.arange(nbrs.shape[1]) < degree[:, None]
    src, dst = np.nonzero(valid)[0], nbrs[valid].astype(np.int64)
    both = np.asarray((hold.T @ hold).tocsr()[src, dst]).ravel()
    graphs = []
    for c in range(clusters):
        part = hold[label == c]
        score = np.full(nbrs.shape, -np.inf)
        score[valid] = np.asarray((part.T @ part).tocsr()[src, dst]).ravel() * (both.max() + 1) + both
        order = np.argsort(-score, axis=1, kind="stable")
        graphs.append(Graph(keys, np.ascontiguousarray(np.where(valid, np.take_along_axis(nbrs, order, 1), -1)), degree))
    entries, stop = _serving(index)

    def search(q, L):
        ids, scanned = np.zeros((len(q), K), np.int64), np.zeros(len(q), np.int64)
        nearest = np.argmax(q @ km.centroids.T, axis=1)
        for c in np.unique(nearest):
            w = np.flatnonzero(nearest == c)
            out = search_batch(graphs[c], np.ascontiguousarray(q[w]),
                               np.ascontiguousarray(np.broadcast_to(entries, (len(w), len(entries)))), L, K, 1, stop)
            ids[w], scanned[w] = out[0], out[2] + clusters
        return ids, scanned
    return search


@njit(cache=True)
def _trajectory_hits(g, queries, top, entries, L, ws, stop, boundary):
    """Per adjacency slot of ``g``: how many of ``queries`` expanded its row and hold its neighbour in their ``top``
    (``boundary``: only expansions of keys outside that query's ``top``); ``ws`` records every expanded node."""
    data, nbrs, degree = g
    n = data.shape[0]
    hits = np.zeros(nbrs.shape, np.int32)
    mark = np.zeros(n, np.int32)
    out_ids = np.empty(top.shape[1], np.int64)
    out_s = np.empty(top.shape[1], np.float32)
    for qi in range(queries.shape[0]):
        for v in top[qi]:
            mark[v] = qi + 1
        _, _, ne = search_one(g, queries[qi], entries, L, ws, qi + 1, out_ids, out_s, stop)
        for e in range(ne):
            u = ws[3][e]
            if boundary and mark[u] == qi + 1:
                continue
            for j in range(degree[u]):
                if mark[nbrs[u, j]] == qi + 1:
                    hits[u, j] += 1
    return hits


def _training(index: RoarGraphIndex, data, every: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The training queries the build learnt from (``every``: all of them) and their exact top-K key ids."""
    rows = None if every else subsample(len(data.train_queries), auto_train(len(data.keys)), index.params["keep_queries"])
    train = np.ascontiguousarray(data.train_queries if rows is None else data.train_queries[rows])
    return train, topk_ip(train, data.keys, K).astype(np.int64)


def _serving(index: RoarGraphIndex) -> tuple[np.ndarray, tuple]:
    """The index's entry points and today's default row stop, as the kernels take them."""
    defaults = {name: param.default for name, param in RoarGraphIndex.search_params.items()}
    return (np.ascontiguousarray(index.entries(), np.int64),
            typed_stop((defaults["row_misses"], defaults["row_credit"], index.n_built)))


def _graph_search(g: Graph, entries: np.ndarray, stop: tuple):
    """``search(queries, L)`` → (ids, scanned) over ``g`` from ``entries`` with row stop ``stop``, one thread."""
    def search(q, L):
        out = search_batch(g, q, np.ascontiguousarray(np.broadcast_to(entries, (len(q), len(entries)))), L, K, 1, stop)
        return out[0], out[2]
    return search


def trajectory_rows(index: RoarGraphIndex, data, learn_L: int, boundary: bool):
    """A search over the same graph, each row ordered by its slots' trajectory hits (module doc)."""
    train, top = _training(index, data)
    entries, stop = _serving(index)
    keys, nbrs, degree = data.keys, index._nbrs, index._degree
    ws = workspace(len(keys), learn_L, K, expanded=len(keys))
    hits = _trajectory_hits((keys, nbrs, degree), train, top, entries, learn_L, ws, stop, boundary)
    valid = np.arange(nbrs.shape[1]) < degree[:, None]
    order = np.argsort(np.where(valid, -hits, 1 << 30), axis=1, kind="stable")
    g = Graph(keys, np.ascontiguousarray(np.where(valid, np.take_along_axis(nbrs, order, 1), -1)), degree)
    return _graph_search(g, entries, stop)


@njit(cache=True)
def _shortcuts(g, queries, top, entries, L, ws, stop, first, front):
    """Online: each training query is searched, and each key of its exact ``top`` the search missed gets an in-edge
    from the best of its first ``first`` found keys whose row has room (at the row's ``front`` or end)."""
    data, nbrs, degree = g
    n = data.shape[0]
    found = np.zeros(n, np.int32)
    out_ids = np.empty(top.shape[1], np.int64)
    out_s = np.empty(top.shape[1], np.float32)
    added = 0
    for qi in range(queries.shape[0]):
        search_one(g, queries[qi], entries, L, ws, qi + 1, out_ids, out_s, stop)
        for v in out_ids:
            if v >= 0:
                found[v] = qi + 1
        for v in top[qi]:
            if found[v] == qi + 1:
                continue
            for t in range(min(first, out_ids.shape[0])):
                u = out_ids[t]
                if u < 0 or u == v or degree[u] >= nbrs.shape[1]:
                    continue
                dup = False
                for j in range(degree[u]):
                    if nbrs[u, j] == v:
                        dup = True
                if dup:
                    continue
                d = degree[u]
                if front:
                    for j in range(d, 0, -1):
                        nbrs[u, j] = nbrs[u, j - 1]
                    nbrs[u, 0] = v
                else:
                    nbrs[u, d] = v
                degree[u] = d + 1
                added += 1
                break
    return added


def shortcut_rows(index: RoarGraphIndex, data, learn_L: int, first: int, front: bool, every: bool):
    """A search over the graph with the missed keys' shortcuts added (module doc)."""
    train, top = _training(index, data, every)
    entries, stop = _serving(index)
    keys, nbrs, degree = data.keys, index._nbrs.copy(), index._degree.copy()
    added = _shortcuts((keys, nbrs, degree), train, top, entries, learn_L, workspace(len(keys), learn_L, K), stop,
                       first, front)
    print(f"  {added} shortcuts ({added / len(keys):.2f} per key), degree {index._degree.mean():.1f} -> {degree.mean():.1f}")
    return _graph_search(Graph(keys, nbrs, degree), entries, stop)


def lonely_in_edges(index: RoarGraphIndex, data, below: int, sources: int, front: bool, via: str):
    """A search over the graph with in-edges for its lonely keys (module doc)."""
    keys, nbrs, degree = data.keys, index._nbrs.copy(), index._degree.copy()
    R = nbrs.shape[1]
    indeg = np.bincount(nbrs[np.arange(R) < degree[:, None]], minlength=len(keys))
    lonely = np.flatnonzero(indeg < below)
    if via == "span":  # key ids are in position order: a lonely key's neighbours in the text, both ways
        edges = [(u, w) for v in lonely for u, w in ((v - 1, v), (v + 1, v), (v, v - 1), (v, v + 1))
                 if 0 <= min(u, w) and max(u, w) < len(keys)]
    else:
        if via == "query":  # the training query whose list v comes closest to entering: in-edges from its first keys
            train, _ = _training(index, data)
            top = topk_ip(train, keys, auto_lists(len(keys))[0])
            last = np.einsum("qd,qd->q", train, keys[top[:, -1]])
            near = top[np.argmax(keys[lonely] @ train.T - last[None, :], axis=1)]
        else:
            unit = keys / np.linalg.norm(keys, axis=1, keepdims=True) if via == "cosine" else keys
            near = topk_ip(np.ascontiguousarray(unit[lonely]), np.ascontiguousarray(unit), sources + 1)
        edges = [(u, v) for v, row in zip(lonely, near) for u in row[row != v][:sources]]
    added = 0
    for u, w in edges:  # where u's row has room and lacks w, at its end (front: its front)
        d = degree[u]
        if d >= R or w in nbrs[u, :d]:
            continue
        if front:
            nbrs[u, 1:d + 1] = nbrs[u, :d].copy()
        nbrs[u, 0 if front else d] = w
        degree[u] = d + 1
        added += 1
    print(f"  {len(lonely)} keys with in-degree < {below}, {added} edges added")
    return _graph_search(Graph(keys, nbrs, degree), *_serving(index))


def augmented(index: RoarGraphIndex, data, extra: float, spread: float, iso: bool, seed: int = 0) -> RoarGraphIndex:
    """The graph built from the build's own training queries plus ``extra`` x as many synthetic ones: each a kept query
    moved by ``spread`` x a draw from the kept queries' covariance (lists of keys near a real query's that no real
    query ranks high enough to list)."""
    n = len(data.keys)
    rows = index.train_rows(n, len(data.train_queries))
    real = data.train_queries if rows is None else data.train_queries[rows]
    rng = np.random.default_rng(seed)
    m = int(round(extra * len(real)))
    centred = real - real.mean(axis=0)
    cov = np.cov(centred, rowvar=False)
    if iso:  # the same total variance in every direction
        cov = np.eye(len(cov)) * np.trace(cov) / len(cov)
    chol = np.linalg.cholesky(cov + 1e-6 * np.eye(real.shape[1]))
    fake = real[rng.integers(0, len(real), m)] + spread * rng.standard_normal((m, real.shape[1])) @ chol.T
    train = np.ascontiguousarray(np.concatenate([fake, real]), np.float32)  # the real ones newest: add()'s kept queries
    return RoarGraphIndex(max_train=len(train)).build(data.keys, train)


def top_structure(dump, index: RoarGraphIndex, data) -> str:
    """What the decode queries' exact top-K keys are: the share in some training list, the share with a text neighbour
    also in the top (a passage), the distinct tokens among them (copies of a few tokens), and the share of a top key's
    10 nearest keys by cosine that are in the top too (8 queries; where key clusters fit, as IVF's do)."""
    tokens = np.asarray(dump.tokens(), np.int64)
    top = topk_ip(data.test_queries, data.keys, K)
    pos = data.key_pos[top]
    train, _ = _training(index, data)
    listed = np.zeros(len(data.keys), np.bool_)
    listed[topk_ip(train, data.keys, auto_lists(len(data.keys))[0])] = True
    passage = np.mean([np.isin(p + 1, p) | np.isin(p - 1, p) for p in pos])
    distinct = np.mean([len(np.unique(tokens[p])) for p in pos])
    unit = np.ascontiguousarray(data.keys / np.linalg.norm(data.keys, axis=1, keepdims=True))
    near = topk_ip(np.ascontiguousarray(unit[top[:8].ravel()]), unit, 11)[:, 1:].reshape(8, K, 10)
    clustered = np.mean([np.isin(near[i], top[i]).mean() for i in range(len(near))])
    return (f"in a training list {listed[top].mean():.3f}, beside a top key in the text {passage:.2f}, "
            f"distinct tokens {distinct:.0f}, of a top key's 10 nearest keys in the top {clustered:.2f}")


def copy_hints(dump, data, cap: int) -> list[np.ndarray]:
    """Each decode step's copy hints as the decoder makes them (``decode.copy_hints``), as the index's key ids."""
    tokens = np.asarray(dump.tokens(), np.int64)
    hints, out = CopyHints(cap), []
    for pos in data.test_pos:
        hints.update(tokens[: pos + 1])
        at = np.searchsorted(data.key_pos, hints.positions)
        at = np.minimum(at, len(data.key_pos) - 1)
        out.append(at[data.key_pos[at] == hints.positions].astype(np.int64))  # those in the window or held out: none
    return out


def hinted_search(index: RoarGraphIndex, hints: list[np.ndarray]):
    """``search(queries, L)`` with each query's copy hints as extra entry points (counted), one query at a time."""
    def search(q, L):
        ids, scanned = np.full((len(q), K), -1, np.int64), np.zeros(len(q), np.int64)
        for i in range(len(q)):
            r = search_graphs([index], q[i:i + 1], K, L, None, hints[i])
            ids[i], scanned[i] = r.ids[0], r.n_scanned[0]
        return ids, scanned
    return search


def ivf_at_target(keys: np.ndarray, queries: np.ndarray, target: float) -> float:
    """IVF's scanned % at the target (its defaults and sweep grid; centroid products counted) on these queries."""
    ivf = create("ivf").build(keys)
    grid = [point["nprobe"] for point in ivf.grid()]
    return at_target(*curves(index_search(ivf, "nprobe"), queries, keys, grid), len(keys), target)


def feedback(dump, data, how: str, block: int, exact: bool, feed_L: int, target: float) -> tuple[float, float, float]:
    """Scanned % at the target on the test steps: (graph as built, graph with decode steps fed back, IVF; module
    doc)."""
    steps = len(dump.positions("decode"))
    if len(data.test_queries) != steps:
        raise SystemExit("feedback: the test queries must be the decode steps alone (a dump of >= 64 decode tokens)")
    steps_q = data.test_queries  # the head's own decode queries, as its graph trains on its own (--train-group head)
    keys, n = data.keys, len(data.keys)
    index = RoarGraphIndex()
    rows = index.train_rows(n, len(data.train_queries))
    train = np.ascontiguousarray(data.train_queries if rows is None else data.train_queries[rows])
    m_sq = RoarGraphIndex.train_topk_width(n)
    top = topk_ip(train, keys, m_sq).astype(np.int64)  # exact lists for both graphs: they differ by the fed steps only

    def build(q, lists):
        return RoarGraphIndex(max_train=len(q)).build(keys, np.ascontiguousarray(q, np.float32), train_topk=lists)

    base = build(train, top)
    if how != "sequential":
        fed = np.arange(0, steps, 2) if how == "interleave" else np.arange(steps // 2)
        test = np.setdiff1d(np.arange(steps), fed)
        q_fed = steps_q[fed]
        fed_graph = build(np.concatenate([train, q_fed]), np.concatenate([top, topk_ip(q_fed, keys, m_sq)]))
        curve = curves(index_search(fed_graph), np.ascontiguousarray(steps_q[test]), keys)
    else:
        # block b is served by the graph trained on blocks < b with the lists that graph's searches found: the
        # best M_sq keys of those a serving search scanned (no product more), at the L where the newest 64
        # training queries reach the target (as the decoder calibrates on the prompt's newest queries)
        r_new, _ = curves(index_search(base), np.ascontiguousarray(train[-64:]), keys)
        serve_L = feed_L or GRID[min(int(np.searchsorted(r_new.mean(axis=1) >= target, True)), len(GRID) - 1)]
        test = np.arange(block, steps)
        graph, parts, fed_q, fed_lists, skipped = base, [], [], [], 0
        for b in range(block, steps, block):
            q_new = np.ascontiguousarray(steps_q[b - block:b])
            if exact:
                found = topk_ip(q_new, keys, m_sq).astype(np.int64)
            else:
                found = graph.search(q_new, m_sq, L=serve_L).ids.astype(np.int64)
            full = (found >= 0).all(axis=1)  # a search that scanned fewer than M_sq keys has no list to feed
            skipped += int((~full).sum())
            fed_q.append(q_new[full])
            fed_lists.append(found[full])
            graph = build(np.concatenate([train, *fed_q]), np.concatenate([top, *fed_lists]))
            parts.append(curves(index_search(graph), np.ascontiguousarray(steps_q[b:b + block]), keys))
        curve = tuple(np.concatenate(c, axis=1) for c in zip(*parts))
        print("  fed exact lists" if exact else f"  fed lists found at L {serve_L}; {skipped} of {steps - block} steps "
              "scanned fewer than M_sq keys and fed nothing", flush=True)
    q = np.ascontiguousarray(steps_q[test])
    return at_target(*curves(index_search(base), q, keys), n, target), at_target(*curve, n, target), ivf_at_target(keys, q, target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", required=True)
    ap.add_argument("--heads", default=None, help="comma-separated (default: every query head)")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("what", choices=["oracle", "shift", "cluster-rows", "trajectory-rows", "shortcuts", "feedback",
                                       "lonely-keys", "copy-hints", "augment", "top-structure"])
    ap.add_argument("--extra", type=float, default=1.0, help="augment: synthetic training queries per real one")
    ap.add_argument("--iso", action="store_true", help="augment: isotropic draws of the covariance's mean variance")
    ap.add_argument("--spread", type=float, default=0.5, help="augment: the draws' scale (x the queries' covariance)")
    ap.add_argument("--cap", type=int, default=8, help="copy-hints: the decoder's --copy-hints")
    ap.add_argument("--below", type=int, default=3, help="lonely-keys: keys with fewer in-edges than this")
    ap.add_argument("--sources", type=int, default=4, help="lonely-keys: in-edges from this many nearest keys")
    ap.add_argument("--via", choices=["ip", "cosine", "query", "span"], default="ip",
                    help="lonely-keys: sources nearest by inner product or cosine, or the first keys of the training "
                         "query whose list the key comes closest to entering; span: edges to and from the keys beside it in the text")
    ap.add_argument("--fed", choices=["half", "interleave", "sequential"], default="sequential",
                    help="feedback: which decode steps are fed back (module doc)")
    ap.add_argument("--block", type=int, default=8, help="feedback --fed sequential: steps per rebuild")
    ap.add_argument("--exact", action="store_true", help="feedback --fed sequential: feed exact lists, not found ones")
    ap.add_argument("--feed-L", type=int, default=0,
                    help="feedback --fed sequential: the fed lists found by a search at this L (0: the serving L)")
    ap.add_argument("--boundary", action="store_true", help="trajectory-rows: count expansions outside the top only")
    ap.add_argument("--first", type=int, default=1, help="shortcuts: from the best this many found keys")
    ap.add_argument("--front", action="store_true", help="shortcuts, lonely-keys: at the rows' front (default: their end)")
    ap.add_argument("--every", action="store_true", help="shortcuts: every training query (default: the build's)")
    ap.add_argument("--clusters", type=int, default=8)
    ap.add_argument("--learn-L", type=int, default=100, help="trajectory-rows, shortcuts: the training queries' beam")
    a = ap.parse_args()
    if a.cap < 1:
        ap.error("--cap must be at least 1 (copy-hints measures the hints against none)")
    numba.set_num_threads(1)
    dump = open_dump(a.dump)
    n_prefill = int(dump.manifest["n_tokens"]["prefill"])
    held = np.sort(np.random.default_rng(0).choice(np.arange(n_prefill // 2, n_prefill - 700), 64, replace=False))
    heads = [int(h) for h in a.heads.split(",")] if a.heads else range(dump.n_heads)
    ratios, gains = [], []
    for layer in (int(x) for x in a.layers.split(",")):
        for head in heads:
            data = load_head(dump, layer, head, held_out=held if a.what == "shift" else None)
            if a.what == "feedback":
                one, best, ivf = feedback(dump, data, a.fed, a.block, a.exact, a.feed_L, a.target)
                ratios.append(best / one)
                gains.append((ivf / one, ivf / best))
                print(f"{layer}/{head}: built {one:.3f}%, decode steps fed back {best:.3f}%, IVF {ivf:.3f}% "
                      f"(x IVF {ivf / one:.2f} -> {ivf / best:.2f}), ratio {best / one:.3f}", flush=True)
                continue
            index = RoarGraphIndex().build(data.keys, data.train_queries)
            n = len(data.keys)
            r, s = curves(index_search(index), data.test_queries, data.keys)
            one = at_target(r, s, n, a.target)
            if a.what == "oracle":
                best = 100 * oracle(r, s, a.target) / n
                line, ratio = f"one L {one:.3f}%, each query its own L {best:.3f}%", best / one
            elif a.what == "shift":
                freqs = rope.dump_inv_freq(dump.manifest, layer)
                lo, hi = int(data.test_pos.min()), int(data.test_pos.max())
                out = rope.placed(dump.queries(layer, head, "prefill")[held], held, lo, hi, freqs, "serving")
                held_q = np.ascontiguousarray(out, dtype=np.float32)
                best = at_target(*curves(index_search(index), held_q, data.keys), n, a.target)
                newest = at_target(*curves(index_search(index), np.ascontiguousarray(data.train_queries[-64:]),
                                           data.keys), n, a.target)
                line = f"decode {one:.3f}%, held-out prefill {best:.3f}%, trained (newest 64) {newest:.3f}%"
                ratio = one / newest  # decode over trained
            elif a.what == "copy-hints":
                hints = copy_hints(dump, data, a.cap)
                best = at_target(*curves(hinted_search(index, hints), data.test_queries, data.keys), n, a.target)
                line = f"no hints {one:.3f}%, the decoder's copy hints {best:.3f}% ({np.mean([len(h) for h in hints]):.1f} per step)"
                ratio = best / one
            elif a.what == "top-structure":
                print(f"{layer}/{head}: {one:.3f}%, {top_structure(dump, index, data)}", flush=True)
                continue
            elif a.what == "augment":
                best = at_target(*curves(index_search(augmented(index, data, a.extra, a.spread, a.iso)), data.test_queries,
                                         data.keys), n, a.target)
                line, ratio = f"built {one:.3f}%, with synthetic queries {best:.3f}%", best / one
            elif a.what == "lonely-keys":
                best = at_target(*curves(lonely_in_edges(index, data, a.below, a.sources, a.front, a.via),
                                         data.test_queries, data.keys), n, a.target)
                line, ratio = f"built {one:.3f}%, lonely keys linked {best:.3f}%", best / one
            elif a.what == "shortcuts":
                best = at_target(*curves(shortcut_rows(index, data, a.learn_L, a.first, a.front, a.every),
                                         data.test_queries, data.keys), n, a.target)
                line, ratio = f"built {one:.3f}%, with shortcuts {best:.3f}%", best / one
            elif a.what == "trajectory-rows":
                best = at_target(*curves(trajectory_rows(index, data, a.learn_L, a.boundary), data.test_queries, data.keys), n,
                                 a.target)
                line, ratio = f"shared order {one:.3f}%, rows by trajectory hits (L {a.learn_L}) {best:.3f}%", best / one
            else:
                best = at_target(*curves(cluster_rows(index, data, a.clusters), data.test_queries, data.keys), n,
                                 a.target)
                line, ratio = f"shared order {one:.3f}%, rows per cluster (C {a.clusters}) {best:.3f}%", best / one
            ratios.append(ratio)
            print(f"{layer}/{head}: {line}, ratio {ratio:.3f}", flush=True)
    if ratios:
        print(f"{a.dump} {a.what}: median per-head ratio {np.nanmedian(ratios):.3f} over {len(ratios)} heads")
    if gains:
        print("median per-head IVF / roargraph: as built {:.2f}x, decode steps fed back {:.2f}x".format(*np.median(gains, axis=0)))


if __name__ == "__main__":
    main()
