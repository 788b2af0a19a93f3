"""IVF's recall against keys scanned at every ``nprobe``, to explain its Q→K / K→K gap one factor at a time.

The sweep searches a doubling ``nprobe`` grid, so its fraction for a recall target is read between
grid points a doubling apart (``metrics.at_recall``). Here the curve is exact at every ``nprobe``
(1 … nlist): each query ranks the lists by its coarse score, and recall at ``nprobe`` is the share of its true top-k that lie
in the first ``nprobe`` lists (IVF-Flat scores every key of a probed list exactly, so nothing
else is lost). Lists come from faiss's own IVF training (inner-product assignment, as the lab's
``ivf`` index), or L2 k-means for the in-distribution L2 search that ANN benchmarks measure.
"""

from __future__ import annotations

import faiss
import numpy as np

from anns_lab.eval import metrics
from anns_lab.indexes.ivf import auto_nlist

SEED = 1234  # the ivf index's default k-means seed


def lists(keys: np.ndarray, nlist: int, metric: str = "ip", seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """(centroids (nlist, d), list of each key (n,)) as faiss's IndexIVFFlat trains and fills them."""
    d = keys.shape[1]
    quantizer = faiss.IndexFlatIP(d) if metric == "ip" else faiss.IndexFlatL2(d)
    index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2)
    index.cp.seed = seed
    index.cp.verbose = False
    index.train(keys)
    _, assign = quantizer.search(keys, 1)  # what index.add does with each key
    return quantizer.reconstruct_n(0, nlist), assign[:, 0]


def _scores(queries: np.ndarray, vectors: np.ndarray, metric: str) -> np.ndarray:
    ip = metrics.exact_scores(queries, vectors).astype(np.float64)
    if metric == "ip":
        return ip
    # Negative squared L2 distance: larger is nearer, like an inner product.
    return 2 * ip - (vectors.astype(np.float64) ** 2).sum(1)[None, :] - (queries.astype(np.float64) ** 2).sum(1)[:, None]


def curve(keys: np.ndarray, queries: np.ndarray, k: int = 100, metric: str = "ip", nlist: int | None = None,
          seed: int = SEED, trained: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(mean fraction scanned, mean recall@k) at nprobe = 1 … nlist; scanned counts the nlist centroids too.

    ``trained``: the :func:`lists` of these keys and metric, to reuse one training for several query sets.
    """
    keys = np.ascontiguousarray(keys, dtype=np.float32)
    n = len(keys)
    centroids, assign = trained or lists(keys, nlist or auto_nlist(n), metric, seed)
    nlist = len(centroids)
    order = np.argsort(-_scores(queries, centroids, metric), axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(nlist)[None, :].repeat(len(queries), 0), axis=1)
    scores = _scores(queries, keys, metric)
    hits = scores >= metrics.kth_scores(scores, k)[:, None]  # ties at the k-th score count, as in recall_at_k
    per_rank = np.zeros((len(queries), nlist))
    rows, cols = np.nonzero(hits)
    np.add.at(per_rank, (rows, rank[rows, assign[cols]]), 1)
    recall = (np.minimum(np.cumsum(per_rank, axis=1), k) / k).mean(axis=0)
    sizes = np.bincount(assign, minlength=nlist)
    scanned = (nlist + np.cumsum(sizes[order], axis=1)).mean(axis=0) / n
    return scanned, recall


def lists_holding(keys: np.ndarray, queries: np.ndarray, k: int, trained: tuple[np.ndarray, np.ndarray],
                  metric: str = "ip") -> float:
    """Mean number of distinct lists that hold a query's exact top-k: how scattered its answers are."""
    _, assign = trained
    top = metrics.exact_topk(_scores(queries, keys, metric), k)
    return float(np.mean([len(np.unique(assign[row])) for row in top]))


def fraction_at(scanned: np.ndarray, recall: np.ndarray, target: float = 0.95) -> float:
    """Least fraction scanned whose recall reaches ``target`` (inf if none)."""
    ok = np.flatnonzero(recall >= target)
    return float(scanned[ok[0]]) if len(ok) else float("inf")


def grid_steps(scanned: np.ndarray, recall: np.ndarray, grid: tuple[int, ...], target: float = 0.95) -> tuple[float, float]:
    """The fractions of the two grid points around the target: the last below it and the first reaching it."""
    nlist = len(scanned)
    points = sorted({min(p, nlist) for p in grid} | {nlist})
    below = [scanned[p - 1] for p in points if recall[p - 1] < target]
    above = [scanned[p - 1] for p in points if recall[p - 1] >= target]
    return (float(below[-1]) if below else float("nan"), float(above[0]) if above else float("inf"))


def diagnose(data, k: int = 100, nlist: int | None = None, seed: int = SEED, paper_keys: int = 131072) -> dict:
    """One head's factors: fine-grained IP fractions both ways, K→K by L2, and both at the paper's share of keys.

    ``data`` is a :class:`~anns_lab.eval.heads.HeadData`. The paper asks for the top 100 of ~128K keys; the
    same share of this head's keys is top-``k_share``.
    """
    keys, q, held = np.ascontiguousarray(data.keys, dtype=np.float32), data.test_queries, data.k2k_queries
    k_share = max(1, round(k * len(keys) / paper_keys))
    nlist = nlist or auto_nlist(len(keys))
    trained = {m: lists(keys, nlist, m, seed) for m in ("ip", "l2")}
    out = {"n_keys": len(keys), "k": k, "k_share": k_share}
    for name, queries, metric, kk in (("q2k", q, "ip", k), ("k2k", held, "ip", k), ("k2k_l2", held, "l2", k),
                                      ("q2k_share", q, "ip", k_share), ("k2k_share", held, "ip", k_share)):
        out[name] = fraction_at(*curve(keys, queries, kk, metric, trained=trained[metric]))
    out["nlist"] = nlist
    out["q2k_lists"] = lists_holding(keys, q, k, trained["ip"])
    out["k2k_lists"] = lists_holding(keys, held, k, trained["ip"])
    norms = np.linalg.norm(keys, axis=1)
    big = norms >= np.quantile(norms, 0.9)
    out["k2k_top_big_norm"] = float(big[metrics.exact_topk(metrics.exact_scores(held, keys), k)].mean())
    out["q2k_top_big_norm"] = float(big[metrics.exact_topk(metrics.exact_scores(q, keys), k)].mean())
    return out
