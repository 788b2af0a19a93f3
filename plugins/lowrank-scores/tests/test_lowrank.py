"""SparQ, Loki and Double Sparsity: the conformance kit, the keys each scores exactly recomputed by plain loops, and the counts."""

import math

import numpy as np
import pytest

from anns_lab import indexes
from anns_lab.errors import IndexConfigError
from anns_lab.testing import check_index, easy_data
from anns_lab_lowrank import DoubleSparsity, Loki, SparQ
from anns_lab_lowrank.double_sparsity import heavy_channels
from anns_lab_lowrank.loki import principal_basis


def test_conformance():
    # Recall 1 at the last grid point, which scores every key exactly. SparQ's partial pass counts r/d of a product
    # per key, and a Gaussian query's r largest components carry most of its product: it finds up to 63% of the
    # top-10 beyond its scanned share there (the kit's bound for a full product's ranking is 60%).
    check_index(SparQ, plausible_gain=0.7)
    check_index(Loki)
    check_index(DoubleSparsity)


def test_registered_through_entry_points():
    assert indexes.get("sparq") is SparQ and indexes.get("loki") is Loki
    assert indexes.get("double-sparsity") is DoubleSparsity


def _top_by(partial, budget):
    """The ``budget`` ids of largest partial score, by sorting (random data: no ties at the cut)."""
    return set(np.argsort(-partial)[:budget].tolist())


@pytest.mark.parametrize("rank,budget", [(0.125, 40), (0.25, 7), (0.5, 200), (0.3, 1000), (1.0, 64)])
def test_sparq_scores_the_best_keys_on_the_querys_largest_components(rank, budget):
    keys, queries, _ = easy_data(n_keys=600, dim=16, seed=4)
    res = SparQ().build(keys).search(queries, 5, rank=rank, budget=budget)
    r = max(1, round(rank * 16))
    c = min(budget, 600)
    for q, ids, scanned, nbytes in zip(queries, res.ids, res.n_scanned, res.bytes_read):
        dims = sorted(range(16), key=lambda i: -abs(float(q[i])))[:r]
        partial = keys[:, dims].astype(np.float64) @ q[dims].astype(np.float64)
        cand = np.array(sorted(_top_by(partial, c)))
        want = cand[np.argsort(-(keys[cand] @ q))[:5]]
        assert sorted(ids.tolist()) == sorted(want.tolist())
        assert scanned == math.ceil(600 * r / 16) + c
        assert nbytes == 4 * r * 600 + 4 * 16 * c


def test_loki_basis_is_the_keys_principal_directions():
    """Against numpy's SVD of the centred keys: the same directions (up to sign), largest variance first."""
    rng = np.random.default_rng(0)
    scales = np.array([9.0, 5.0, 3.0, 2.0, 1.0, 0.5, 0.25, 0.1])
    keys = (rng.standard_normal((2000, 8)) * scales + 4.0) @ np.linalg.qr(rng.standard_normal((8, 8)))[0]
    keys = keys.astype(np.float32)
    basis = principal_basis(keys)
    _, _, vt = np.linalg.svd(keys.astype(np.float64) - keys.mean(0), full_matrices=False)
    np.testing.assert_allclose(np.abs(np.sum(basis * vt.T, axis=0)), 1.0, atol=1e-5)
    np.testing.assert_allclose(basis.T @ basis, np.eye(8), atol=1e-5)


@pytest.mark.parametrize("rank,budget", [(0.125, 40), (0.25, 7), (0.5, 200), (1.0, 64)])
def test_loki_scores_the_best_keys_on_the_leading_components(rank, budget):
    keys, queries, _ = easy_data(n_keys=600, dim=16, seed=6)
    index = Loki().build(keys)
    res = index.search(queries, 5, rank=rank, budget=budget)
    r = max(1, round(rank * 16))
    _, _, vt = np.linalg.svd(keys.astype(np.float64) - keys.mean(0), full_matrices=False)
    lead = vt[:r]  # the first r principal directions (their signs do not change the products' sum)
    for q, ids, scanned, nbytes in zip(queries, res.ids, res.n_scanned, res.bytes_read):
        partial = (keys.astype(np.float64) @ lead.T) @ (lead @ q.astype(np.float64))
        cand = np.array(sorted(_top_by(partial, budget)))
        want = cand[np.argsort(-(keys[cand] @ q))[:5]]
        assert sorted(ids.tolist()) == sorted(want.tolist())
        assert scanned == r + math.ceil(600 * r / 16) + budget
        assert nbytes == 4 * 16 * r + 4 * r * 600 + 4 * 16 * budget


def test_a_few_components_find_keys_that_differ_along_them():
    """Keys that vary along 2 of 32 directions and barely along the rest: 2 components rank them as the full
    product does, so a budget of the top-k finds them all; 2 random coordinates of SparQ's would not on a rotated
    basis, but the query's largest components carry its product (both recall 1 here)."""
    rng = np.random.default_rng(3)
    rot = np.linalg.qr(rng.standard_normal((32, 32)))[0]
    keys = ((rng.standard_normal((3000, 32)) * np.r_[10.0, 6.0, np.full(30, 0.01)]) @ rot.T).astype(np.float32)
    queries = (rng.standard_normal((20, 32)) @ rot.T).astype(np.float32)
    exact = np.argsort(-(queries @ keys.T), axis=1)[:, :10]
    got = Loki().build(keys).search(queries, 10, rank=2 / 32, budget=10).ids
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, exact)]) >= 0.99


def test_loki_add_keeps_the_builds_basis():
    keys, queries, _ = easy_data(n_keys=500, dim=8, seed=5)
    grown = Loki().build(keys[:301])
    basis = grown._basis.copy()
    for lo, hi in ((301, 320), (320, 370), (370, 500)):  # the coordinates' table grows, fills its spare columns, grows
        grown.add(keys[lo:hi])
    np.testing.assert_array_equal(grown._basis, basis)
    np.testing.assert_allclose(grown._coords.table, (keys @ basis).T, rtol=1e-5, atol=1e-5)
    exact = grown.search(queries, 10, rank=0.25, budget=500)
    assert np.array_equal(exact.ids, np.argsort(-(queries @ keys.T), axis=1, kind="stable")[:, :10])


def test_sparq_add_reads_the_new_keys_dimensions():
    # a budget below the keys: the partial pass over the transposed copy must hold the added keys too
    keys, queries, _ = easy_data(n_keys=500, dim=8, seed=9)
    grown = SparQ().build(keys[:301])
    for lo, hi in ((301, 320), (320, 370), (370, 500)):  # the transposed copy grows, fills its spare columns, grows
        grown.add(keys[lo:hi])
    fresh = SparQ().build(keys)
    a, b = grown.search(queries, 10, rank=0.25, budget=60), fresh.search(queries, 10, rank=0.25, budget=60)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.n_scanned, b.n_scanned)
    assert (a.ids >= 301).any()  # the added keys are found


def test_a_saved_loki_basis_that_is_not_orthonormal_is_refused(tmp_path):
    keys, _, _ = easy_data(n_keys=200, dim=8, seed=2)
    index = Loki().build(keys)
    index._basis = index._basis * 1.5
    index.save(tmp_path / "bad")
    with pytest.raises(IndexConfigError, match="not orthonormal"):
        Loki.load(tmp_path / "bad")


@pytest.mark.parametrize("k", [7, 40])  # numba sorts under 16 items by insertion (stable whatever the kind asked)
@pytest.mark.parametrize("budget", [1, 9, 40, 120])
def test_ties_go_to_the_lower_id_at_both_cuts(budget, k):
    """Small integers (float32 sums exact in any order) and repeated keys: the ``budget`` candidates are the largest
    partial scores with ties at the cut taken by id, and the top-k the largest exact scores, ties by id, as a sort by
    (score, id) gives them."""
    rng = np.random.default_rng(11)
    keys = rng.integers(-2, 3, size=(120, 8)).astype(np.float32)
    keys[60:] = keys[:60]  # every key twice
    queries = rng.integers(-3, 4, size=(6, 8)).astype(np.float32)
    queries[:, :2] *= 4  # SparQ's two largest components: distinct magnitudes, no tie in choosing them
    queries[:, 0] += np.sign(queries[:, 0]) + (queries[:, 0] == 0)
    res = SparQ().build(keys).search(queries, k, rank=0.25, budget=budget)
    for q, ids, scores in zip(queries, res.ids, res.scores):
        dims = sorted(range(8), key=lambda i: -abs(float(q[i])))[:2]
        partial = keys[:, dims] @ q[dims]
        cand = sorted(range(120), key=lambda j: (-partial[j], j))[:budget]
        exact = keys @ q
        want = sorted(cand, key=lambda j: (-exact[j], j))[:k]
        assert ids[: len(want)].tolist() == want and (ids[len(want):] == -1).all()
        np.testing.assert_array_equal(scores[: len(want)], exact[want])


def _paired(n_keys=600, dim=16, seed=8):
    """Keys at positions 0, 2, 4, ... and training queries at every position 0..2n: half of them at a key's."""
    keys, queries, _ = easy_data(n_keys=n_keys, dim=dim, n_queries=30, seed=seed)
    rng = np.random.default_rng(seed)
    train = rng.standard_normal((2 * n_keys, dim)).astype(np.float32) * rng.uniform(0.2, 3.0, dim).astype(np.float32)
    return keys, queries, train, np.arange(0, 2 * n_keys, 2), np.arange(2 * n_keys)


def test_double_sparsity_channels_are_the_mean_query_key_product_of_each_token():
    """By plain loops: each channel's mean |q_c·k_c| over the tokens holding a key and a query, heaviest first."""
    keys, _, train, key_pos, train_pos = _paired(n_keys=300, dim=8)
    at = {int(p): i for i, p in enumerate(train_pos)}
    weight = [sum(abs(float(keys[i, c]) * float(train[at[int(p)], c])) for i, p in enumerate(key_pos)) / len(keys)
              for c in range(8)]
    want = sorted(range(8), key=lambda c: (-weight[c], c))
    assert heavy_channels(keys, key_pos, train, train_pos).tolist() == want
    index = DoubleSparsity().build(keys, train, key_positions=key_pos, train_positions=train_pos)
    assert index._order.tolist() == want


def test_double_sparsity_weighs_the_mean_magnitude_of_every_tokens_product():
    """Keys of ones, so each product is the query's value: channel 2 is 2 on the first 4,096 tokens, channel 1 is 3
    on the last 1,904, channel 0 is 1 then -1, channel 3 is 20/3 on one token in ten. Summed |q·k|: 8,192, 6,000,
    5,712, 4,000, so 2, 0, 1, 3. Squared products order them 3, 1, 2, 0; signed ones 2, 1, 3, 0; the first 4,096
    tokens alone 2, 0, 3, 1; the last 1,904 alone 1, 0, 3, 2 (a sum over one chunk of the statistic's loop)."""
    n = 6000
    keys = np.ones((n, 4), np.float32)
    queries = np.zeros((n, 4), np.float32)
    queries[:4096, 2] = 2.0
    queries[4096:, 1] = 3.0
    queries[:, 0] = np.where(np.arange(n) < 4096, 1.0, -1.0)
    queries[::10, 3] = 20.0 / 3.0
    order = heavy_channels(keys, np.arange(n), queries, np.arange(n))
    assert order.tolist() == [2, 0, 1, 3]


def test_double_sparsity_reads_only_the_queries_at_the_keys_positions():
    """Queries at positions holding no key of the index (the static window's, the held-out keys') weigh nothing:
    made huge on one channel, they leave the order as it was; none at a key's position is refused."""
    keys, _, train, key_pos, train_pos = _paired(n_keys=300, dim=8)
    before = heavy_channels(keys, key_pos, train, train_pos)
    loud = train.copy()
    loud[1::2, before[-1]] = 1e6  # the odd positions: no key there
    assert heavy_channels(keys, key_pos, loud, train_pos).tolist() == before.tolist()
    with pytest.raises(IndexConfigError, match="no training query is at a key's position"):
        DoubleSparsity().build(keys, train[1::2], key_positions=key_pos, train_positions=train_pos[1::2])


@pytest.mark.parametrize("rank,budget", [(0.125, 40), (0.25, 7), (0.5, 200), (1.0, 64)])
def test_double_sparsity_scores_the_best_keys_on_the_heads_heavy_channels(rank, budget):
    keys, queries, train, key_pos, train_pos = _paired()
    index = DoubleSparsity().build(keys, train, key_positions=key_pos, train_positions=train_pos)
    res = index.search(queries, 5, rank=rank, budget=budget)
    r = max(1, round(rank * 16))
    dims = heavy_channels(keys, key_pos, train, train_pos)[:r]  # the same for every query
    for q, ids, scanned, nbytes in zip(queries, res.ids, res.n_scanned, res.bytes_read):
        partial = keys[:, dims].astype(np.float64) @ q[dims].astype(np.float64)
        cand = np.array(sorted(_top_by(partial, budget)))
        want = cand[np.argsort(-(keys[cand] @ q))[:5]]
        assert sorted(ids.tolist()) == sorted(want.tolist())
        assert scanned == math.ceil(600 * r / 16) + budget
        assert nbytes == 8 * r + 4 * r * 600 + 4 * 16 * budget


def test_double_sparsity_finds_keys_on_the_channels_attention_uses():
    """Queries and keys large together on 2 of 32 channels (where their products, and so the attention, live):
    those 2 channels rank the keys as the full product does, so a budget of the top-k finds them all."""
    rng = np.random.default_rng(3)
    scale = np.r_[np.full(30, 0.01), 10.0, 6.0].astype(np.float32)
    keys = (rng.standard_normal((3000, 32)) * scale).astype(np.float32)
    train = (rng.standard_normal((3000, 32)) * scale[::-1] + rng.standard_normal((3000, 32)) * scale).astype(np.float32)
    queries = (rng.standard_normal((20, 32)) * scale).astype(np.float32)
    index = DoubleSparsity().build(keys, train, key_positions=np.arange(3000), train_positions=np.arange(3000))
    assert sorted(index._order[:2].tolist()) == [30, 31]
    exact = np.argsort(-(queries @ keys.T), axis=1)[:, :10]
    got = index.search(queries, 10, rank=2 / 32, budget=10).ids
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, exact)]) >= 0.99


def test_double_sparsity_add_keeps_the_builds_channels():
    keys, queries, train, key_pos, train_pos = _paired(n_keys=500, dim=8)
    grown = DoubleSparsity().build(keys[:301], train, key_positions=key_pos[:301], train_positions=train_pos)
    order = grown._order.copy()
    for lo, hi in ((301, 320), (320, 370), (370, 500)):
        grown.add(keys[lo:hi])
    np.testing.assert_array_equal(grown._by_dim.table, keys.T)
    np.testing.assert_array_equal(grown._order, order)
    a = grown.search(queries, 10, rank=0.25, budget=60)
    assert (a.ids >= 301).any()  # the added keys are scored on the same channels
    exact = grown.search(queries, 10, rank=0.25, budget=500)
    assert np.array_equal(exact.ids, np.argsort(-(queries @ keys.T), axis=1, kind="stable")[:, :10])


def test_a_saved_channel_order_that_is_no_ordering_is_refused(tmp_path):
    keys, _, train, key_pos, train_pos = _paired(n_keys=200, dim=8)
    index = DoubleSparsity().build(keys, train, key_positions=key_pos, train_positions=train_pos)
    index._order = np.array([0, 1, 2, 3, 4, 5, 6, 6], dtype=np.int64)
    index.save(tmp_path / "bad")
    with pytest.raises(IndexConfigError, match="not an ordering of the 8 channels"):
        DoubleSparsity.load(tmp_path / "bad")


def test_the_shared_transposed_table_grows_once_to_the_most_rows_asked_from_threads():
    """``partial.transposed`` from threads asking for different row counts of one store head (each an index's ``n``):
    one table, its columns the rows transposed up to the most asked, none written twice or lost (unlocked, a race
    between the check and the append left tables wrong and an append failed on a shape)."""
    from concurrent.futures import ThreadPoolExecutor

    from anns_lab.indexes.key_store import KeyStore
    from anns_lab_lowrank import partial

    rows = np.random.default_rng(6).normal(size=(1, 4000, 16)).astype(np.float32)
    for trial in range(20):
        store = KeyStore(rows[:, :100].copy(), capacity=4000)
        store.append(rows[:, 100:])
        head = store.head(0)
        with ThreadPoolExecutor(8) as pool:
            tables = list(pool.map(lambda n: partial.transposed(head, n), [100 + 37 * i * (trial + 1) % 3900 for i in range(64)]))
        assert len({id(t) for t in tables}) == 1, trial
        np.testing.assert_array_equal(tables[0].table, rows[0, : tables[0].n].T)
