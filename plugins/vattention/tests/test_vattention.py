"""vAttention plugin: the conformance kit (with its unbiasedness check), the budget, exactness at full budget."""

import numpy as np

from anns_lab import indexes
from anns_lab.testing import check_index, easy_data, estimated_sums
from anns_lab_vattention import VAttention, budget


def test_conformance_and_unbiased():
    check_index(VAttention)  # VAttention claims unbiased: the kit averages 200 seeded builds


def test_registered_through_entry_point():
    assert indexes.get("vattention") is VAttention


def test_budget_grows_as_epsilon_and_delta_fall():
    rng = np.random.default_rng(0)
    rest, top = rng.normal(size=64), rng.normal(size=10) + 2
    sizes = [budget(rest, top, 5000, e, d, 32) for e, d in ((0.3, 0.1), (0.1, 0.1), (0.03, 0.1), (0.03, 0.01))]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1] <= 5000
    assert budget(np.zeros(64), top, 5000, 0.01, 0.01, 32) == 32  # no spread: the pilot floor is enough


def test_full_budget_is_exact():
    keys, queries, _ = easy_data(n_keys=400)
    values = np.random.default_rng(1).standard_normal((400, 3)).astype(np.float32)
    index = VAttention().build(keys)
    res = index.search(queries, 10, nprobe=1, epsilon=1e-9)
    assert (res.estimate.sample_weights[res.estimate.sample_ids >= 0] == 1.0).all()
    z, num = estimated_sums(index, res, queries, keys, values, 0.25)
    w = np.exp((queries.astype(np.float64) @ keys.astype(np.float64).T) * 0.25)
    np.testing.assert_allclose(z, w.sum(axis=1), rtol=1e-9)
    np.testing.assert_allclose(num, w @ values.astype(np.float64), rtol=1e-9, atol=1e-9)


def test_the_heavy_set_and_the_pilot_are_the_authors_shares_and_charged():
    """vAttention's deterministic part is a heavy set, a share of the keys (its authors' benchmark: 2%), and its pilot a
    share of the rest (1%): here 10% and half, on 400 keys. The top-k of the heavy set are the ids, the rest of it
    weight-1 samples whose values are charged; the pilot's keys are scored and charged; before session 48 both were
    the top-k and 32 keys (heavy 0, pilot_share 0)."""
    keys, queries, _ = easy_data(n_keys=400)
    k, d = 10, keys.shape[1]
    index = VAttention(heavy=0.1, pilot_share=0.5).build(keys)
    res = index.search(queries, k, nprobe=2, epsilon=0.3)
    heavy = index._ivf.search(queries, 40, nprobe=2)  # the IVF's best 40, the heavy set
    np.testing.assert_array_equal(res.ids, heavy.ids[:, :k])
    np.testing.assert_array_equal(res.estimate.sample_ids[:, :30], heavy.ids[:, k:40])
    assert (res.estimate.sample_weights[:, :30] == 1.0).all()
    sampled = (res.estimate.sample_ids[:, 30:] >= 0).sum(axis=1)
    pilot = 180  # half of the 360 keys outside the heavy set
    np.testing.assert_array_equal(res.n_scanned, heavy.n_scanned + pilot + sampled)
    np.testing.assert_array_equal(res.bytes_read, heavy.bytes_read + (pilot + sampled + 30 + sampled) * 4 * d)
    assert VAttention.build_params_before == {"heavy": 0.0, "pilot_share": 0.0}
    old = VAttention(heavy=0.0, pilot_share=0.0).build(keys).search(queries, k, nprobe=2, epsilon=0.3)
    np.testing.assert_array_equal(old.ids, heavy.ids[:, :k])
    assert ((old.n_scanned - heavy.n_scanned) >= 32).all() and (old.estimate.sample_weights[old.estimate.sample_ids >= 0] > 1).all()


def test_a_heavy_set_short_of_its_share_and_a_pilot_at_its_floor():
    """The heavy set comes from the probed lists' keys: where they hold fewer than its share, it is all of them (the
    rows shorter, every key counted once); a pilot share below ``pilot`` keys is raised to ``pilot``."""
    keys, queries, _ = easy_data(n_keys=400)
    k = 10
    index = VAttention(nlist=40, heavy=0.5, pilot_share=0.01).build(keys)  # 200 heavy keys asked, ~10 a list
    res = index.search(queries, k, nprobe=2, epsilon=0.3, pilot=50)
    probed = index._ivf.search(queries, 400, nprobe=2)  # every key of the 2 probed lists, best first
    for row in range(len(queries)):
        held = probed.ids[row][probed.ids[row] >= 0]
        assert len(held) < 200  # the probed lists hold fewer than the share
        np.testing.assert_array_equal(res.ids[row], held[:k])
        heavy = res.estimate.sample_ids[row][res.estimate.sample_weights[row] == 1.0]
        np.testing.assert_array_equal(np.sort(heavy), np.sort(held[k:]))
        sample_ids = res.estimate.row(row)[0]
        assert len(set(sample_ids)) == len(sample_ids) and not set(sample_ids) & set(res.ids[row])
        b = len(sample_ids) - len(held[k:])
        assert res.n_scanned[row] == probed.n_scanned[row] + 50 + b  # a pilot of 50 keys, not 1% of the rest
