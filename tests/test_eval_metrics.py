"""Metric functions against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from anns_lab.eval import metrics


def test_recall_counts_ties_at_the_kth_score_as_hits():
    scores = np.array([[5.0, 4.0, 4.0, 3.0, 1.0]])
    # k = 2: the threshold is 4, so either of the tied keys 1 and 2 completes the top-2.
    assert metrics.recall_at_k(np.array([[0, 2]]), scores, 2)[0] == 1.0
    assert metrics.recall_at_k(np.array([[1, 2]]), scores, 2)[0] == 1.0
    assert metrics.recall_at_k(np.array([[0, 3]]), scores, 2)[0] == 0.5
    assert metrics.recall_at_k(np.array([[4, -1]]), scores, 2)[0] == 0.0
    assert metrics.recall_at_k(np.array([[0, 0]]), scores, 2)[0] == 0.5  # a duplicate is one hit


def test_exact_topk_and_kth():
    scores = np.array([[0.1, 0.9, 0.5, 0.7], [3.0, 2.0, 1.0, 0.0]])
    assert metrics.exact_topk(scores, 2).tolist() == [[1, 3], [0, 1]]
    assert metrics.kth_scores(scores, 3).tolist() == [0.5, 1.0]


def test_mass_and_output_error_by_hand():
    logits = np.log(np.array([1.0, 3.0, 4.0]))  # softmax weights 1/8, 3/8, 4/8
    values = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert metrics.mass_recovered(logits, np.array([1, 2, 2])) == pytest.approx(7 / 8)
    full = np.array([1 / 8 + 4 / 8, 3 / 8 + 4 / 8])
    part = np.array([4 / 7, 3 / 7 + 4 / 7])  # renormalised over keys 1 and 2
    assert metrics.output_rel_error(logits, values, np.array([1, 2])) == pytest.approx(
        np.linalg.norm(part - full) / np.linalg.norm(full))
    assert metrics.output_rel_error(logits, values, np.arange(3)) == pytest.approx(0.0, abs=1e-15)


def test_mahalanobis_matches_a_known_distribution():
    rng = np.random.default_rng(0)
    cov = np.diag([4.0, 1.0, 0.25])
    ref = rng.multivariate_normal(np.zeros(3), cov, size=200_000)
    d = metrics.mahalanobis(np.array([[2.0, 0, 0], [0, 0, 0.5], [0, 0, 0]]), ref)
    np.testing.assert_allclose(d, [1.0, 1.0, 0.0], atol=0.02)


@pytest.mark.parametrize("lower", [False, True])
def test_frontier_keeps_exactly_the_undominated_points(lower):
    from anns_lab.eval.metrics import frontier

    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 30, 200).astype(float), rng.integers(0, 40, 200) / 40
    f = frontier(-y if lower else y, x)
    better = (lambda a, b: a < b) if lower else (lambda a, b: a > b)
    # Brute force: a point is on the frontier iff no point at the same or lower cost is better, and it is the first
    # (cheapest) point reaching its value.
    expected = {(x2, y2) for x2, y2 in zip(x, y)
                if not any(better(y3, y2) for x3, y3 in zip(x, y) if x3 <= x2)
                and not any(y3 == y2 and x3 < x2 for x3, y3 in zip(x, y))}
    assert set(zip(x[f], y[f])) == expected and len(f) == len(expected)
    assert np.all(np.diff(x[f]) > 0) and np.all(np.diff(y[f]) < 0 if lower else np.diff(y[f]) > 0)


def test_recall_at_k_against_a_per_row_set_count():
    """The vectorised count against the plain one (each row's distinct valid ids scoring at least its k-th exact
    score), on random ids with repeats and -1s."""
    rng = np.random.default_rng(7)
    for k in (1, 5, 20):
        scores = rng.normal(size=(30, 50)).astype(np.float32)
        scores[:, 10] = scores[:, 11]  # ties
        ids = rng.integers(-1, 50, size=(30, k + 3))
        ids[:, 1] = ids[:, 0]  # repeats
        kth = metrics.kth_scores(scores, k)
        want = [min(sum(scores[i, j] >= kth[i] for j in set(row[row >= 0].tolist())), k) / k for i, row in enumerate(ids)]
        assert metrics.recall_at_k(ids, scores, k).tolist() == pytest.approx(want)


def test_weight_recall_is_the_share_of_the_exact_top_k_attention_mass_returned():
    """Against metrics.mass_recovered in float64 (the returned keys' share of the full softmax over that of the exact
    top-k), on random ids with repeats and -1s; a near-tie swapped for the k-th key costs almost nothing, where set
    recall counts it a miss."""
    rng = np.random.default_rng(3)
    scaling = 0.4
    for k in (1, 5, 20):
        scores = (3 * rng.normal(size=(30, 50))).astype(np.float32)
        ids = rng.integers(-1, 50, size=(30, k))
        ids[:, 1 % k] = ids[:, 0]
        top = metrics.exact_topk(scores, k)
        want = [metrics.mass_recovered(scaling * s.astype(np.float64), row[row >= 0])
                / metrics.mass_recovered(scaling * s.astype(np.float64), t) for s, row, t in zip(scores, ids, top)]
        weights = metrics.softmax_weights(scores.copy(), scaling)
        assert metrics.weight_recall_at_k(ids, weights, k).tolist() == pytest.approx(want, rel=1e-5)
        best = metrics.topk_weight(weights, k)
        assert metrics.weight_recall_at_k(top, weights, k, best).tolist() == pytest.approx(np.ones(30))
    scores = np.array([[5.0, 4.0, 3.999, 0.0]], np.float32)  # key 2 ties key 1 within 1e-3
    weights = metrics.softmax_weights(scores.copy(), 1.0)
    assert metrics.recall_at_k(np.array([[0, 2]]), scores, 2)[0] == 0.5
    assert metrics.weight_recall_at_k(np.array([[0, 2]]), weights, 2)[0] == pytest.approx(1.0, abs=1e-3)


def test_at_recall_interpolates_on_the_frontier_between_the_points_around_the_target():
    from anns_lab.eval.metrics import at_recall

    # cost-ordered: (1, .5), (2, .8), (3, .7) off the frontier (a cheaper point recalls more), (4, .9), (5, .96);
    # a point of no measured cost is skipped. 0.95 lies between (4, .9) and (5, .96), 5/6 of the way
    recall = np.array([0.96, 0.5, 0.7, 0.8, 0.9, 0.99])
    cost = np.array([5.0, 1.0, 3.0, 2.0, 4.0, np.nan])
    value, below, reached, w = at_recall(recall, cost, 0.95)
    assert (below, reached) == (4, 0) and np.isclose(w, 5 / 6) and np.isclose(value, 4 + 5 / 6)
    value, below, reached, _ = at_recall(recall, cost, 0.85)  # halfway from (2, .8): (3, .7) plays no part
    assert (below, reached) == (3, 4) and np.isclose(value, 3.0)
    assert at_recall(recall, cost, 0.4) == (1.0, 1, 1, 1.0)  # the cheapest point reaches it: its own cost
    value, *rest = at_recall(recall, cost, 0.97)  # never reached
    assert np.isnan(value) and rest[:2] == [-1, -1]
    # among equal costs the better recall is the frontier's point
    assert at_recall([0.9, 0.97], [2.0, 2.0], 0.95) == (2.0, 1, 1, 1.0)
    assert at_recall(recall, cost, 0.9) == (4.0, 4, 4, 1.0)  # met exactly by a later point: that point, no mix
    assert at_recall([np.nan, np.inf, 0.96], [1.0, 2.0, 3.0], 0.95) == (3.0, 2, 2, 1.0)  # unmeasured recalls skipped
    assert np.isnan(at_recall([], [], 0.95)[0]) and at_recall([0.99], [7.0], 0.95) == (7.0, 0, 0, 1.0)


def test_within_budget_is_at_recall_the_other_way_round():
    from anns_lab.eval.metrics import at_recall, within_budget

    # output errors (a loss: passed negated) at byte costs; (3, .30) is off the frontier, (0.5, nan) unmeasured
    error = np.array([0.40, 0.10, 0.30, 0.20, 0.05, 0.01])
    cost = np.array([1.0, 4.0, 3.0, 2.0, 8.0, 0.5])
    cost[5] = np.nan
    least = lambda b: -within_budget(-error, cost, b)  # noqa: E731
    assert np.isnan(within_budget(-error, cost, 0.9))  # nothing within it
    assert least(1.0) == 0.40 and least(4.0) == 0.10  # a frontier point at the budget: its own error
    assert np.isclose(least(1.5), 0.30)  # halfway between (1, .40) and (2, .20)
    assert np.isclose(least(3.0), 0.15)  # between (2, .20) and (4, .10): (3, .30) plays no part
    assert np.isclose(least(6.0), 0.075) and least(100.0) == 0.05  # past the dearest point: its error
    # two settings at one cost: the better is the frontier's, whichever comes first
    assert -within_budget([-0.25, -0.20, -0.40], [2.0, 2.0, 1.0], 2.0) == 0.20
    assert np.isclose(-within_budget([-0.20, -0.25, -0.40], [2.0, 2.0, 1.0], 1.5), 0.30)
    # the two readings agree: the recall a budget buys costs that budget
    recall = np.array([0.5, 0.8, 0.7, 0.9, 0.96])
    spend = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    for b in (1.3, 2.0, 3.7, 4.5):
        assert np.isclose(at_recall(recall, spend, within_budget(recall, spend, b))[0], b)


def _grid(rng, n_points):
    """One head's grid: costs and recalls that mostly grow together, with points off the frontier."""
    cost = np.sort(rng.uniform(1.0, 100.0, n_points))
    recall = np.clip(np.sort(rng.uniform(0.5, 1.0, n_points)) + rng.normal(0, 0.05, n_points), 0, 1)
    return recall, cost


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_median_line_is_the_median_of_each_heads_reach_within_a_cost(seed):
    from anns_lab.eval.metrics import median_frontier, within_budget

    rng = np.random.default_rng(seed)
    heads = [_grid(rng, int(rng.integers(1, 9))) for _ in range(int(rng.integers(2, 12)))]
    xs, ys = median_frontier(heads, per_segment=5)
    assert len(xs) and np.all(np.diff(xs) > 0)
    # the scalar reading head by head, a head with nothing within the cost reaching nothing
    reach = lambda q, c, x: np.nan_to_num(within_budget(q, c, x), nan=-np.inf)  # noqa: E731
    want = [np.median([reach(q, c, x) for q, c in heads]) for x in xs]
    np.testing.assert_allclose(ys, want, rtol=0, atol=1e-12)
    # it starts where half the heads have a point within the cost
    firsts = sorted(np.nanmin(c) for _, c in heads)
    assert np.isclose(xs[0], firsts[(len(heads) - 1) // 2] if len(heads) % 2 else firsts[len(heads) // 2])


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
def test_the_median_line_meets_a_target_at_the_tables_median_cost(seed):
    # For an odd number of heads the line reaches recall t from the median over heads of at_recall's cost on (what
    # the report's tables say), and not before; the medians of the grid points taken across heads need not.
    from anns_lab.eval.metrics import at_recall, median_frontier

    rng = np.random.default_rng(seed)
    heads = [_grid(rng, 6) for _ in range(9)]
    xs, ys = median_frontier(heads, per_segment=50)
    for t in (0.8, 0.9, 0.95):
        costs = [at_recall(q, c, t)[0] for q, c in heads]
        m = float(np.median(np.where(np.isfinite(costs), costs, np.inf)))
        if not np.isfinite(m):
            assert np.all(ys < t)
            continue
        assert np.all(ys[xs < m * (1 - 1e-9)] < t) and np.all(ys[xs >= m] >= t - 1e-12)


@pytest.mark.parametrize("seed", [7, 8])
def test_for_an_even_number_of_heads_the_line_meets_a_target_between_the_middle_two_costs(seed):
    from anns_lab.eval.metrics import at_recall, median_frontier

    rng = np.random.default_rng(seed)
    heads = [_grid(rng, 6) for _ in range(12)]
    xs, ys = median_frontier(heads, per_segment=50)
    costs = sorted(np.nan_to_num([at_recall(q, c, 0.85)[0] for q, c in heads], nan=np.inf))
    low, high = costs[5], costs[6]  # the tables give their mean
    assert np.all(ys[xs < low * (1 - 1e-9)] < 0.85)
    if np.isfinite(high):
        assert np.all(ys[xs >= high] >= 0.85 - 1e-12)
    # exactly half the heads reaching it: the tables say never; the mean of the middle two readings may still reach it
    xs, ys = median_frontier([([0.99], [1.0]), ([0.92], [1.0])])
    assert np.isclose(ys[0], 0.955) and np.isinf(np.median([at_recall([0.99], [1.0], 0.95)[0], np.inf]))


def test_the_figures_line_reads_each_head_and_refuses_two_builds():
    from anns_lab.eval.figures import head_median_line

    rows = [  # two heads; errors fall with bytes, one point off head 0's frontier
        (0, 0, 100.0, 0.30), (0, 0, 200.0, 0.10), (0, 0, 300.0, 0.20),
        (0, 1, 150.0, 0.40), (0, 1, 250.0, 0.05), (1, 0, 120.0, 0.35),
    ]
    pts = pd.DataFrame(rows, columns=["layer", "head", "bytes_read", "output_rel_error"]).assign(build_params="{}")
    xs, ys = head_median_line(pts, "bytes_read", "output_rel_error", lower_is_better=True)
    # at 250 bytes: head 0/0 at 0.10 (its 300-byte point is worse), 0/1 at 0.05, 1/0 at 0.35: the median 0.10
    assert np.isclose(ys[np.searchsorted(xs, 250.0)], 0.10) and np.all(np.diff(ys) <= 1e-12)
    assert xs[0] == 120.0  # two of the three heads have a point from there
    with pytest.raises(ValueError, match="several builds"):
        head_median_line(pts.assign(build_params=["{}"] * 5 + ['{"nlist": 8}']), "bytes_read", "output_rel_error")


def test_the_median_line_mixes_points_linearly_in_cost():
    from anns_lab.eval.metrics import median_frontier

    xs, ys = median_frontier([([0.5, 0.9, 1.0], [1.0, 100.0, 200.0])], per_segment=4)
    np.testing.assert_allclose(xs, [1.0, 25.75, 50.5, 75.25, 100.0, 125.0, 150.0, 175.0, 200.0])
    # halfway in bytes is halfway in recall (a mix), where a straight stroke on a log axis would put 0.9 near x = 10
    assert np.isclose(ys[2], 0.7) and ys[-1] == 1.0
    assert len(median_frontier([([0.2], [3.0])])[0]) == 1
    # heads with no measured point reach nothing: one head of three cannot carry the median
    xs, _ = median_frontier([([0.9], [1.0]), ([np.nan], [2.0]), ([], [])])
    assert len(xs) == 0 and len(median_frontier([])[0]) == 0
