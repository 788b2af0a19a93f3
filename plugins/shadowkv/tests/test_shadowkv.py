"""ShadowKV landmarks: the conformance kit, exactness at the most thorough grid point, and an independent count."""

import math

import numpy as np
import pytest

from anns_lab import indexes
from anns_lab.testing import check_index, easy_data
from anns_lab_shadowkv import ShadowKVLandmarks


def test_conformance():
    check_index(ShadowKVLandmarks)  # recall 1 at the last grid point, which reads every chunk: exact search
    check_index(ShadowKVLandmarks, chunk_size=5, outliers=0.05)


def test_registered_through_entry_point():
    assert indexes.get("shadowkv") is ShadowKVLandmarks


def _reference(keys, size, fraction):
    """Chunks, landmarks and outliers by plain loops: a chunk's mean, its keys' least cosine with it, the
    round(fraction × chunks) chunks of least cosine."""
    chunks = [np.arange(s, min(s + size, len(keys))) for s in range(0, len(keys), size)]
    means = [keys[c].astype(np.float64).mean(0) for c in chunks]
    least = [min(float(k @ m) / (np.linalg.norm(k) * np.linalg.norm(m)) for k in keys[c].astype(np.float64))
             for c, m in zip(chunks, means)]
    n_out = int(math.floor(fraction * len(chunks) + 0.5))
    outliers = sorted(np.argsort(least, kind="stable")[:n_out].tolist())
    return chunks, np.array(means), outliers


@pytest.mark.parametrize("size,fraction,budget", [(8, 0.02, 64), (8, 0.0, 200), (5, 0.1, 33), (7, 0.05, 7),
                                                 (8, 0.03, 1 << 20)])  # the last: every chunk read
def test_chunks_read_are_the_outliers_and_the_best_landmarks(size, fraction, budget):
    """Independent count: per query, the outlier chunks plus the ceil(budget/size) non-outlier chunks of largest
    landmark score are read; the counts and the answer (the exact top-5 of their keys) follow from them."""
    keys, queries, _ = easy_data(n_keys=1003, dim=8, seed=3)
    index = ShadowKVLandmarks(chunk_size=size, outliers=fraction).build(keys)
    chunks, means, outliers = _reference(keys, size, fraction)
    assert index._outlier_chunks.tolist() == outliers
    landmarks = [c for c in range(len(chunks)) if c not in set(outliers)]
    n_read = min(math.ceil(budget / size), len(landmarks))
    res = index.search(queries, 5, budget=budget)
    for q, row_scanned, row_bytes, row_ids in zip(queries, res.n_scanned, res.bytes_read, res.ids):
        score = {c: float(means[c] @ q) for c in landmarks}
        threshold = sorted(score.values(), reverse=True)[n_read - 1]
        read = [c for c in landmarks if score[c] >= threshold] + outliers  # random data: no ties at the threshold
        assert len(read) == n_read + len(outliers)
        cand = np.concatenate([chunks[c] for c in read])
        assert row_scanned == len(landmarks) + len(cand)
        assert row_bytes == 4 * keys.shape[1] * len(landmarks) + 8 * len(read) + 4 * keys.shape[1] * len(cand)
        assert sorted(row_ids.tolist()) == sorted(cand[np.argsort(-(keys[cand] @ q))[:5]].tolist())


def test_an_outlier_is_a_chunk_whose_keys_disagree():
    """A chunk holding one key turned against the others is an outlier, and every query reads its keys, the
    reversed one included, whatever its landmark would have scored. The short last chunk is judged by its own keys."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal((1, 16)).astype(np.float32)
    keys = (base + 0.05 * rng.standard_normal((803, 16))).astype(np.float32)  # 101 chunks of like keys, the last of 3
    keys[8 * 37 + 3] = -5 * base[0]  # chunk 37 holds a key pointing the other way
    index = ShadowKVLandmarks(chunk_size=8, outliers=2 / 101).build(keys)
    assert 37 in index._outlier_chunks and 100 not in index._outlier_chunks and len(index._outlier_chunks) == 2
    q = -base  # a query whose best key is the reversed one
    res = index.search(q, 1, budget=8)
    assert res.ids[0, 0] == 8 * 37 + 3


def test_add_matches_a_fresh_build():
    keys, queries, _ = easy_data(n_keys=500, dim=8, seed=5)
    grown = ShadowKVLandmarks(outliers=0.05).build(keys[:301])
    grown.add(keys[301:420])
    grown.add(keys[420:])
    fresh = ShadowKVLandmarks(outliers=0.05).build(keys)
    np.testing.assert_array_equal(grown._outlier_chunks, fresh._outlier_chunks)
    np.testing.assert_array_equal(grown._landmarks, fresh._landmarks)
    a, b = grown.search(queries, 10, budget=96), fresh.search(queries, 10, budget=96)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.bytes_read, b.bytes_read)
