"""PQCache: the conformance kit, exactness at the most thorough grid point, and an independent count."""

import numpy as np
import pytest

from anns_lab import indexes
from anns_lab.errors import IndexConfigError
from anns_lab.testing import check_index, easy_data
from anns_lab_pqcache import PQCacheIndex


def test_conformance():
    check_index(PQCacheIndex)  # the last grid point re-ranks every key: exact


def test_registered_through_entry_point():
    assert indexes.get("pqcache") is PQCacheIndex


def test_most_thorough_point_is_numpy_exact_search():
    keys, queries, _ = easy_data(n_keys=700, dim=12)
    index = PQCacheIndex(M=3).build(keys)
    res = index.search(queries, 25, **index.grid()[-1])
    exact = np.argsort(-(queries.astype(np.float64) @ keys.astype(np.float64).T), axis=1)[:, :25]
    assert np.array_equal(res.ids, exact)


@pytest.mark.parametrize("M,nbits,pool", [(2, 6, 150), (4, 4, 60), (1, 5, 10)])
def test_pool_is_the_best_approximate_scores_and_counts_follow(M, nbits, pool):
    """Independent ADC: decode every key from its code with the codebooks and score it by numpy; the candidates
    re-ranked are the pool of best approximate scores (random data: no ties), and the counts follow from them."""
    keys, queries, _ = easy_data(n_keys=800, dim=16, seed=2)
    index = PQCacheIndex(M=M, nbits=nbits).build(keys)
    k = 10
    res = index.search(queries, k, pool=pool)
    pool_eff = max(pool, k)
    approx = queries @ index._pq.reconstruct_n(0, len(keys)).T  # q · decoded key = the ADC sum of table entries
    code_size = -(-M * nbits // 8)
    d = keys.shape[1]
    for row, q in enumerate(queries):
        order = np.argsort(-approx[row], kind="stable")
        cand = order[:pool_eff]
        if np.isclose(approx[row, order[pool_eff - 1]], approx[row, order[pool_eff]], rtol=1e-5):
            continue  # a tie at the pool's edge: either key is a valid pool
        want = cand[np.argsort(-(keys[cand] @ q), kind="stable")[:k]]
        assert sorted(res.ids[row].tolist()) == sorted(want.tolist())
    assert (res.n_scanned == 2 ** nbits + pool_eff).all()
    assert (res.bytes_read == 4 * d * 2 ** nbits + code_size * len(keys) + 4 * d * pool_eff).all()


def test_dimension_not_divisible_by_M_is_one_clear_error():
    keys, _, _ = easy_data(n_keys=200, dim=10)
    with pytest.raises(IndexConfigError, match="does not divide"):
        PQCacheIndex(M=3).build(keys)


def test_keys_too_large_for_faiss_s_encoder_give_the_codes_of_smaller_ones():
    """faiss's PQ encoder starts its codeword search at a distance of 1e20: keys of ~1.3e9 and up all took codeword 0
    (recall@10 0.815 at scale 1, 0.27 at 1e10). Scaled by a power of two for encoding, keys times 2^40 get the codes,
    and so the ids, of the keys themselves, also after an add."""
    import faiss

    rng = np.random.default_rng(5)
    keys = rng.standard_normal((1500, 64)).astype(np.float32)
    queries = rng.standard_normal((20, 64)).astype(np.float32)
    big = np.float32(2.0 ** 40)
    plain = PQCacheIndex().build(keys[:1400])
    large = PQCacheIndex().build(keys[:1400] * big)
    plain.add(keys[1400:])
    large.add(keys[1400:] * big)
    assert np.array_equal(faiss.vector_to_array(plain._pq.codes), faiss.vector_to_array(large._pq.codes))
    a, b = plain.search(queries, 10, pool=100), large.search(queries, 10, pool=100)
    assert np.array_equal(a.ids, b.ids)
    assert np.allclose(b.scores, a.scores * big, rtol=1e-5)
