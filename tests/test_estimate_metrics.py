"""The estimator protocol's arithmetic and the sweep's metrics with an estimate, against direct formulas."""

from __future__ import annotations

import numpy as np

from anns_lab.eval import metrics
from anns_lab.eval.heads import HeadData
from anns_lab.indexes.estimate import Estimate, Summaries, estimate_terms, weighted_partial
from anns_lab.window import Window


def _head(n: int = 400, d: int = 8, window=(8, 32), seed: int = 0) -> HeadData:
    rng = np.random.default_rng(seed)
    all_keys = rng.standard_normal((n + 4, d)).astype(np.float32)
    all_values = rng.standard_normal((n + 4, d)).astype(np.float32)
    key_pos = np.arange(window[0], n - window[1])
    test_q = rng.standard_normal((3, d)).astype(np.float32)
    return HeadData(0, 0, 0, np.ascontiguousarray(all_keys[key_pos]), key_pos, test_q, test_q,
                    np.array([n, n + 1, n + 3]), test_q, all_keys, all_values, 0.4, Window(*window), n, n - window[1])


def test_weighted_partial_and_summary_terms_by_hand():
    rng = np.random.default_rng(1)
    keys, values = rng.standard_normal((20, 4)), rng.standard_normal((20, 3))
    q = rng.standard_normal(4)
    summ = Summaries(np.stack([keys[[2, 5]].mean(axis=0), keys[[7]].mean(axis=0)]).astype(np.float32),
                     np.array([0, 2, 3]), np.array([2, 5, 7]))
    sums = summ.value_sums(values)
    np.testing.assert_allclose(sums, [values[2] + values[5], values[7]])
    l, w, v = estimate_terms(q, keys, values, 0.5, np.array([0, 9]), np.array([2.0, 3.0]), np.array([0, 1]), summ, sums)
    o, m, z = weighted_partial(l, w, v)
    lc = 0.5 * summ.keys.astype(np.float64) @ q
    ls = 0.5 * keys[[0, 9]] @ q
    num = 2 * np.exp(ls[0]) * values[0] + 3 * np.exp(ls[1]) * values[9] + np.exp(lc[0]) * sums[0] + np.exp(lc[1]) * sums[1]
    den = 2 * np.exp(ls[0]) + 3 * np.exp(ls[1]) + 2 * np.exp(lc[0]) + np.exp(lc[1])
    np.testing.assert_allclose(o, num / den, rtol=1e-12)
    np.testing.assert_allclose(z * np.exp(m), den, rtol=1e-12)
    empty = weighted_partial(np.zeros(0), np.zeros(0), np.zeros((0, 3)))
    assert empty[1] == -np.inf and empty[2] == 0 and not empty[0].any()


def test_no_estimate_keeps_todays_metrics_and_a_covering_estimate_equals_the_exact_set():
    data = _head()
    n = len(data.keys)
    ids = np.tile(np.arange(10), (3, 1))
    today = data.attention_quality(ids)
    # None: today's code path, bit for bit.
    assert data.attention_quality(ids, None, None) == today
    # An empty estimate: the same numbers through the estimate path.
    empty = Estimate.make([np.zeros(0, np.int64)] * 3, [np.zeros(0)] * 3, nq=3)
    np.testing.assert_allclose(data.attention_quality(ids, empty), today, rtol=1e-12)
    # Every other index key sampled with weight 1: attention over the window and all index keys.
    rest = [np.arange(10, n)] * 3
    cover = Estimate.make(rest, [np.ones(n - 10)] * 3, nq=3)
    every = np.tile(np.arange(n), (3, 1))
    np.testing.assert_allclose(data.attention_quality(ids, cover), data.attention_quality(every), atol=1e-6)  # float32 vs float64 logits
    # The same keys as single-key summaries instead of samples.
    summ = Summaries(data.keys[10:], np.arange(n - 9), np.arange(10, n))
    as_summ = Estimate.make(None, None, [np.arange(n - 10)] * 3, nq=3)
    np.testing.assert_allclose(data.attention_quality(ids, as_summ, summ), data.attention_quality(every), atol=1e-6)


def test_weights_scale_the_estimated_mass():
    # Doubling every sample's weight doubles the estimated mass of the sampled part (a direct count).
    data = _head()
    ids = np.full((3, 1), -1)
    half = [np.arange(0, len(data.keys), 2)] * 3
    one = data.attention_quality(ids, Estimate.make(half, [np.ones(len(half[0]))] * 3, nq=3))[0]
    two = data.attention_quality(ids, Estimate.make(half, [2 * np.ones(len(half[0]))] * 3, nq=3))[0]
    win = np.mean([metrics.mass_recovered((data.all_keys[: p + 1] @ data.test_queries[i]).astype(np.float64) * 0.4,
                                          data.window_positions(int(p))) for i, p in enumerate(data.test_pos)])
    np.testing.assert_allclose(two - win, 2 * (one - win), rtol=1e-9)


def test_estimate_rules_catch_each_broken_estimate():
    from anns_lab.indexes.base import SearchResult
    from anns_lab.indexes.estimate import estimate_problem

    ids = np.array([[0, 1]])
    scores = np.zeros((1, 2), np.float32)
    summ = Summaries(np.zeros((2, 4), np.float32), np.array([0, 2, 2]), np.array([5, 6]))

    def problem(est, scanned=20, estimates=True, summaries=summ):
        return estimate_problem(SearchResult(ids, scores, np.array([scanned]), np.array([0]), est), estimates,
                                summaries, 10, 4)

    good = Estimate.make([np.array([3, 4])], [np.array([2.0, 1.5])], [np.array([0])])
    assert problem(good) is None
    assert "top-k index" in problem(good, estimates=False)
    assert "must return an Estimate" in problem(None)
    assert "positive and finite" in problem(Estimate.make([np.array([3])], [np.array([-1.0])], nq=1))
    assert "positive and finite" in problem(Estimate.make([np.array([3])], [np.array([np.inf])], nq=1))
    assert "also exact" in problem(Estimate.make([np.array([1])], [np.array([1.0])], nq=1))
    assert "twice" in problem(Estimate.make([np.array([3, 3])], [np.array([1.0, 1.0])], nq=1))
    assert "outside" in problem(Estimate.make([np.array([10])], [np.array([1.0])], nq=1))
    assert "empty summary" in problem(Estimate.make(None, None, [np.array([1])], nq=1))
    both = Estimate.make([np.array([5])], [np.array([1.0])], [np.array([0])])
    assert "both in a summary" in problem(both)
    assert "below" in problem(good, scanned=4)
    assert "summaries() is None" in problem(good, summaries=None)
    bad_csr = Summaries(np.zeros((2, 4), np.float32), np.array([0, 3, 2]), np.array([5, 6]))
    assert "offsets" in problem(good, summaries=bad_csr)


def test_report_names_estimators_as_their_own_kind():
    import pandas as pd

    from anns_lab.eval.findings import index_kinds
    from anns_lab.indexes import registry

    names = [n for n in ("flat", "ivf", "magicpig", "retroinfer") if n in registry.available()]
    table = pd.DataFrame({"index": names, "scanned_fraction": [1.0 if n == "flat" else 0.1 for n in names],
                          "recall": [1.0 if n == "flat" else 0.5 for n in names]})
    kinds = index_kinds(table)
    assert kinds["flat"] == "exact" and kinds["ivf"] == "key-only"
    assert all(kinds[n] == "estimator" for n in names if registry.get(n).estimates)


def test_attention_quality_against_full_attention_by_hand_before_and_after_its_cache():
    data = _head()
    ids = np.tile(np.arange(0, 40, 3), (3, 1))
    ids[1, :5] = -1
    mass, err = [], []
    for i, pos in enumerate(data.test_pos):
        logits = data.scaling * (data.all_keys[: pos + 1].astype(np.float64) @ data.test_queries[i].astype(np.float64))
        p = np.exp(logits - logits.max())
        full = (p / p.sum()) @ data.all_values[: pos + 1].astype(np.float64)
        keep = np.zeros(pos + 1, bool)
        keep[data.window.positions(int(pos), data.index_end)] = True
        keep[data.key_pos[ids[i][ids[i] >= 0]]] = True
        part = (p[keep] / p[keep].sum()) @ data.all_values[: pos + 1][keep].astype(np.float64)
        mass.append(p[keep].sum() / p.sum())
        err.append(np.linalg.norm(part - full) / np.linalg.norm(full))
    first = data.attention_quality(ids)  # fills the per-query reference cache
    np.testing.assert_allclose(first, (np.mean(mass), np.mean(err)), rtol=1e-5)
    assert data.attention_quality(ids) == first  # from the cache: the same numbers
    assert _head().attention_quality(ids) == first
