"""One kernel call for a layer's per-head graph searches (``graph.multi.search_heads`` / ``GraphGroup``).

References are independent of the code under test: each index searched alone (``Index.search``),
numpy exact top-k, a plain-Python sorted-list beam search (``graph_reference``), and a float64 numpy
softmax for the decoder's CPU side.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from anns_lab.decode.kernels import attend_rows, attend_rows_and_range
from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.indexes import Index
from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph import multi as gs
from anns_lab.indexes.graph.search import FULL_ROWS, search_one
from anns_lab.indexes.graph.utils import Workspace, heap_slots, thread_workspace
from anns_lab.indexes.roargraph import RoarGraphIndex
from graph_reference import row_stop_search, sorted_list_search

BUILD = dict(M=8, R=16, n_hubs=8, keep_queries=64)


def _clustered(rng, n, d, centers=12, spread=0.3):
    c = rng.normal(size=(centers, d))
    return (c[rng.integers(0, centers, n)] + spread * rng.normal(size=(n, d))).astype(np.float32)


@pytest.fixture(scope="module")
def gqa():
    """Two KV heads × three query heads: each query head's roargraph on its KV head's (shared) key array."""
    rng = np.random.default_rng(0)
    g, group, n, d = 2, 3, 1500, 24
    keys = [_clustered(rng, n, d) for _ in range(g)]
    indexes = []
    for h in range(g * group):
        train = (_clustered(rng, 400, d) + rng.normal(size=d).astype(np.float32)).astype(np.float32)
        indexes.append(RoarGraphIndex(**BUILD, recent_entries=4 * (h % 2)).build(keys[h // group], train))
    queries = _clustered(rng, g * group, d)
    return keys, indexes, queries, group


def _alone(indexes, queries, k, L, stop=FULL_ROWS):
    return [ix.search(queries[i: i + 1], k, L=L, row_misses=stop[0], row_credit=stop[1]) for i, ix in enumerate(indexes)]


def _assert_same(res, alone):
    for i, r in enumerate(alone):
        np.testing.assert_array_equal(res.ids[i], r.ids[0])
        np.testing.assert_array_equal(res.scores[i], r.scores[0])
        assert res.n_scanned[i] == r.n_scanned[0]
        assert res.bytes_read[i] == r.bytes_read[0]


DEFAULT_STOP = (RoarGraphIndex.search_params["row_misses"].default, RoarGraphIndex.search_params["row_credit"].default)


@pytest.mark.parametrize("stop", [FULL_ROWS[:2], DEFAULT_STOP])
@pytest.mark.parametrize("k,L", [(10, 40), (50, 20), (1, 1), (100, 100)])
def test_group_search_equals_each_index_alone(gqa, k, L, stop):
    keys, indexes, queries, _ = gqa
    res = gs.search_graphs(indexes, queries, k, L, stop)
    assert res.ids.shape == (len(indexes), k) and res.n_scanned.shape == (len(indexes),)
    _assert_same(res, _alone(indexes, queries, k, L, stop))
    group = gs.GraphGroup(indexes)
    for _ in range(3):  # the visited array is reused through epochs
        _assert_same(group.search(queries, k, L, stop), _alone(indexes, queries, k, L, stop))
    got = RoarGraphIndex.search_group(indexes, queries, k, L=L, row_misses=stop[0], row_credit=stop[1])
    assert got.ids.tolist() == res.ids.tolist() and got.n_scanned.tolist() == res.n_scanned.tolist()
    if stop == DEFAULT_STOP:  # the decoder's call (L only) searches as Index.search does by default
        _assert_same(RoarGraphIndex.search_group(indexes, queries, k, L=L),
                     [ix.search(queries[i: i + 1], k, L=L) for i, ix in enumerate(indexes)])


def test_a_default_group_search_is_each_index_default_search(gqa):
    """GraphGroup.search and search_graphs without L or a row stop search as each index's own default search does
    (the defaults live in RoarGraphIndex.search_params: a group search must not fall back to full rows)."""
    keys, indexes, queries, _ = gqa
    own = [ix.search(queries[i: i + 1], 10) for i, ix in enumerate(indexes)]
    _assert_same(gs.GraphGroup(indexes).search(queries, 10), own)
    _assert_same(gs.search_graphs(indexes, queries, 10), own)
    _assert_same(RoarGraphIndex.search_group(indexes, queries, 10), own)
    L = RoarGraphIndex.search_params["L"].default
    assert gs.own_defaults(RoarGraphIndex, None, None) == (L, DEFAULT_STOP)
    full = gs.GraphGroup(indexes).search(queries, 10, L, FULL_ROWS[:2])  # what the old default searched
    assert any(full.n_scanned[i] != r.n_scanned[0] for i, r in enumerate(own))  # so this test tells the two apart


def test_gqa_group_holds_each_key_array_once(gqa):
    keys, indexes, queries, group = gqa
    grp = gs.GraphGroup(indexes)
    for h in range(len(indexes)):
        assert np.shares_memory(grp.keys[h], grp.keys[(h // group) * group])  # one physical array per KV head


def test_exhaustive_beam_is_exact_top_k_and_counts_every_key(gqa):
    """With L ≥ n every reachable key enters the beam: the result is numpy's exact top-k, each key scanned once,
    every row read once (bytes_read: every key, every row's degree and ids, the entry list)."""
    keys, indexes, queries, group = gqa
    n = keys[0].shape[0]
    res = gs.GraphGroup(indexes).search(queries, 30, n, FULL_ROWS[:2])
    for h, q in enumerate(queries):
        scores = keys[h // group].astype(np.float64) @ q.astype(np.float64)
        exact = np.argsort(-scores)[:30]
        np.testing.assert_array_equal(res.ids[h], exact)
        np.testing.assert_allclose(res.scores[h], scores[exact], rtol=1e-5, atol=1e-5)
        assert res.n_scanned[h] == n  # entry points included, no key counted twice
        ix = indexes[h]
        rows = n + int(ix._degree.sum())  # every node expanded: its degree word and its ids
        assert res.bytes_read[h] == n * 4 * keys[0].shape[1] + 4 * rows + 8 * len(ix.entries())


def test_recall_against_numpy_exact(gqa):
    keys, indexes, queries, group = gqa
    rng = np.random.default_rng(5)
    qs = [(queries + 0.3 * rng.normal(size=queries.shape)).astype(np.float32) for _ in range(10)]
    recall = {}
    for L in (32, 300):
        hits = []
        for q in qs:
            res = gs.search_graphs(indexes, q, 20, L, FULL_ROWS[:2])
            for h in range(len(indexes)):
                exact = np.argsort(-(keys[h // group] @ q[h]))[:20]
                hits.append(len(set(exact) & set(res.ids[h])) / 20)
            assert np.all(res.n_scanned < keys[0].shape[0])  # a graph search, not a scan of everything
        recall[L] = np.mean(hits)
    assert recall[32] > 0.6 and recall[300] > 0.95 and recall[300] >= recall[32], recall


def test_refresh_after_add(gqa):
    keys, indexes, queries, group = gqa
    rng = np.random.default_rng(1)
    fresh = [RoarGraphIndex(**BUILD, recent_entries=8).build(keys[0].copy(), _clustered(rng, 300, keys[0].shape[1]))
             for _ in range(2)]
    q = queries[:2]
    grp = gs.GraphGroup(fresh)
    before = gs.search_graphs(fresh, q, 10, 30, FULL_ROWS[:2])  # caches a group for these indexes
    new = _clustered(rng, 40, keys[0].shape[1]) * 3  # large norms: the new keys win the top-k
    for ix in fresh:
        ix.add(new)
    assert not grp.current()
    grp.refresh()
    assert grp.current()
    after = grp.search(q, 10, 30, FULL_ROWS[:2])
    _assert_same(after, _alone(fresh, q, 10, 30))
    assert (after.ids >= keys[0].shape[0]).any() and not (before.ids >= keys[0].shape[0]).any()
    _assert_same(gs.search_graphs(fresh, q, 10, 30, FULL_ROWS[:2]), _alone(fresh, q, 10, 30))  # the cached group notices the add



def test_the_workspace_is_kept_while_an_index_grows_a_key_per_step():
    """A decoder's index gains a key per step: its thread's workspace must not be made anew each time (it was)."""
    def steps(n0, count):
        made = set()
        for i in range(count):
            full, rows, epoch = thread_workspace(4, n0 + i, 200, 100)
            assert full[0].shape[1] >= n0 + i and rows[0][1].shape[0] >= heap_slots(n0 + i, 200, 100)
            made.add(id(full[0]))
        return len(made)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a thread of its own: the workspace is per thread
        assert pool.submit(steps, 4096, 200).result() == 1  # 200 steps within the room one growth leaves
        assert pool.submit(steps, 4096, 4096).result() <= 12  # a doubling: ~11 growths of 1/16 (not 4,096)

def _int_graph(seed, n=600, d=8, r=10):
    """Keys/queries whose inner products are exact in float32 (integers < 2^24) and all distinct (key j adds j < 4096)."""
    rng = np.random.default_rng(seed)
    keys = np.concatenate([rng.integers(-20, 21, (n, d)), np.arange(n)[:, None]], axis=1).astype(np.float32)
    queries = np.concatenate([4096 * rng.integers(-20, 21, (5, d)), np.ones((5, 1))], axis=1).astype(np.float32)
    nbrs = np.stack([rng.choice(n, r, replace=False) for _ in range(n)]).astype(np.int32)
    degree = rng.integers(r // 2, r + 1, n).astype(np.int32)
    return keys, queries, nbrs, degree


@pytest.mark.parametrize("seed", range(4))
def test_search_one_is_the_sorted_list_beam_search(seed):
    """search_one (heaps, SIMD inner product) against a sorted-list search (numpy inner product) on exact scores:
    the same nodes scanned, expanded and adjacency words read (1 + degree per expanded node); for L ≥ k the same
    top-k; for L < k the exact best k of every node scanned."""
    keys, queries, nbrs, degree = _int_graph(seed)
    entries = np.array([0, 7, 7, -1, 99], np.int64)
    for L, k in [(1, 1), (5, 5), (32, 20), (200, 20), (200, 700), (1, 20), (2, 20), (5, 20), (32, 50)]:
        for q in queries:
            ids, scores, n_scanned, expanded = sorted_list_search(keys, nbrs, degree, q, entries, L, np.dot)
            size = len(ids)
            out_ids, out_scores = np.empty(k, np.int64), np.empty(k, np.float32)
            slots = heap_slots(len(keys), L, k)
            assert slots == len(keys) + L + (k if L < k else 0)
            ws = Workspace(np.zeros(len(keys), np.int32), np.empty(slots, np.float32), np.empty(slots, np.int64),
                           np.empty(len(keys), np.int64), np.empty(0, np.float32))
            got, words, ne = search_one(Graph(keys, nbrs, degree), q, entries, L, ws, 1, out_ids, out_scores, FULL_ROWS)
            assert got == n_scanned and np.array_equal(ws.expanded[:ne], expanded)  # the builds' expanded nodes too
            assert words == ne + int(degree[expanded].sum())
            if L < k:  # the scanned nodes: the entry points and the rows of the expanded ones
                ids = np.unique(np.concatenate([entries[entries >= 0], *(nbrs[v, :degree[v]] for v in expanded)]))
                assert len(ids) == n_scanned
                scores = keys[ids] @ q  # exact in float32 (integers), all distinct
                order = np.argsort(-scores)
                ids, scores, size = ids[order], scores[order], len(ids)
            m = min(size, k)
            np.testing.assert_array_equal(out_ids[:m], ids[:m])
            np.testing.assert_array_equal(out_scores[:m], scores[:m])
            assert np.all(out_ids[m:] == -1) and np.all(np.isneginf(out_scores[m:]))


# -- the decoder's CPU side --------------------------------------------------------------------------


def _softmax_ref(q, keys, values, rows, scaling):
    logits = (keys[rows].astype(np.float64) @ q.astype(np.float64)) * scaling
    w = np.exp(logits - logits.max())
    return (w / w.sum()) @ values[rows].astype(np.float64), logits.max(), w.sum()


def test_attend_rows_and_range_against_numpy():
    rng = np.random.default_rng(2)
    h, g, n, d = 6, 2, 200, 16
    q = rng.normal(size=(h, d)).astype(np.float32)
    keys = (3 * rng.normal(size=(g, n, d))).astype(np.float32)
    values = rng.normal(size=(g, n, d)).astype(np.float32)
    rows = np.stack([rng.choice(150, 30, replace=False) for _ in range(h)]).astype(np.int64)
    rows[:, ::4] = -1
    for lo, hi in [(150, 170), (150, 150), (0, 0)]:
        out, m, z = attend_rows_and_range(q, keys, values, rows, lo, hi, 0.25)
        for head in range(h):
            sel = np.concatenate([rows[head][rows[head] >= 0], np.arange(lo, hi)])
            o_ref, m_ref, z_ref = _softmax_ref(q[head], keys[head // 3], values[head // 3], sel, 0.25)
            np.testing.assert_allclose(out[head], o_ref, rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose([m[head], z[head]], [m_ref, z_ref], rtol=1e-9)
    out0, m0, z0 = attend_rows_and_range(q, keys, values, np.full((h, 3), -1, np.int64), 5, 5, 0.25)
    assert np.all(out0 == 0) and np.all(np.isneginf(m0)) and np.all(z0 == 0)
    np.testing.assert_array_equal(attend_rows(q, keys, values, rows, 0.25)[0],
                                  attend_rows_and_range(q, keys, values, rows, 7, 3, 0.25)[0])  # empty range


@pytest.mark.parametrize("name,params", [("roargraph", {"L": 40}), ("flat", {})])
def test_layer_store_side_equals_per_index_search_then_attention(name, params, monkeypatch):
    """LayerStore.side (one search_group call per step: one graph kernel call for roargraph) against each index
    searched alone + numpy attention, before and after tokens leave the window (side-buffer) and are added."""
    rng = np.random.default_rng(3)
    n_heads, g, n, d, topk = 4, 2, 500, 16, 24
    keys = np.stack([_clustered(rng, n, d) for _ in range(g)])
    values = rng.normal(size=(g, n, d)).astype(np.float32)
    build = BUILD if name == "roargraph" else {}
    store = LayerStore(0, n_heads, keys, values, topk, IndexPlan(name, build, params), add_batch=8)
    store.build(np.stack([_clustered(rng, 200, d) for _ in range(n_heads)]))
    cls = type(store.indexes[0])
    assert (cls.search_group.__func__ is not Index.search_group.__func__) == (name == "roargraph")
    calls, original = [], cls.search_group
    monkeypatch.setattr(cls, "search_group", classmethod(lambda c, *a, **kw: calls.append(1) or original(*a, **kw)))

    def check():
        q = _clustered(rng, n_heads, d)
        side = store.side(q, 0.3)
        n_bytes = 0
        for h in range(n_heads):
            r = store.indexes[h].search(q[h: h + 1], min(topk, store.n_indexed), **params)
            n_bytes += int(r.bytes_read[0])
            sel = np.concatenate([r.ids[0][r.ids[0] >= 0], np.arange(store.n_indexed, store.n_rows)])
            o_ref, m_ref, z_ref = _softmax_ref(q[h], store.keys[h // 2], store.values[h // 2], sel, 0.3)
            np.testing.assert_allclose(side.out[h], o_ref, rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose([side.m[h], side.z[h]], [m_ref, z_ref], rtol=1e-9)
        assert 0 < side.scanned <= 1
        assert side.bytes_read == n_bytes  # the layer's index data read: every head's search, summed
        if name == "flat":
            assert side.bytes_read == n_heads * store.n_indexed * 4 * d

    check()
    for step in range(3):  # 5 tokens a step: side-buffer, an add of all 10 (≥ add_batch 8), side-buffer again
        store.extend(_clustered(rng, 5, d)[None].repeat(g, 0) * (1 + step), rng.normal(size=(g, 5, d)).astype(np.float32))
        check()
    assert store.n_indexed == n + 10 and store.n_rows == n + 15
    assert len(calls) == 4  # one search_group call per step, the decoder's only way into the indexes
    if name == "roargraph":  # the keys are held once, by the store: every head's graph reads its buffer
        assert all(np.shares_memory(ix.graph_arrays()[0], store.keys) for ix in store.indexes)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("stop", [(6, 0.3, 600), (1, 0.0, 600), (2, 1.0, 600), (2, 0.3, 450)])
def test_search_one_with_a_row_stop_is_the_reference_walk(seed, stop):
    """search_one with a row stop (C, ρ) against a plain-Python sorted-list search that walks each row in stages
    (``graph_reference.row_stop_search``), on exact scores: the same nodes scanned and expanded, the same adjacency
    words read and the same top-k (L ≥ k) or best k of every node scanned (L < k), keys ≥ A (added after a build)
    scanned where a walk stops; a workspace reused through epochs (the scores a query left behind must not count).
    A stop no row reaches is the full-row search."""
    keys, queries, nbrs, degree = _int_graph(seed, r=16)
    nbrs[::7, 3] = -1  # holes in some rows: skipped, their word read
    entries = np.array([0, 7, 7, -1, 99], np.int64)
    for L, k in [(5, 5), (32, 20), (64, 64), (8, 30)]:
        slots = heap_slots(len(keys), L, k)
        ws = (np.zeros(len(keys), np.int32), np.empty(slots, np.float32), np.empty(slots, np.int64),
              np.empty(len(keys), np.int64), np.empty(len(keys), np.float32))
        for epoch, q in enumerate(queries, 1):
            ids, scores, scanned, n_words, expanded = row_stop_search(keys, nbrs, degree, q, entries, L, stop, np.dot)
            out_ids, out_scores = np.empty(k, np.int64), np.empty(k, np.float32)
            got, words, ne = search_one(Graph(keys, nbrs, degree), q, entries, L, ws, epoch, out_ids, out_scores, stop)
            assert (got, words) == (len(scanned), n_words)
            np.testing.assert_array_equal(ws[3][:ne], expanded)
            if L < k:  # the k best of every node the reference scanned (exact, distinct scores)
                s = keys[scanned] @ q
                order = np.argsort(-s)
                ids, scores = scanned[order], s[order]
            m = min(len(ids), k)
            np.testing.assert_array_equal(out_ids[:m], ids[:m])
            np.testing.assert_array_equal(out_scores[:m], scores[:m])
            assert np.all(out_ids[m:] == -1)
            if stop == (1, 0.0, 600):  # a row stop no row reaches is the full-row search (the holes' words read too)
                got = search_one(Graph(keys, nbrs, degree), q, entries, L, ws, epoch + 100, out_ids, out_scores,
                                 (10**6, 0.0, 600))
                got_exp = ws[3][:got[2]].copy()
                full = search_one(Graph(keys, nbrs, degree), q, entries, L, ws, epoch + 200, out_ids.copy(), out_scores.copy(),
                                  FULL_ROWS)
                assert got == full and got[1] == got[2] + int(degree[got_exp].sum())
                np.testing.assert_array_equal(ws[3][:full[2]], got_exp)


@pytest.mark.parametrize("hints", [[], [7, 5, 300, 420]])
@pytest.mark.parametrize("stop", [FULL_ROWS[:2], (6, 0.3), (1, 0.0)])
def test_interleaved_heads_equal_one_search_at_a_time(stop, hints):
    """search_heads (the heads' searches interleaved stage by stage) against search_one per head, graphs of
    different sizes and entry lists, a workspace reused through epochs, full rows and row stops (one head with
    keys added after its build); with hints, against search_one entering at the head's entries then the hints
    (one of them repeating an entry point: scanned once)."""
    hints = np.array(hints, np.int64)
    graphs = [_int_graph(seed, n=n) for seed, n in [(10, 600), (11, 450), (12, 700)]]
    keys, nbrs, degree = (tuple(g[i] for g in graphs) for i in (0, 2, 3))
    entries = tuple(np.array([i, 3 * i + 1, -1, 5], np.int64) for i in range(len(graphs)))
    n_max, h = 700, len(graphs)
    added = np.array([600, 400, 700], np.int64)
    lists = (keys, nbrs, degree, entries, added)
    for L, k in [(32, 10), (100, 100), (5, 5)]:
        slots = heap_slots(n_max, L, k)
        ws = Workspace(np.zeros((h, n_max), np.int32), np.empty((h, slots), np.float32), np.empty((h, slots), np.int64),
                       np.empty(0, np.int64), np.empty((h, n_max), np.float32))
        for epoch in (1, 2):
            q = np.stack([g[1][epoch] for g in graphs])
            ids, scores, scanned = np.empty((h, k), np.int64), np.empty((h, k), np.float32), np.empty(h, np.int64)
            words = np.empty(h, np.int64)
            gs.search_heads(lists, q, L, stop, ws, epoch, (ids, scores, scanned, words), hints)
            for i, (kk, _, nb, dg) in enumerate(graphs):
                ref_ids, ref_scores = np.empty(k, np.int64), np.empty(k, np.float32)
                s1 = heap_slots(len(kk), L, k)
                w1 = Workspace(np.zeros(len(kk), np.int32), np.empty(s1, np.float32), np.empty(s1, np.int64),
                               np.empty(0, np.int64), np.empty(len(kk), np.float32))
                ref_n, ref_w, _ = search_one(Graph(kk, nb, dg), q[i], np.concatenate([entries[i], hints]), L, w1, 1,
                                             ref_ids, ref_scores, (stop[0], stop[1], int(added[i])))
                np.testing.assert_array_equal(ids[i], ref_ids)
                np.testing.assert_array_equal(scores[i], ref_scores)
                assert scanned[i] == ref_n and words[i] == ref_w
    with pytest.raises(ValueError, match="L >= k"):  # L < k (a top-k heap besides the beam) is search_one's
        gs.search_heads(lists, q, 5, stop, ws, 3, (np.empty((h, 6), np.int64), np.empty((h, 6), np.float32), scanned, words),
                        hints)
