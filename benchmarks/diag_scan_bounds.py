"""Where roargraph's scans at recall@100 0.95 could still go: three measurements on real heads, at today's build.

    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 oracle
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15,28 shift
    python benchmarks/diag_scan_bounds.py --dump /work/dumps/smollm2-man-8192 --layers 2,15 --heads 1,4,7 cluster-rows --clusters 8

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

Prints one line per head and the median per-head ratio (oracle and cluster-rows: to one L / the shared order;
shift: decode over trained).
"""

from __future__ import annotations

import argparse

import faiss
import numba
import numpy as np
import scipy.sparse as sp

from anns_lab.dumps import rope
from anns_lab.dumps.store import open_dump
from anns_lab.eval.heads import load_head
from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph.search import search_batch
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
    defaults = {name: param.default for name, param in RoarGraphIndex.search_params.items()}
    entries, stop = index.entries(), (defaults["row_misses"], defaults["row_credit"], index.n_built)

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--layers", required=True)
    ap.add_argument("--heads", default=None, help="comma-separated (default: every query head)")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("what", choices=["oracle", "shift", "cluster-rows"])
    ap.add_argument("--clusters", type=int, default=8)
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
            else:
                best = at_target(*curves(cluster_rows(index, data, a.clusters), data.test_queries, data.keys), n,
                                 a.target)
                line, ratio = f"shared order {one:.3f}%, rows per cluster (C {a.clusters}) {best:.3f}%", best / one
            ratios.append(ratio)
            print(f"{layer}/{head}: {line}, ratio {ratio:.3f}", flush=True)
    print(f"{a.dump} {a.what}: median per-head ratio {np.nanmedian(ratios):.3f} over {len(ratios)} heads")


if __name__ == "__main__":
    main()
