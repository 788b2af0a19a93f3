"""Where roargraph's scans at recall@100 0.95 could still go: five measurements on real heads, at today's build.

    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 oracle
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 shift
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15 --heads 1,4,7 cluster-rows --clusters 8
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 trajectory-rows [--boundary]
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15 --heads 0,4,8 shortcuts [--front]

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

Prints one line per head and the median per-head ratio (oracle, cluster-rows, trajectory-rows, shortcuts: to one L /
the shared order / the graph as built; shift: decode over trained).
"""

from __future__ import annotations

import argparse

import faiss
import numba
import numpy as np
import scipy.sparse as sp
from numba import njit

from anns_lab.dumps import rope
from anns_lab.dumps.store import open_dump
from anns_lab.eval.heads import load_head
from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph.search import search_batch, search_one, typed_stop
from anns_lab.indexes.graph.utils import workspace
from anns_lab.indexes.roargraph import RoarGraphIndex, auto_lists, auto_train, subsample
from anns_lab.indexes.topk import topk_ip
from bench_build_scale import scan_at

K = 100
GRID = RoarGraphIndex.search_grid["L"]


def curves(search, queries: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per grid L and query: recall@K and keys scanned, (len(GRID), nq) each; ``search(queries, L)`` → (ids, scanned)."""
    exact = topk_ip(queries, keys, K)
    recall, scanned = [], []
    for L in GRID:
        ids, n = search(queries, L)
        recall.append([len(np.intersect1d(a[a >= 0], b)) / K for a, b in zip(ids, exact)])
        scanned.append(n)
    return np.array(recall), np.array(scanned, np.float64)


def at_target(recall: np.ndarray, scanned: np.ndarray, n_keys: int, target: float) -> float:
    """Scanned fraction (%) at mean recall ``target`` over the grid (interpolated as the sweep's tables)."""
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


def index_search(index: RoarGraphIndex):
    return lambda q, L: (lambda r: (r.ids, r.n_scanned))(index.search(q, K, L=L))


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", required=True)
    ap.add_argument("--heads", default=None, help="comma-separated (default: every query head)")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("what", choices=["oracle", "shift", "cluster-rows", "trajectory-rows", "shortcuts"])
    ap.add_argument("--boundary", action="store_true", help="trajectory-rows: count expansions outside the top only")
    ap.add_argument("--first", type=int, default=1, help="shortcuts: from the best this many found keys")
    ap.add_argument("--front", action="store_true", help="shortcuts: at the rows' front (default: their end)")
    ap.add_argument("--every", action="store_true", help="shortcuts: every training query (default: the build's)")
    ap.add_argument("--clusters", type=int, default=8)
    ap.add_argument("--learn-L", type=int, default=100, help="trajectory-rows, shortcuts: the training queries' beam")
    a = ap.parse_args()
    numba.set_num_threads(1)
    dump = open_dump(a.dump)
    n_prefill = int(dump.manifest["n_tokens"]["prefill"])
    held = np.sort(np.random.default_rng(0).choice(np.arange(n_prefill // 2, n_prefill - 700), 64, replace=False))
    heads = [int(h) for h in a.heads.split(",")] if a.heads else range(dump.n_heads)
    ratios = []
    for layer in (int(x) for x in a.layers.split(",")):
        for head in heads:
            data = load_head(dump, layer, head, held_out=held if a.what == "shift" else None)
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
    print(f"{a.dump} {a.what}: median per-head ratio {np.nanmedian(ratios):.3f} over {len(ratios)} heads")


if __name__ == "__main__":
    main()
