"""One attention-aware graph per KV head (``indexes.group_queries``): the rows it is trained on, and the decoder's
shared graph searched for every query head of its group (references: the rows picked by hand from positions and
heads, each head's query searched alone on the graph)."""

from __future__ import annotations

import numpy as np
import pytest

from anns_lab.decode.placement import IndexPlan, LayerStore
from anns_lab.errors import AnnsLabError
from anns_lab.indexes.group_queries import group_queries, other_heads
from anns_lab.indexes.graph import multi as gs

T, G, D = 20, 3, 4


def _per_head():
    """Head h's query at position p is the vector (h, p, 0, 0): every row names where it came from."""
    return [np.array([[h, p, 0, 0] for p in range(T)], np.float32) for h in range(G)]


def _origin(rows):
    return [(int(h), int(p)) for h, p in rows[:, :2]]


def test_group_is_every_query_head_major_then_the_newest_interleaved():
    rows = _origin(group_queries(_per_head(), "group", tail=7))
    assert sorted(rows) == [(h, p) for h in range(G) for p in range(T)]  # each query once
    tail = [(h, p) for p in range(T) for h in range(G)][-7:]  # the 7 newest (position, head) pairs, by position
    assert rows[-7:] == tail
    older = [r for r in rows[:-7]]
    assert older == sorted(older)  # head-major, each head in position order


def test_strided_takes_one_head_per_position_round_robin_from_the_newest():
    rows = _origin(group_queries(_per_head(), "strided", tail=5))
    assert sorted(p for _, p in rows) == list(range(T))  # one head's count: every position once
    assert all(h == (T - 1 - p) % G for h, p in rows)  # the newest position from head 0, the next from head 1, ...
    assert rows[-5:] == [((T - 1 - p) % G, p) for p in range(T - 5, T)]  # the newest in position order
    assert rows[:-5] == sorted(rows[:-5])


def test_head_is_the_first_heads_own_and_bad_input_is_refused():
    per = _per_head()
    assert group_queries(per, "head") is per[0]
    assert group_queries(per[:1], "group") is per[0]  # a group of one (MHA) is its head
    with pytest.raises(AnnsLabError, match="choose one of head, group, strided, unlisted"):
        group_queries(per, "pooled")
    with pytest.raises(AnnsLabError, match="different query shapes"):
        group_queries([per[0], per[1][:-1]], "group")


def _clustered(rng, n, d, centers=12, spread=0.3):
    c = rng.normal(size=(centers, d))
    return (c[rng.integers(0, centers, n)] + spread * rng.normal(size=(n, d))).astype(np.float32)


@pytest.mark.parametrize("name", ["roargraph", "flat"])
def test_layer_store_builds_one_index_per_kv_head_and_searches_it_for_each_query_head(name):
    """per_kv_head: one index object per KV head, shared by its group's query heads; the layer's one search_group
    call (roargraph: one interleaved kernel over the shared graph) gives each head what searching that index alone
    gives, before and after an add (each shared index added to once)."""
    rng = np.random.default_rng(5)
    n_heads, g, n, d, topk = 6, 2, 600, 16, 20
    keys = np.stack([_clustered(rng, n, d) for _ in range(g)])
    values = rng.normal(size=(g, n, d)).astype(np.float32)
    build = dict(M=8, R=16, n_hubs=8, keep_queries=64) if name == "roargraph" else {}
    params = {"L": 40} if name == "roargraph" else {}
    store = LayerStore(0, n_heads, keys, values, topk, IndexPlan(name, build, params), add_batch=8)
    train = np.stack([group_queries(list(_clustered(rng, 3 * 150, d).reshape(3, 150, d)), "group") for _ in range(g)])
    store.build(train, per_kv_head=True)
    assert [id(ix) for ix in store.indexes] == [id(store.indexes[3 * (h // 3)]) for h in range(n_heads)]
    assert store.indexes[0] is not store.indexes[3]
    if name == "roargraph":
        assert store.indexes[0].n_keys == n and len(store.indexes[0]._recent_q) == 64  # trained on the group's rows

    def check():
        q = _clustered(rng, n_heads, d)
        side = store.side(q, 0.25)
        k = min(topk, store.n_indexed)
        res = type(store.indexes[0]).search_group(store.indexes, q, k, **params)
        for h in range(n_heads):
            alone = store.indexes[h].search(q[h: h + 1], k, **params)
            np.testing.assert_array_equal(res.ids[h], alone.ids[0])
            assert res.n_scanned[h] == alone.n_scanned[0]
        assert 0 < side.scanned <= 1

    check()
    store.extend(_clustered(rng, 10, d)[None].repeat(g, 0), rng.normal(size=(g, 10, d)).astype(np.float32))
    assert store.n_indexed == n + 10 and all(ix.n_keys == n + 10 for ix in store.indexes)  # added once, not thrice
    check()


def test_graph_group_of_one_graph_repeated_equals_each_search_alone():
    """GraphGroup over the same roargraph object listed once per query head: each head's row of the result is that
    head's search alone (the interleaved kernel keeps one visited set and beam per head, not per graph)."""
    from anns_lab.indexes.roargraph import RoarGraphIndex

    rng = np.random.default_rng(2)
    keys = _clustered(rng, 800, 16)
    ix = RoarGraphIndex(M=8, R=16, n_hubs=8).build(keys, _clustered(rng, 300, 16))
    q = _clustered(rng, 4, 16)
    res = gs.GraphGroup([ix] * 4).search(q, 10, 30, (6, 0.3))
    for h in range(4):
        alone = ix.search(q[h: h + 1], 10, L=30)
        np.testing.assert_array_equal(res.ids[h], alone.ids[0])
        np.testing.assert_array_equal(res.scores[h], alone.scores[0])
        assert res.n_scanned[h] == alone.n_scanned[0] and res.bytes_read[h] == alone.bytes_read[0]


def test_other_heads_are_the_newest_rows_of_every_other_head_head_major():
    per = _per_head()
    rows = _origin(other_heads(per, 1, recent=0.2))  # 4 of 20 positions
    assert rows == [(h, p) for h in (0, 2) for p in range(T - 4, T)]
    assert _origin(other_heads(per, 0, recent=1.0)) == [(h, p) for h in (1, 2) for p in range(T)]
    assert len(other_heads(per, 2, recent=1e-6)) == 2  # at least one row per head
    assert other_heads(per[:1], 0) is None  # a group of one (MHA) has no other heads
    assert group_queries(per, "unlisted") is per[0]  # trained on the head's own queries


def test_layer_store_unlisted_gives_each_heads_index_its_groups_other_heads():
    """``others``: one roargraph per query head, each built from its own queries with its GQA group's other heads'
    newest queries (and their lists, when given) as group_queries: the same graph as a direct build with them."""
    from anns_lab.indexes.roargraph import RoarGraphIndex
    from anns_lab.indexes.topk import topk_ip

    rng = np.random.default_rng(7)
    n_heads, g, n, d = 4, 2, 500, 16
    keys = np.stack([_clustered(rng, n, d) for _ in range(g)])
    values = rng.normal(size=(g, n, d)).astype(np.float32)
    build = dict(M=8, R=16, n_hubs=8, M_sq=20, list_stride=1)
    queries = np.stack([_clustered(rng, 300, d) for _ in range(n_heads)])
    lists = np.stack([topk_ip(queries[h], keys[h // 2], 20) for h in range(n_heads)])
    for topk in (None, lists):
        store = LayerStore(0, n_heads, keys, values, 10, IndexPlan("roargraph", build, {}), add_batch=8)
        store.build(queries, topk, others=True)
        assert len({id(ix) for ix in store.indexes}) == n_heads
        for h in range(n_heads):
            mate = h ^ 1  # the other head of its group
            ref = RoarGraphIndex(**build).build(keys[h // 2], queries[h], group_queries=queries[mate][-9:])
            np.testing.assert_array_equal(store.indexes[h]._nbrs, ref._nbrs)  # ⌈0.03 · 300⌉ = 9 newest rows
