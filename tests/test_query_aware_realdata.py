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


LIST_TOLERANCE = 0.035  # recall@100 an anchored build may lose against the exact-list build at a beam width (measured at R 40, lists of 150: up to 0.031 at L 50 with full rows, where recall is ~0.93; 0.029 with R 24, lists of 100)


@pytest.mark.parametrize("lh", HEADS)
def test_anchored_lists_keep_recall(heads, lh):
    """Training lists exact only at every 8th query (the others ranking their neighbouring anchors' keys):
    recall on the decode queries within LIST_TOLERANCE of the exact lists' build at every grid point with full
    rows, and at L ≥ 100 with the default row stop (measured: ≤ 0.019 there; at L 50, recall ~0.85-0.94, the row stop
    widens the gap to 0.038 on head 2/0)."""
    data = heads[lh]
    exact = RoarGraphIndex(list_stride=1).build(data.keys, data.train_queries)
    anchored = RoarGraphIndex(list_stride=8).build(data.keys, data.train_queries)
    for L in (50, 100, 200):
        r = [recall_at_k(ix.search(data.test_queries, K, L=L, row_misses=0).ids, data.test_queries, data.keys, K)
             for ix in (exact, anchored)]
        assert r[1] >= r[0] - LIST_TOLERANCE, (L, r)
        if L >= 100:  # the default search (row stop) too, near its operating point (L 50: 0.038 lower on 2/0)
            r = [recall_at_k(ix.search(data.test_queries, K, L=L).ids, data.test_queries, data.keys, K)
                 for ix in (exact, anchored)]
            assert r[1] >= r[0] - LIST_TOLERANCE, (L, "row stop", r)


TRAIN_TOLERANCE = {50: 0.04, 100: 0.03, 200: 0.03}  # recall@100 a build on half the training queries may lose (measured below)


@pytest.mark.parametrize("lh", HEADS)
def test_half_the_training_queries_keep_recall(heads, lh):
    """``MIN_TRAIN`` 2048: at 8K a build keeps 2048 of the 8192 prefill queries (a quarter, where 4096 kept half), at an
    even stride with the newest 256 whole. Here (2K tokens) half of them against all: recall on the decode queries
    within TRAIN_TOLERANCE at L 50, 100 and 200 with the default row stop (measured: 2/0 within 0.002 either way; 15/4
    0.028 / 0.021 / 0.0025 lower at L 50 / 100 / 200). At 8K a quarter scans as half does (BENCHMARKS "Scale")."""
    data = heads[lh]
    m = len(data.train_queries)
    every = RoarGraphIndex(max_train=m).build(data.keys, data.train_queries)
    half = RoarGraphIndex(max_train=m // 2).build(data.keys, data.train_queries)
    for L in (50, 100, 200):
        r = [recall_at_k(ix.search(data.test_queries, K, L=L).ids, data.test_queries, data.keys, K) for ix in (every, half)]
        assert r[1] >= r[0] - TRAIN_TOLERANCE[L], (L, r)


POOL_TOLERANCE = 0.02  # recall@100 a stranded keys' pool of ~n/15 may lose against 2048 (measured below)


@pytest.mark.parametrize("lh", HEADS)
def test_a_smaller_stranded_pool_keeps_recall(heads, lh, monkeypatch):
    """``stranded_pool``: below ~31K keys a stranded key's out-edges come from a stride of ~n/15 reachable keys (at least
    512: at 8K a stride of ~7 over ~3.5K) instead of 2048. Here (~1.9K keys, all reachable ones within 2048) the floor
    lowered so that the rule's n/15 applies (a stride of ~8): recall on the decode queries within POOL_TOLERANCE of the
    whole pool's at L 50, 100 and 200 with the default row stop (measured: equal, or up to 0.0005 higher, on both heads;
    at 8K the sweep's median scanned fraction at recall 0.95 rose 0.6%)."""
    from anns_lab.indexes import roargraph as rg

    data = heads[lh]
    large = RoarGraphIndex().build(data.keys, data.train_queries)
    monkeypatch.setattr(rg, "STRANDED_MIN", 1)
    assert rg.stranded_pool(len(data.keys)) < 150
    small = RoarGraphIndex().build(data.keys, data.train_queries)
    assert not np.array_equal(small._nbrs, large._nbrs)
    for L in (50, 100, 200):
        r = [recall_at_k(ix.search(data.test_queries, K, L=L).ids, data.test_queries, data.keys, K) for ix in (large, small)]
        assert r[1] >= r[0] - POOL_TOLERANCE, (L, r)


GROUP_TOLERANCE = {50: 0.06, 100: 0.03, 200: 0.03}  # recall@100 one graph per KV head may lose per query head (measured below)


@pytest.mark.parametrize("mode", ["group", "strided"])
def test_one_graph_per_kv_head_keeps_recall_for_every_head_of_its_group(smollm2_dump, mode):
    """One roargraph trained on the GQA group's prefill queries (--train-group; group: all 3 heads' 6,000, strided: one
    head's 2,000, round robin by position), searched with the decode queries of each of the group's query heads (layer 15,
    KV head 1: query heads 3, 4, 5): recall within GROUP_TOLERANCE of that head's own graph at L 50, 100, 200 (measured:
    at most 0.045 / 0.015 / 0.009 lower). Not every group keeps it: layer 2's head 1 loses 0.14-0.15 at L 100, which is
    why one graph per query head stays the default (BENCHMARKS "Query-aware graphs")."""
    for head in (3, 4, 5):
        own = load_head(smollm2_dump, 15, head, window=(16, 128))
        grouped = load_head(smollm2_dump, 15, head, window=(16, 128), train_group=mode)
        assert len(grouped.train_queries) == len(own.train_queries) * (3 if mode == "group" else 1)
        assert np.array_equal(grouped.keys, own.keys) and np.array_equal(grouped.test_queries, own.test_queries)
        graphs = [RoarGraphIndex().build(own.keys, q) for q in (own.train_queries, grouped.train_queries)]
        for L, tol in GROUP_TOLERANCE.items():
            r = [recall_at_k(ix.search(own.test_queries, K, L=L).ids, own.test_queries, own.keys, K) for ix in graphs]
            assert r[1] >= r[0] - tol, (head, L, r)


def test_group_training_queries_are_the_groups_before_the_first_test_query(smollm2_dump):
    """Causality for the group: every training row is some group head's prefill query before the first test position,
    and each (head, position) appears once (group) or each position once (strided). (At their own positions: moved to
    the serving ones, each row is turned, tests/test_train_positions.py.)"""
    own = load_head(smollm2_dump, 2, 4, window=(16, 128), train_positions="own")
    t = len(own.train_queries)
    assert own.test_pos.min() >= t  # the per-head rule the group keeps
    rows = {m: load_head(smollm2_dump, 2, 4, window=(16, 128), train_group=m, train_positions="own").train_queries
            for m in ("group", "strided")}
    group_q = np.stack([smollm2_dump.queries(2, h, "prefill")[:t] for h in (3, 4, 5)])  # (3, t, d)
    flat = {row.tobytes(): (h, p) for h in range(3) for p, row in enumerate(group_q[h])}
    got = [flat[r.tobytes()] for r in rows["group"]]
    assert sorted(got) == [(h, p) for h in range(3) for p in range(t)]
    got = [flat[r.tobytes()] for r in rows["strided"]]
    assert sorted(p for _, p in got) == list(range(t))


UNLISTED_TOLERANCE = 0.01  # recall@100 the unlisted keys' rows may cost a query head against its own graph (measured below)


def test_unlisted_keys_from_the_group_keep_recall_of_each_heads_own_graph(smollm2_dump):
    """--train-group unlisted: each query head's graph from its own queries, the group's other heads' newest queries
    giving rows only to the keys its own lists leave out, searched with that head's decode queries (layer 15, KV head 1:
    query heads 3, 4, 5): recall@100 within UNLISTED_TOLERANCE of the head's own graph at L 50, 100, 200 (measured: at
    most 0.0016 lower, head 3 at L 100). Layer 2 at this size is no case: the other heads' newest lists hold no key its
    own lists leave out, and its graphs are the same."""
    layer = 15
    for head in (3, 4, 5):
        own = load_head(smollm2_dump, layer, head, window=(16, 128))
        given = load_head(smollm2_dump, layer, head, window=(16, 128), train_group="unlisted")
        assert np.array_equal(given.train_queries, own.train_queries) and own.group_queries is None
        assert len(given.group_queries) == 2 * int(np.ceil(0.03 * len(own.train_queries)))
        graphs = [RoarGraphIndex().build(own.keys, own.train_queries),
                  RoarGraphIndex().build(own.keys, own.train_queries, group_queries=given.group_queries)]
        assert not np.array_equal(graphs[0]._nbrs, graphs[1]._nbrs)  # some unlisted key got a row
        for L in (50, 100, 200):
            r = [recall_at_k(ix.search(own.test_queries, K, L=L).ids, own.test_queries, own.keys, K) for ix in graphs]
            assert r[1] >= r[0] - UNLISTED_TOLERANCE, (head, L, r)
