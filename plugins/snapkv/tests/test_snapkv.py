"""SnapKV: the conformance kit, the kept keys against SnapKV's own formula in torch, the answers against numpy, the
counts, inserts, saves and ties."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from anns_lab import indexes
from anns_lab.errors import IndexConfigError
from anns_lab.testing import check_index, easy_data
from anns_lab_snapkv import SnapKV


def test_conformance():
    check_index(SnapKV)


def test_registered_through_entry_points():
    assert indexes.get("snapkv") is SnapKV


def _torch_kept(keys, window_queries, budget, kernel, pooling):
    """SnapKV's selection as its reference writes it: softmax of q·k/√d over the keys, summed over the window's
    queries, torch's avg_pool1d / max_pool1d with padding kernel // 2, topk."""
    q, k = torch.from_numpy(window_queries).double(), torch.from_numpy(keys).double()
    weights = torch.softmax(q @ k.T / math.sqrt(keys.shape[1]), dim=-1).sum(dim=0)[None, None]
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    votes = pool(weights, kernel_size=kernel, padding=kernel // 2, stride=1)[0, 0]
    return set(votes.topk(budget).indices.tolist())


@pytest.mark.parametrize("window,kernel,pooling,budget", [(32, 5, "avg", 100), (8, 1, "avg", 37), (32, 7, "max", 64),
                                                          (500, 3, "avg", 250)])
def test_the_kept_keys_are_those_snapkvs_formula_keeps(window, kernel, pooling, budget):
    keys, _, train = easy_data(n_keys=800, dim=16, seed=3)
    index = SnapKV(window=window, kernel=kernel, pooling=pooling).build(keys, train)
    want = _torch_kept(keys, train[-window:], budget, kernel, pooling)
    assert set(index.kept(budget).tolist()) == want


def test_a_window_wider_than_one_block_of_votes_keeps_the_same_keys(monkeypatch):
    """The votes are summed a block of the window's queries at a time (a window of thousands over 128K keys held
    gigabytes at once): blocks of 7 rows keep what the reference keeps."""
    from anns_lab_snapkv import snapkv

    monkeypatch.setattr(snapkv, "VOTE_BYTES", 8 * 800 * 7)
    keys, _, train = easy_data(n_keys=800, dim=16, seed=4)
    index = SnapKV(window=200).build(keys, train)
    assert set(index.kept(150).tolist()) == _torch_kept(keys, train[-200:], 150, 5, "avg")


@pytest.mark.parametrize("budget", [1, 50, 333, 10_000])
def test_a_search_returns_the_top_k_of_the_kept_keys_and_counts_them(budget):
    keys, queries, train = easy_data(n_keys=600, dim=16, seed=5)
    index = SnapKV().build(keys, train)
    res = index.search(queries, 10, budget=budget)
    kept = _torch_kept(keys, train[-32:], min(budget, 600), 5, "avg")
    cand = np.array(sorted(kept))
    exact = keys[cand].astype(np.float64) @ queries.T.astype(np.float64)
    for row, (ids, scanned, nbytes) in enumerate(zip(res.ids, res.n_scanned, res.bytes_read)):
        want = cand[np.argsort(-exact[:, row])[: min(10, len(cand))]]
        assert ids[: len(want)].tolist() == want.tolist() and (ids[len(want):] == -1).all()
        assert np.isneginf(res.scores[row, len(want):]).all()  # fewer kept keys than k: the padding's scores
        assert scanned == len(cand) and nbytes == (4 * 16 + 8) * len(cand)


def test_the_selection_is_the_same_for_every_query():
    """Static: the window's votes decide, not the query; a query's best key outside the kept set is never found."""
    keys, queries, train = easy_data(n_keys=600, dim=16, seed=7)
    index = SnapKV().build(keys, train)
    kept = set(index.kept(60).tolist())
    found = set(index.search(queries, 10, budget=60).ids.ravel().tolist())
    assert found <= kept
    best = np.argmax(queries @ keys.T, axis=1)
    assert any(b not in kept for b in best)  # what a query-time retriever would find and SnapKV cannot


def test_added_keys_are_always_searched_and_the_votes_stay_the_builds():
    keys, queries, train = easy_data(n_keys=500, dim=8, seed=9)
    grown = SnapKV().build(keys[:400], train)
    order = grown._order.copy()
    assert (grown.search(queries, 10, budget=30).n_scanned == 30).all()  # a kept set made before the add
    grown.add(keys[400:])
    np.testing.assert_array_equal(grown._order, order)
    res = grown.search(queries, 10, budget=30)
    assert (res.n_scanned == 130).all()
    cand = np.array(sorted(set(order[:30].tolist()) | set(range(400, 500))))
    want = cand[np.argsort(-(keys[cand] @ queries.T), axis=0, kind="stable")[:10]].T
    np.testing.assert_array_equal(res.ids, want)
    assert (res.ids >= 400).any()


def test_the_build_learns_from_the_rows_it_names_alone():
    """``train_rows`` names the window's rows: a caller (the decoder's RoPE move) may pass only those."""
    keys, _, train = easy_data(n_keys=300, dim=8, seed=2)
    index = SnapKV(window=16)
    rows = index.train_rows(300, len(train))
    np.testing.assert_array_equal(rows, np.arange(len(train) - 16, len(train)))
    np.testing.assert_array_equal(SnapKV(window=16).build(keys, train[rows])._order, index.build(keys, train)._order)


def test_save_and_load_keep_the_ranking_and_refuse_one_that_is_not(tmp_path):
    keys, queries, train = easy_data(n_keys=200, dim=8, seed=4)
    index = SnapKV().build(keys, train)
    index.save(tmp_path / "ok")
    again = SnapKV.load(tmp_path / "ok")
    a, b = index.search(queries, 5, budget=40), again.search(queries, 5, budget=40)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.n_scanned, b.n_scanned)
    index._order = index._order.copy()
    index._order[1] = index._order[0]  # a key twice, another never
    index.save(tmp_path / "bad")
    with pytest.raises(IndexConfigError, match="not a ranking"):
        SnapKV.load(tmp_path / "bad")


def test_an_even_pool_is_refused():
    with pytest.raises(IndexConfigError, match="must be odd"):
        SnapKV(kernel=4)


@pytest.mark.parametrize("k", [3, 40])
def test_ties_go_to_the_lower_id(k):
    """Small integers (float32 sums exact in any order) and every key twice: the top-k is a sort by (score, id)."""
    rng = np.random.default_rng(11)
    keys = rng.integers(-2, 3, size=(120, 8)).astype(np.float32)
    keys[60:] = keys[:60]
    queries = rng.integers(-3, 4, size=(6, 8)).astype(np.float32)
    train = rng.standard_normal((40, 8)).astype(np.float32)
    index = SnapKV().build(keys, train)
    cand = index.kept(90)
    res = index.search(queries, k, budget=90)
    for q, ids, scores in zip(queries, res.ids, res.scores):
        exact = keys @ q
        want = sorted(cand.tolist(), key=lambda j: (-exact[j], j))[:k]
        assert ids.tolist() == want
        np.testing.assert_array_equal(scores, exact[want])
