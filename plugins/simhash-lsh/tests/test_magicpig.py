"""MagicPIG estimator: conformance (with unbiasedness), its sampling probability, exactness at min_collisions = 0."""

import numpy as np

from anns_lab import indexes
from anns_lab.testing import check_index, easy_data, estimated_sums
from anns_lab_simhash.magicpig import MagicPIG, sampling_probability


def test_conformance_and_unbiased():
    # No exact ids (a pure sampler): recall@k is 0 by design. Unbiasedness over 200 seeds at min_collisions = 2.
    check_index(MagicPIG, min_recall=0.0, unbiased_at={"min_collisions": 2}, K=4, L=16)


def test_registered_through_entry_point():
    assert indexes.get("magicpig") is MagicPIG


def test_sampling_probability_matches_the_hash_frequency():
    # Independent check: how often a fixed key collides often enough over many random hyperplane draws.
    rng = np.random.default_rng(0)
    q, key = rng.standard_normal(8), rng.standard_normal(8)
    cos = q @ key / np.linalg.norm(q) / np.linalg.norm(key)
    hits, trials = 0, 4000
    for _ in range(trials):
        planes = rng.standard_normal((6 * 3, 8))
        agree = ((planes @ q > 0) == (planes @ key > 0)).reshape(6, 3).all(axis=1)
        hits += agree.sum() >= 2
    p = sampling_probability(np.array([cos]), 3, 6, 2)[0]
    assert abs(hits / trials - p) < 4 * np.sqrt(p * (1 - p) / trials)


def test_min_collisions_zero_samples_every_key_exactly():
    keys, queries, _ = easy_data(n_keys=300)
    values = np.random.default_rng(1).standard_normal((300, 3)).astype(np.float32)
    index = MagicPIG().build(keys)
    res = index.search(queries, 5, min_collisions=0)
    z, num = estimated_sums(index, res, queries, keys, values, 0.25)
    w = np.exp((queries.astype(np.float64) @ keys.astype(np.float64).T) * 0.25)
    np.testing.assert_allclose(z, w.sum(axis=1), rtol=1e-9)
    np.testing.assert_allclose(num, w @ values.astype(np.float64), rtol=1e-9, atol=1e-9)


def test_scanned_counts_candidates_hyperplanes_and_the_mean():
    """Every product of a query: its K·L hyperplanes, q·(k − μ) for each key colliding often enough (recounted from
    the codes bit by bit), and, centred, q·μ once (the attention's logit is q·(k − μ) + q·μ; an audit found it
    uncounted, one product a query)."""
    keys, queries, _ = easy_data()
    for center in (True, False):
        index = MagicPIG(K=6, L=16, center=center).build(keys)
        res = index.search(queries, 10, min_collisions=2)
        mean = keys.mean(axis=0) if center else 0.0
        planes = index._planes.reshape(16, 6, -1)
        kc = np.einsum("tbd,nd->ntb", planes, keys - mean) > 0
        qc = np.einsum("tbd,nd->ntb", planes, queries) > 0
        collisions = (kc[None] == qc[:, None]).all(axis=3).sum(axis=2)
        assert np.array_equal(res.n_scanned, (collisions >= 2).sum(axis=1) + 16 * 6 + int(center))
