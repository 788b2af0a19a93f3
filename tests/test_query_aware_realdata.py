"""roargraph on real SmolLM2 attention (short dump): recall rises with L, and it beats the key-only graphs."""

import numpy as np
import pytest

from anns_lab.eval.heads import load_head
from anns_lab.indexes import registry
from anns_lab.indexes.roargraph import RoarGraphIndex
from anns_lab.testing import check_result, recall_at_k

pytestmark = pytest.mark.realmodel

K = 100
HEADS = [(2, 0), (15, 4)]


def curve(index, data):
    pts = []
    for params in index.grid():
        res = index.search(data.test_queries, K, **params)
        check_result(index, res, data.test_queries, data.keys, K, f"{index.name} {params}")
        pts.append((res.n_scanned.mean() / len(data.keys), recall_at_k(res.ids, data.test_queries, data.keys, K)))
    return pts


def scan_at(pts, target):
    prev = None
    for f, r in pts:
        if r >= target:
            return f if prev is None else prev[0] + (f - prev[0]) * (target - prev[1]) / (r - prev[1])
        prev = (f, r)
    return np.inf


@pytest.fixture(scope="module")
def heads(smollm2_dump):
    return {lh: load_head(smollm2_dump, *lh, window=(16, 128)) for lh in HEADS}


@pytest.mark.parametrize("lh", HEADS)
def test_recall_rises_with_L(heads, lh):
    data = heads[lh]
    pts = curve(RoarGraphIndex().build(data.keys, data.train_queries), data)
    recalls = [r for _, r in pts]
    assert all(b >= a - 0.01 for a, b in zip(recalls, recalls[1:])), recalls
    assert recalls[-1] >= 0.99 and recalls[-1] > recalls[0], recalls


@pytest.mark.parametrize("lh", HEADS)
@pytest.mark.parametrize("seed", [0, 1])
def test_beats_key_only_graphs(heads, lh, seed):
    """Fraction of keys scanned to reach recall@100 = 0.95 on decode queries (equal recall, compare n_scanned)."""
    data = heads[lh]
    ours = scan_at(curve(RoarGraphIndex(seed=seed).build(data.keys, data.train_queries), data), 0.95)
    assert ours < 0.5, ours
    for name in ("hnsw", "vamana"):
        other = scan_at(curve(registry.create(name, seed=seed).build(data.keys), data), 0.95)
        assert ours < 0.8 * other, (name, ours, other)


LIST_TOLERANCE = 0.03  # recall@100 an anchored build may lose against the exact-list build at a beam width (measured: up to 0.021 at L 50)


@pytest.mark.parametrize("lh", HEADS)
def test_anchored_lists_keep_recall(heads, lh):
    """Training lists exact only at every 8th query (the others ranking their neighbouring anchors' keys):
    recall on the decode queries within LIST_TOLERANCE of the exact lists' build at every grid point with full
    rows, and at L ≥ 100 with the default row stop (measured: ≤ 0.012 there; at L 50, recall ~0.8, the row stop
    widens the gap to 0.040 on head 2/0)."""
    data = heads[lh]
    exact = RoarGraphIndex(list_stride=1).build(data.keys, data.train_queries)
    anchored = RoarGraphIndex(list_stride=8).build(data.keys, data.train_queries)
    for L in (50, 100, 200):
        r = [recall_at_k(ix.search(data.test_queries, K, L=L, row_misses=0).ids, data.test_queries, data.keys, K)
             for ix in (exact, anchored)]
        assert r[1] >= r[0] - LIST_TOLERANCE, (L, r)
        if L >= 100:  # the default search (row stop) too, near its operating point (L 50: 0.040 lower on 2/0)
            r = [recall_at_k(ix.search(data.test_queries, K, L=L).ids, data.test_queries, data.keys, K)
                 for ix in (exact, anchored)]
            assert r[1] >= r[0] - LIST_TOLERANCE, (L, "row stop", r)
