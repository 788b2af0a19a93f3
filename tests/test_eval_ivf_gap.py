"""The fine-grained IVF curve against the lab's own ivf index searched at the same nprobe."""

from __future__ import annotations

import numpy as np
import pytest

from anns_lab.eval import ivf_gap, metrics
from anns_lab.indexes import registry


@pytest.mark.parametrize("shift", [0.0, 3.0])  # in-distribution queries, and queries shifted off the keys
def test_curve_equals_the_ivf_index_at_every_grid_point(shift):
    rng = np.random.default_rng(0)
    keys = (rng.standard_normal((3000, 16)) * rng.uniform(0.5, 2, 16)).astype(np.float32)
    queries = (rng.standard_normal((40, 16)) + shift).astype(np.float32)
    scanned, recall = ivf_gap.curve(keys, queries, k=20)
    index = registry.create("ivf").build(keys)
    exact = metrics.exact_scores(queries, keys)
    assert len(scanned) == index.nlist
    for nprobe in (1, 2, 5, 13, index.nlist):
        res = index.search(queries, 20, nprobe=nprobe)
        assert recall[nprobe - 1] == pytest.approx(metrics.recall_at_k(res.ids, exact, 20).mean())
        assert scanned[nprobe - 1] == pytest.approx(res.n_scanned.mean() / len(keys))
    assert recall[-1] == 1.0 and np.all(np.diff(recall) >= 0)
    f = ivf_gap.fraction_at(scanned, recall, 0.9)
    assert recall[np.searchsorted(scanned, f)] >= 0.9 and recall[np.searchsorted(scanned, f) - 1] < 0.9


def test_l2_curve_finds_l2_neighbours():
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((2000, 8)).astype(np.float32)
    scanned, recall = ivf_gap.curve(keys, keys[:30] + 0.01, k=10, metric="l2")
    assert recall[-1] == 1.0 and recall[0] > 0.3  # a point's nearest keys share its list more often than not


def test_lists_holding_counts_distinct_lists_of_the_exact_top_k():
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((2000, 8)).astype(np.float32)
    queries = rng.standard_normal((5, 8)).astype(np.float32)
    trained = ivf_gap.lists(keys, 20)
    top = metrics.exact_topk(metrics.exact_scores(queries, keys), 30)
    by_hand = np.mean([len(set(trained[1][row].tolist())) for row in top])
    assert ivf_gap.lists_holding(keys, queries, 30, trained) == pytest.approx(by_hand)
    scanned, recall = ivf_gap.curve(keys, queries, 30, trained=trained)
    assert len(scanned) == 20
