"""RetroInfer plugin: the conformance kit, single-key clusters are exact, summaries are the k-means groups."""

import numpy as np

from anns_lab import indexes
from anns_lab.testing import check_index, easy_data, estimated_sums
from anns_lab_retroinfer import RetroInfer


def test_conformance():
    check_index(RetroInfer)


def test_registered_through_entry_point():
    assert indexes.get("retroinfer") is RetroInfer


def _exact_sums(queries, keys, values, scaling):
    w = np.exp((queries.astype(np.float64) @ keys.astype(np.float64).T) * scaling)
    return w.sum(axis=1), w @ values.astype(np.float64)


def test_single_key_clusters_are_exact():
    keys, queries, _ = easy_data(n_keys=300)
    values = np.random.default_rng(1).standard_normal((300, 5)).astype(np.float32)
    index = RetroInfer(nlist=10_000, estimation_budget=1.0).build(keys)  # every cluster not attended estimated
    z, num = estimated_sums(index, index.search(queries, 10, nprobe=2), queries, keys, values, 0.3)
    tz, tnum = _exact_sums(queries, keys, values, 0.3)
    np.testing.assert_allclose(z, tz, rtol=1e-9)
    np.testing.assert_allclose(num, tnum, rtol=1e-9, atol=1e-9)


def test_centroids_are_member_means_and_error_falls_with_nprobe():
    keys, queries, _ = easy_data(n_keys=600)
    values = np.random.default_rng(2).standard_normal((600, 4)).astype(np.float32)
    index = RetroInfer(nlist=40, estimation_budget=1.0).build(keys)
    summ = index.summaries()
    for c in range(len(summ.keys)):
        members = summ.members[summ.offsets[c]: summ.offsets[c + 1]]
        np.testing.assert_allclose(summ.keys[c], keys[members].mean(axis=0), rtol=1e-5, atol=1e-6)
    tz, tnum = _exact_sums(queries, keys, values, 0.3)
    errors = []
    for nprobe in (1, 8, 40):
        z, num = estimated_sums(index, index.search(queries, 10, nprobe=nprobe), queries, keys, values, 0.3)
        errors.append(float(np.median(np.linalg.norm(num / z[:, None] - tnum / tz[:, None], axis=1))))
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-9


def test_bytes_read_count_the_member_lists_and_counts_it_reads():
    """Before: the probed keys' ids (8 B each, as ivf and clusterkv charge them) and the estimated clusters' member
    counts went uncharged. By hand from the clusters: centroids, probed keys and the values beyond the top-k and of
    each estimated cluster at 4·d bytes, ids and counts at 8."""
    keys, queries, _ = easy_data(n_keys=600)
    d, k, nprobe = keys.shape[1], 10, 3
    for budget in (1.0, 0.5):
        index = RetroInfer(nlist=40, estimation_budget=budget).build(keys)
        summ = index.summaries()
        sizes = np.diff(summ.offsets)
        res = index.search(queries, k, nprobe=nprobe)
        order = np.argsort(-(queries @ summ.keys.T), axis=1, kind="stable")
        probed = sizes[order[:, :nprobe]].sum(axis=1)
        estimated = min(round(budget * len(sizes)), len(sizes) - nprobe)
        want = 4 * d * (len(sizes) + probed + np.maximum(probed - k, 0) + estimated) + 8 * probed + 8 * estimated
        np.testing.assert_array_equal(res.bytes_read, want)


def test_the_estimation_zone_is_a_share_of_all_clusters_next_after_the_probed():
    """RetroInfer's zones (its reference code's defaults: 0.232 of all clusters estimated): the nprobe best clusters by
    centroid score exact, the next round(0.232·nlist) estimated, the rest dropped. Before session 48 every cluster not
    attended was estimated, which read ~5% of a key scan more than the method does at every nprobe."""
    keys, queries, _ = easy_data(n_keys=1600)
    index = RetroInfer(nlist=100).build(keys)
    assert index.params["estimation_budget"] == 0.232
    summ = index.summaries()
    n_c, nprobe = len(summ.keys), 5
    assert n_c == 100  # no cluster left empty: 23 of them estimated
    res = index.search(queries, 10, nprobe=nprobe)
    order = np.argsort(-(queries @ summ.keys.T), axis=1, kind="stable")
    for i in range(len(queries)):
        np.testing.assert_array_equal(res.estimate.row(i)[2], order[i, nprobe: nprobe + 23])
    # never past the clusters left: where nprobe leaves fewer than the budget's, every other one
    res = index.search(queries, 10, nprobe=n_c - 10)
    assert all(len(res.estimate.row(i)[2]) == 10 for i in range(len(queries)))
    half = RetroInfer(nlist=100, estimation_budget=0.5).build(keys).search(queries, 10, nprobe=n_c - 10)
    assert all(len(half.estimate.row(i)[2]) == 10 for i in range(len(queries)))


def test_a_save_from_before_the_estimation_budget_loads_as_it_was_built(tmp_path):
    """A retroinfer saved before session 48 has no estimation_budget: it estimated every cluster not attended, and it
    loads so (Index.build_params_before), where a save lacking a parameter with no earlier value is refused."""
    import json

    import pytest

    from anns_lab.errors import IndexConfigError

    keys, queries, _ = easy_data(n_keys=600)
    RetroInfer(nlist=40, estimation_budget=1.0).build(keys).save(tmp_path / "idx")
    meta_file = tmp_path / "idx" / "index.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "params": {k: v for k, v in meta["params"].items() if k != "estimation_budget"}}))
    old = RetroInfer.load(tmp_path / "idx")
    assert old.params["estimation_budget"] == 1.0
    res = old.search(queries, 10, nprobe=3)
    assert all(len(res.estimate.row(i)[2]) == len(old.summaries().keys) - 3 for i in range(len(queries)))
    meta_file.write_text(json.dumps({**meta, "params": {k: v for k, v in meta["params"].items() if k != "niter"}}))
    with pytest.raises(IndexConfigError, match="no value for niter"):
        RetroInfer.load(tmp_path / "idx")
