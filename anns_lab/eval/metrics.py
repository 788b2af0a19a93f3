"""Metric functions (docs/metrics.md), each on plain arrays so tests can check them by hand.

Scores are inner products q·k. "Ties at the k-th score count as hits": a returned key whose
exact score is at least the k-th largest exact score is a true top-k key.
"""

from __future__ import annotations

import numpy as np


def exact_scores(queries: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """All inner products (nq, n) in float32 (a blocked BLAS matmul)."""
    return np.asarray(queries, dtype=np.float32) @ np.asarray(keys, dtype=np.float32).T


def kth_scores(scores: np.ndarray, k: int) -> np.ndarray:
    """The k-th largest score of each row: the threshold a hit must reach."""
    return np.partition(scores, -k, axis=1)[:, -k]


def exact_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest scores per row, best first (ground truth)."""
    part = np.argpartition(scores, -k, axis=1)[:, -k:]
    order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)


def recall_at_k(ids: np.ndarray, scores: np.ndarray, k: int) -> np.ndarray:
    """Per-query recall@k of returned ``ids`` (−1 = none; a repeat counts once) against exact ``scores`` (nq, n), ties
    counted as hits."""
    thresh = kth_scores(scores, k)
    ids, valid = _distinct(ids)
    hit = valid & (np.take_along_axis(scores, np.maximum(ids, 0), axis=1) >= thresh[:, None])
    return np.minimum(hit.sum(axis=1), k) / k


def softmax_weights(scores: np.ndarray, scaling: float) -> np.ndarray:
    """exp(scaling · (score − the row's best)) of exact ``scores`` (nq, n), in place: each key's attention weight up to
    the row's normaliser (float32: a weight below ~1e-45 of the best, a scaled gap over ~103, is 0; subnormals
    below ~1e-38 keep few digits; no sum here notices either)."""
    scores -= scores.max(axis=1, keepdims=True)
    scores *= np.float32(scaling)
    return np.exp(scores, out=scores)


def topk_weight(weights: np.ndarray, k: int) -> np.ndarray:
    """Per row, the summed weight of the k heaviest keys: what exact top-k attention keeps."""
    return np.partition(weights, -k, axis=1)[:, -k:].sum(axis=1, dtype=np.float64)


def weight_recall_at_k(ids: np.ndarray, weights: np.ndarray, k: int, best: np.ndarray | None = None) -> np.ndarray:
    """Per query, the weight (:func:`softmax_weights`) of the distinct returned ``ids`` over that of the exact top-k
    (``best``: :func:`topk_weight` when the caller keeps it): recall@k with each key counted by its attention weight,
    so a missed key costs what attention loses with it (a near-tie swapped for the k+1-th costs almost nothing)."""
    best = topk_weight(weights, k) if best is None else best
    ids, valid = _distinct(ids)
    got = np.where(valid, np.take_along_axis(weights, np.maximum(ids, 0), axis=1), 0).sum(axis=1, dtype=np.float64)
    return np.minimum(got / best, 1.0)


def _distinct(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` (nq, r) sorted per row, and which entries are a row's first occurrence of a valid id (−1 = none)."""
    ids = np.sort(np.asarray(ids, dtype=np.int64), axis=1)  # repeats side by side, -1 first
    first = np.ones(ids.shape, bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return ids, first & (ids >= 0)


def attention_over(logits: np.ndarray, values: np.ndarray, subset: np.ndarray | None = None) -> np.ndarray:
    """softmax(logits restricted to ``subset``) · values, in float64; ``subset`` None means all."""
    if subset is not None:
        logits, values = logits[subset], values[subset]
    w = np.exp(logits - logits.max())
    return (w / w.sum()) @ values


def mass_recovered(logits: np.ndarray, subset: np.ndarray) -> float:
    """Share of the full softmax mass that falls on ``subset`` (indices into ``logits``)."""
    w = np.exp(logits - logits.max())
    return float(w[np.unique(subset)].sum() / w.sum())


def output_rel_error(logits: np.ndarray, values: np.ndarray, subset: np.ndarray,
                     full: np.ndarray | None = None) -> float:
    """‖o_subset − o_full‖ / ‖o_full‖: what attention over only ``subset`` costs the output.

    ``full``: ``attention_over(logits, values)`` when the caller already has it (it is the same for every subset).
    """
    full = attention_over(logits, values) if full is None else full
    part = attention_over(logits, values, np.unique(subset))
    return float(np.linalg.norm(part - full) / np.linalg.norm(full))


def mahalanobis(points: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Mahalanobis distance of each point to the distribution of ``reference`` rows (paper Fig. 3b)."""
    ref = np.asarray(reference, dtype=np.float64)
    mu = ref.mean(axis=0)
    cov = np.cov(ref, rowvar=False) + 1e-6 * np.eye(ref.shape[1])
    diff = np.asarray(points, dtype=np.float64) - mu
    return np.sqrt(np.einsum("ij,ij->i", diff @ np.linalg.inv(cov), diff))


def frontier(quality, cost) -> np.ndarray:
    """Positions of one head's operating points on the cost frontier, cheapest first: each point (finite ``quality``
    and ``cost``) scores a higher ``quality`` than every cheaper one (among equal costs the best first). Any other point
    is worse than one of these at no less cost."""
    quality, cost = np.asarray(quality, dtype=float), np.asarray(cost, dtype=float)
    best, out = -np.inf, []
    for i in np.lexsort((-quality, cost)):  # by cost, the best first among equal costs
        if np.isfinite(quality[i]) and np.isfinite(cost[i]) and quality[i] > best:
            best = quality[i]
            out.append(int(i))
    return np.asarray(out, dtype=np.int64)


def at_recall(recall, cost, target: float) -> tuple[float, int, int, float]:
    """The cost of mean recall ``target`` on one head's grid of operating points (``recall`` and ``cost`` per point):
    on the :func:`frontier`, the first point that reaches the target, or, where a cheaper frontier point falls short
    of it, the line between the two at the target: the expected cost of searching each query at one of them, with
    the chance that makes the expected recall ``target``, a mixture any index can run. So an index whose grid steps
    coarsely is not charged the whole step past the target (at the grid points, pqcache's and clusterkv's bytes at
    0.95 overshot by a median 1.2x, roargraph's by 1.06x: BENCHMARKS "Today's figures: read between grid points").
    Mixes of points further apart can cost less where the frontier is not concave (at most 3.3%, on 6 of 273 real
    (index, head) pairs): not sought.
    Returns (cost, below, reached, weight): the positions of the two points (``below == reached`` where a frontier
    point meets the target with none cheaper short of it, or meets it exactly) and ``reached``'s weight in the mix;
    (nan, -1, -1, nan) where no point reaches it."""
    recall, cost = np.asarray(recall, dtype=float), np.asarray(cost, dtype=float)
    below = -1
    for i in frontier(recall, cost):
        if recall[i] >= target:
            if below < 0 or recall[i] == target:  # no step to cross: the grid point's own cost
                return float(cost[i]), int(i), int(i), 1.0
            w = (target - recall[below]) / (recall[i] - recall[below])
            return float(cost[below] + w * (cost[i] - cost[below])), below, int(i), float(w)
        below = int(i)
    return float("nan"), -1, -1, float("nan")


def within_budget(quality, cost, budget: float) -> float:
    """The best mean ``quality`` one head's grid of operating points reaches at an expected cost of at most
    ``budget``: :func:`at_recall` the other way round. On the :func:`frontier`, the last point within the budget, or,
    where the next costs more, the mix of the two whose expected cost is the budget (each query searched at one of
    them); NaN where no point is within it. For a loss such as an output error pass ``-error`` and negate."""
    quality, cost = np.asarray(quality, dtype=float), np.asarray(cost, dtype=float)
    best = -1
    for i in frontier(quality, cost):
        if cost[i] > budget:
            if best < 0:
                return float("nan")
            w = (budget - cost[best]) / (cost[i] - cost[best])
            return float(quality[best] + w * (quality[i] - quality[best]))
        best = int(i)
    return float(quality[best]) if best >= 0 else float("nan")


def median_frontier(heads: list, per_segment: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """The median over heads of what each head reaches within a cost: at each cost, the median of
    :func:`within_budget` over ``heads`` (one pair of ``quality`` and ``cost`` arrays per head), sampled ``per_segment``
    steps between consecutive costs of any head's frontier, evenly in linear cost (a mix of two settings is a line
    there, a curve on a log axis). A head with no point within a cost reaches nothing there, so the line starts
    where more than half the heads have one. Each head's quality only grows with cost, so for an odd number of heads
    the line reaches a target exactly at :func:`at_recall`'s median cost over heads, the tables' figure; for an even
    number, between the two middle heads' costs (the tables give their mean; where exactly half the heads reach it,
    the tables say never, and the mean of the two middle readings may still reach it). The median of each grid point
    across heads can lie either side of the line. Returns (costs, qualities)."""
    fronts = []
    for quality, cost in heads:
        quality, cost = np.asarray(quality, dtype=float), np.asarray(cost, dtype=float)
        f = frontier(quality, cost)
        if len(f):
            fronts.append((cost[f], quality[f]))
    if not fronts:
        return np.empty(0), np.empty(0)
    costs = np.unique(np.concatenate([c for c, _ in fronts]))
    t = np.linspace(0.0, 1.0, per_segment, endpoint=False)
    xs = np.concatenate([(a + t * (b - a)) for a, b in zip(costs[:-1], costs[1:])] + [costs[-1:]])
    ys = np.full((len(heads), len(xs)), -np.inf)  # heads without a finite point reach nothing anywhere
    for row, (c, q) in zip(ys, fronts):
        row[:] = np.interp(xs, c, q, left=-np.inf, right=q[-1])
    med = np.median(ys, axis=0)
    keep = np.isfinite(med)
    return xs[keep], med[keep]
