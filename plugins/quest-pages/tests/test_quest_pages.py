"""Quest pages: the conformance kit, exactness at the most thorough grid point, and an independent count."""

import math

import numpy as np
import pytest

from anns_lab import indexes
from anns_lab.testing import check_index, easy_data
from anns_lab_quest import QuestPages


def test_conformance():
    check_index(QuestPages)  # the last grid point reads every page: exact


def test_registered_through_entry_point():
    assert indexes.get("quest") is QuestPages


def test_most_thorough_point_is_numpy_exact_search():
    keys, queries, _ = easy_data(n_keys=700, dim=12)
    index = QuestPages(page_size=16).build(keys)
    res = index.search(queries, 25, **index.grid()[-1])
    exact = np.argsort(-(queries.astype(np.float64) @ keys.astype(np.float64).T), axis=1)[:, :25]
    assert np.array_equal(res.ids, exact)


@pytest.mark.parametrize("page_size,budget", [(16, 64), (16, 200), (10, 95), (7, 7)])
def test_pages_read_are_the_pages_whose_bound_beats_the_threshold(page_size, budget):
    """Independent count: each page's bound as max over dims of q·min vs q·max, by brute force over its keys'
    per-dimension extremes; the pages read are those whose bound is at least the budget-th largest bound."""
    keys, queries, _ = easy_data(n_keys=1000, dim=8, seed=3)
    index = QuestPages(page_size=page_size).build(keys)
    res = index.search(queries, 5, budget=budget)
    n_pages = math.ceil(len(keys) / page_size)
    n_read = min(math.ceil(budget / page_size), n_pages)
    for q, row_scanned, row_bytes, row_ids in zip(queries, res.n_scanned, res.bytes_read, res.ids):
        bound = np.array([np.maximum(q * keys[p * page_size:(p + 1) * page_size].min(0),
                                     q * keys[p * page_size:(p + 1) * page_size].max(0)).sum() for p in range(n_pages)])
        threshold = np.sort(bound)[::-1][n_read - 1]
        read = np.flatnonzero(bound >= threshold)  # random data: no ties at the threshold
        assert len(read) == n_read
        n_keys_read = sum(min(page_size, len(keys) - p * page_size) for p in read)
        assert row_scanned == 2 * n_pages + n_keys_read
        assert row_bytes == 8 * keys.shape[1] * n_pages + 4 * keys.shape[1] * n_keys_read
        # the answer: the exact top-5 of the keys of those pages
        cand = np.concatenate([np.arange(p * page_size, min((p + 1) * page_size, len(keys))) for p in read])
        assert row_ids.tolist() == cand[np.argsort(-(keys[cand] @ q), kind="stable")[:5]].tolist()


def test_bound_is_an_upper_bound_of_every_key_of_its_page():
    keys, queries, _ = easy_data(n_keys=333, dim=10, seed=4)
    index = QuestPages(page_size=16).build(keys)
    for q in queries:
        per_key = np.repeat(index.bounds(q), 16)[: len(keys)]
        assert np.all(keys @ q <= per_key + 1e-4)


def test_add_matches_a_fresh_build():
    keys, queries, _ = easy_data(n_keys=500, dim=8, seed=5)
    grown = QuestPages(page_size=16).build(keys[:301])
    grown.add(keys[301:420])
    grown.add(keys[420:])
    fresh = QuestPages(page_size=16).build(keys)
    np.testing.assert_array_equal(grown._min.table, fresh._min.table)
    np.testing.assert_array_equal(grown._max.table, fresh._max.table)
    a, b = grown.search(queries, 10, budget=160), fresh.search(queries, 10, budget=160)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.bytes_read, b.bytes_read)
