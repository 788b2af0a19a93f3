"""ClusterKV and hierarchical Squeezed Attention: the conformance kit, exactness at the most thorough grid point,
and counts checked by an independent count."""

import numpy as np
import pytest

from anns_lab import indexes
from anns_lab.testing import check_index, easy_data
from anns_lab_cluster import ClusterKV, SqueezedHierarchical


@pytest.mark.parametrize("cls,params", [(ClusterKV, {"nlist": 20}), (SqueezedHierarchical, {})])
def test_conformance(cls, params):
    check_index(cls, **params)  # the last grid point reads every cluster: exact


def test_registered_through_entry_points():
    assert indexes.get("clusterkv") is ClusterKV and indexes.get("squeezed") is SqueezedHierarchical


@pytest.mark.parametrize("cls,params", [(ClusterKV, {"nlist": 30}), (SqueezedHierarchical, {"n_coarse": 5})])
def test_most_thorough_point_is_numpy_exact_search(cls, params):
    keys, queries, _ = easy_data(n_keys=700, dim=12)
    index = cls(**params).build(keys)
    res = index.search(queries, 25, **index.grid()[-1])
    exact = np.argsort(-(queries.astype(np.float64) @ keys.astype(np.float64).T), axis=1)[:, :25]
    assert np.array_equal(res.ids, exact)


def _clusters_read(scores, sizes, budget):
    """Independent rule: walk clusters best first, stop once the keys read reach the budget."""
    read, total = [], 0
    for c in np.argsort(-scores):
        if total >= budget:
            break
        read.append(int(c))
        total += int(sizes[c])
    return read


@pytest.mark.parametrize("budget", [50, 130, 400])
def test_clusterkv_reads_the_best_clusters_up_to_the_budget(budget):
    keys, queries, _ = easy_data(n_keys=900, dim=8, seed=6)
    index = ClusterKV(nlist=25).build(keys)
    c = index._centroids
    # cosine assignment, recomputed by numpy
    assign = np.argmax((keys / np.linalg.norm(keys, axis=1, keepdims=True)) @ (c / np.linalg.norm(c, axis=1, keepdims=True)).T, axis=1)
    sizes = np.bincount(assign, minlength=len(c))
    res = index.search(queries, 10, budget=budget)
    d = keys.shape[1]
    for row, q in enumerate(queries):
        read = _clusters_read(c @ q, sizes, budget)
        cand = np.flatnonzero(np.isin(assign, read))
        assert res.n_scanned[row] == len(c) + len(cand)
        assert res.bytes_read[row] == 4 * d * len(c) + (4 * d + 8) * len(cand)
        assert set(res.ids[row].tolist()) == set(cand[np.argsort(-(keys[cand] @ q))[:10]].tolist())


@pytest.mark.parametrize("budget", [40, 150])
def test_squeezed_scores_only_the_fine_centroids_of_expanded_coarse_clusters(budget):
    keys, queries, _ = easy_data(n_keys=1600, dim=8, seed=7)
    index = SqueezedHierarchical(n_coarse=8, expand=2.0).build(keys)
    fine, coarse = index._centroids, index._coarse
    assign = np.argmin(((keys[:, None, :] - fine[None]) ** 2).sum(-1), axis=1)  # L2 assignment, by numpy
    coarse_of = np.argmin(((fine[:, None, :] - coarse[None]) ** 2).sum(-1), axis=1)
    sizes = np.bincount(assign, minlength=len(fine))
    coarse_sizes = np.bincount(coarse_of, weights=sizes, minlength=len(coarse))
    res = index.search(queries, 10, budget=budget)
    d = keys.shape[1]
    for row, q in enumerate(queries):
        expanded = _clusters_read(coarse @ q, coarse_sizes, 2 * budget)
        cand_fine = np.flatnonzero(np.isin(coarse_of, expanded))
        s = np.full(len(fine), -np.inf)
        s[cand_fine] = fine[cand_fine] @ q
        read = [c for c in _clusters_read(s, sizes, budget) if c in set(cand_fine)]
        cand = np.flatnonzero(np.isin(assign, read))
        n_cent = len(coarse) + len(cand_fine)
        assert res.n_scanned[row] == n_cent + len(cand)
        assert res.bytes_read[row] == 4 * d * n_cent + (4 * d + 8) * len(cand) + 4 * len(cand_fine)
        assert set(res.ids[row].tolist()) == set(cand[np.argsort(-(keys[cand] @ q))[:10]].tolist())
    assert (res.n_scanned < len(keys) + len(fine)).all()  # not every fine centroid scored


def test_add_puts_new_keys_in_their_nearest_cluster():
    keys, queries, _ = easy_data(n_keys=600, dim=8, seed=8)
    index = ClusterKV(nlist=12).build(keys[:500])
    index.add(keys[500:])
    res = index.search(queries, 10, **index.grid()[-1])
    exact = np.argsort(-(queries @ keys.T), axis=1)[:, :10]
    assert np.array_equal(res.ids, exact)  # every key (new ones too) is in some cluster


@pytest.mark.parametrize("cls,params", [(ClusterKV, {"nlist": 12}), (SqueezedHierarchical, {"nlist": 30})])
def test_adds_group_the_keys_as_a_build_on_them_all_would(cls, params):
    """An add places each new key after its cluster's members without sorting them all again: the member lists
    are those of the assignment grouped afresh (``members``), and the search reads what it would read then."""
    from anns_lab_cluster import members, nearest

    keys, queries, _ = easy_data(n_keys=700, dim=8, seed=9)
    index = cls(**params).build(keys[:500])
    for lo, hi in ((500, 501), (501, 560), (560, 700)):
        index.add(keys[lo:hi])
    order, offsets = members(index._assign.table, len(index._centroids))
    assert np.array_equal(index._order, order) and np.array_equal(index._offsets, offsets)
    assert len(index._assign.table) == 700 and np.bincount(index._assign.table).sum() == offsets[-1] == 700
    assert np.array_equal(index._assign.table[500:], nearest(keys[500:], index._centroids, index.cosine))
    res = index.search(queries, 10, **index.grid()[-1])
    assert np.array_equal(res.ids, np.argsort(-(queries @ keys.T), axis=1)[:, :10])  # every key is in a list once
