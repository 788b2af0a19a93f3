"""The training queries' top lists (train_lists) and precomputed lists given to build (train_topk)."""

import warnings

import numpy as np
import pytest

from anns_lab.errors import IndexConfigError
from anns_lab.indexes import registry
from anns_lab.indexes.roargraph import LIST_SPAN, RoarGraphIndex, auto_stride
from anns_lab.indexes.graph.simd import dot, dot2x4, dot4
from anns_lab.indexes.train_lists import anchor_ids, anchored_topk


def drifting(seed, n=3000, m=1200, d=32):
    """Keys and a sequence of queries that drift slowly (neighbours share most of their top keys)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, d)).astype(np.float32)
    walk = np.cumsum(rng.standard_normal((m, d)) * 0.15, axis=0) + rng.standard_normal(d)
    return keys, (walk + 0.3 * rng.standard_normal((m, d))).astype(np.float32)


def exact_lists(queries, keys, k):
    s = queries.astype(np.float64) @ keys.T.astype(np.float64)
    return np.argsort(-s, axis=1, kind="stable")[:, :k], s


def test_anchor_ids():
    a = anchor_ids(100, 8, 5)
    assert a[0] == 0 and a[-1] == 99 and list(a[-5:]) == [95, 96, 97, 98, 99]
    assert set(range(99, -1, -8)) <= set(a.tolist()) and len(a) == len(set(a.tolist()))
    assert list(anchor_ids(10, 1, 0)) == list(range(10))


@pytest.mark.parametrize("stride,span", [(1, 2), (4, 1), (8, 2), (50, 3)])
def test_anchored_lists_exact_where_claimed(stride, span):
    keys, q = drifting(stride)
    k = 40
    ref, s = exact_lists(q, keys, k)
    lists, exact = anchored_topk(q, keys, k, stride, span, exact_tail=30, n_threads=2)
    assert lists.shape == (len(q), k) and lists.dtype == np.int32
    assert exact.sum() == len(anchor_ids(len(q), stride, 30))
    # exact rows: the true top-k (as a set, with its order by score: ties of float32 sums aside)
    for i in np.flatnonzero(exact):
        assert set(lists[i]) == set(ref[i]), i
    # other rows: distinct keys, best first, and the exact top-k of the union of the neighbouring anchors' lists
    anchors = np.flatnonzero(exact)
    for i in np.flatnonzero(~exact)[::7]:
        row = lists[i]
        assert len(set(row)) == k
        assert np.all(np.diff(s[i, row]) <= 1e-4)
        g = np.searchsorted(anchors, i) - 1
        cand = np.unique(ref[anchors[max(0, g - span + 1): g + span + 1]])
        best = cand[np.argsort(-s[i, cand], kind="stable")[:k]]
        assert set(row) == set(best), i


@pytest.mark.parametrize("d", [64, 256, 37])
def test_dot4_is_four_dots_bit_for_bit(d):
    """The re-rank's four-at-once inner product (graph.simd.dot4) gives dot's bits for each pair (the tail past
    the 8-lane blocks included), so the anchored lists do not depend on which kernel scored them."""
    rng = np.random.default_rng(d)
    a, *bs = (rng.standard_normal(d).astype(np.float32) * 10 for _ in range(5))
    assert dot4(a, *bs) == tuple(dot(a, b) for b in bs)


@pytest.mark.parametrize("d", [64, 256, 37, 5])
def test_dot2x4_is_eight_dots_bit_for_bit(d):
    """The re-rank's two-rows-by-four inner products (graph.simd.dot2x4): dot's bits for each pair, a0's four first."""
    rng = np.random.default_rng(d + 1)
    a0, a1, *bs = (rng.standard_normal(d).astype(np.float32) * 10 for _ in range(6))
    assert dot2x4(a0, a1, *bs) == tuple(dot(a, b) for a in (a0, a1) for b in bs)


def test_anchored_lists_recall_on_drifting_queries():
    keys, q = drifting(0)
    ref, _ = exact_lists(q, keys, 40)
    lists, exact = anchored_topk(q, keys, 40, 8, 2, exact_tail=0)
    recall = np.mean([len(np.intersect1d(a, b)) / 40 for a, b in zip(lists[~exact], ref[~exact])])
    assert recall > 0.8, recall


def test_auto_stride_grows_with_the_context():
    assert auto_stride(2000, 2000) == 1 and auto_stride(5000, 5000) == 1 and auto_stride(8192, 8192) == 2
    assert auto_stride(32768, 32768) == 8 and auto_stride(131072, 131072) == 32 and auto_stride(10**6, 10**6) == 64


def test_train_topk_given_equals_exact_build():
    keys, q = drifting(3)
    a = RoarGraphIndex(list_stride=1).build(keys, q)
    m_sq = RoarGraphIndex.train_topk_width(len(keys))
    ref, _ = exact_lists(q, keys, m_sq + 5)  # wider than needed: the first M_sq are used
    b = RoarGraphIndex().build(keys, q, train_topk=ref)
    for x, y in zip(a.graph_arrays()[1:], b.graph_arrays()[1:]):
        assert np.array_equal(x, y)


def test_a_build_from_given_lists_is_its_own_build_when_they_are_its_own_lists():
    """At a stride above 1 the descent links read the anchors' lists only, whoever computed the lists: given the very
    lists the build would compute (anchored), the graph is its own to the bit (from every given list, as before, the
    build took 1.8x the time at 32K for lists the decoder's GPU gives exact)."""
    keys, q = drifting(5)
    stride = 4
    index = RoarGraphIndex(list_stride=stride)
    own = index.build(keys, q)
    m_sq = RoarGraphIndex.train_topk_width(len(keys))
    ordered = max(own.lists["n_pivots"], own.lists["n_cand"] if own.lists["n_cand"] < m_sq else 0)
    lists, exact = anchored_topk(q, keys, m_sq, stride, LIST_SPAN, own.params["keep_queries"],
                                 coarse=bool(own.params["coarse_bf16"]), ordered=ordered)
    assert 0 < exact.sum() < len(q)
    given = RoarGraphIndex(list_stride=stride).build(keys, q, train_topk=lists)
    for x, y in zip(own.graph_arrays()[1:], given.graph_arrays()[1:]):
        assert np.array_equal(x, y)


def test_train_topk_bad_input():
    keys, q = drifting(4, n=500, m=100)
    ref, _ = exact_lists(q, keys, 100)
    with pytest.raises(IndexConfigError, match="shape"):
        RoarGraphIndex().build(keys, q, train_topk=ref[:50])
    with pytest.raises(IndexConfigError, match="outside"):
        RoarGraphIndex().build(keys, q, train_topk=ref + 1000)
    with pytest.raises(IndexConfigError, match="integer"):
        RoarGraphIndex().build(keys, q, train_topk=ref.astype(np.float32))
    with pytest.raises(IndexConfigError, match="M_sq"):
        RoarGraphIndex().build(keys, q, train_topk=ref[:, :10])
    with pytest.raises(IndexConfigError, match="does not take train_topk"):
        registry.create("hnsw").build(keys, q, train_topk=ref)


@pytest.mark.parametrize("d,scale", [(32, 1.0), (256, 8.0)])
def test_bf16_coarse_lists_are_the_exact_lists(d, scale):
    """topk_ip_bf16 (a bfloat16 product, its best k + margin ranked in float32) gives the exact top-k, in order."""
    from anns_lab.indexes.train_lists import topk_ip_bf16

    keys, q = drifting(d, n=4000, m=300, d=d)
    keys, q = keys * scale, q * scale  # Gemma-like norms: bfloat16's rounding grows with the scores
    ref, s = exact_lists(q, keys, 60)
    keys.setflags(write=False)  # as a dump's memory-mapped arrays: read without a warning (torch's from_numpy warns)
    q.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = topk_ip_bf16(q, keys, 60, n_threads=2)
    assert got.shape == ref.shape and got.dtype == np.int32
    for i in range(len(q)):
        assert set(got[i]) == set(ref[i]), i
        assert np.all(np.diff(s[i, got[i]]) <= 1e-4 * scale * scale)


def test_bf16_thresholds_and_selections_match_the_float_order():
    """``graph.simd.count_at_least`` / ``indices_at_least`` (32 bfloat16 scores per vector compare, the tail one by one)
    against numpy on the scores as floats, every length around the vector's; ``_threshold`` is the want-th largest
    whatever its guess (the row alone decides it)."""
    from numba import njit

    from anns_lab.indexes.graph.simd import count_at_least, indices_at_least, signed_order
    from anns_lab.indexes.train_lists import _threshold

    @njit
    def probe(row, v, out):
        return count_at_least(row, v), indices_at_least(row, v, out), signed_order(row[0])

    rng = np.random.default_rng(4)
    for n in (1, 31, 32, 33, 95, 1000):
        row = rng.integers(-32768, 32768, n).astype(np.int16)
        row[row == -32768] = 0  # -0.0; the NaN patterns (exponent all ones) are left out below
        vals = (row.astype(np.int32) << 16).view(np.float32)
        keep = np.isfinite(vals)
        row, vals = row[keep], vals[keep]
        order = np.argsort(vals, kind="stable")
        for v in [-32767, -1, 0, 1, 16000, 32767, *rng.integers(-32768, 32768, 5)]:
            out = np.empty(len(row), np.int64)
            c, t, first = probe(row, v, out)
            ords = np.array([int(b) ^ ((int(b) >> 15) & 0x7FFF) for b in row])
            assert first == ords[0] and np.all(np.diff(ords[order]) >= 0)  # the order of the values
            ref = np.flatnonzero(ords >= v)
            assert c == t == len(ref) and np.array_equal(out[:t], ref)
        for want in {1, max(1, len(row) // 2), len(row)}:
            best = np.sort(ords)[::-1][want - 1]
            for guess in (-32768, -3, 0, 500, 32767):
                assert _threshold(row, want, guess) == best


def test_anchored_lists_coarse_anchors_exact():
    keys, q = drifting(5)
    ref, _ = exact_lists(q, keys, 40)
    lists, exact = anchored_topk(q, keys, 40, 8, 1, exact_tail=30, coarse=True)
    plain, _ = anchored_topk(q, keys, 40, 8, 1, exact_tail=30)
    for i in np.flatnonzero(exact):
        assert set(lists[i]) == set(ref[i]), i
    assert np.mean([len(np.intersect1d(a, b)) for a, b in zip(lists, plain)]) / 40 > 0.999


def test_anchored_lists_ordered_prefix():
    """``ordered``: the same top-k sets, the same first ``ordered`` keys in the same order (what the build reads)."""
    keys, q = drifting(6)
    full, exact = anchored_topk(q, keys, 40, 8, 1, exact_tail=30)
    part, exact2 = anchored_topk(q, keys, 40, 8, 1, exact_tail=30, ordered=10)
    assert np.array_equal(exact, exact2) and np.array_equal(full[exact], part[exact])
    assert np.array_equal(full[:, :10], part[:, :10])
    assert all(set(a) == set(b) for a, b in zip(full, part)) and not np.array_equal(full, part)


@pytest.mark.parametrize("native", [False, True])
def test_coarse_lists_take_the_float32_path_without_native_bf16(native, monkeypatch):
    """``coarse``: topk_ip_bf16 only where bf16_native says so; elsewhere faiss's exact kNN, whatever this CPU is."""
    from anns_lab.indexes import train_lists

    keys, q = drifting(8, n=2000, m=200)
    ref, _ = exact_lists(q, keys, 40)
    calls = []
    real = train_lists.topk_ip_bf16
    monkeypatch.setattr(train_lists, "bf16_native", lambda: native)
    monkeypatch.setattr(train_lists, "topk_ip_bf16", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    lists, exact = anchored_topk(q, keys, 40, 8, 1, exact_tail=30, coarse=True)
    assert bool(calls) == native
    for i in np.flatnonzero(exact):
        assert set(lists[i]) == set(ref[i]), i


def test_bf16_native_is_false_where_bf16_is_emulated_or_unprobed(monkeypatch):
    """oneDNN's probe says yes on any AVX512 x86 core: without AVX512-BF16 or AMX-BF16 the float32 path is taken;
    a torch without the probe takes it too."""
    import llvmlite.binding
    import torch

    from anns_lab.indexes import train_lists

    monkeypatch.setattr(train_lists.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    features = {"avx512f": True, "avx512bw": True, "avx512bf16": False, "amx-bf16": False}
    monkeypatch.setattr(llvmlite.binding, "get_host_cpu_features", lambda: features)
    assert not train_lists.bf16_native()
    features["avx512bf16"] = True
    assert train_lists.bf16_native()
    monkeypatch.delattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", raising=False)
    monkeypatch.setattr(torch.ops, "mkldnn", object())  # a torch without the private probe
    assert not train_lists.bf16_native()


@pytest.mark.parametrize("n,k,ordered", [(747, 399, 199), (400, 399, 399), (50, 50, 10), (9, 1, 1), (300, 120, 120),
                                         (16, 8, 8), (182, 150, 30)])
def test_top_sorted_against_a_stable_argsort(n, k, ordered):
    """The re-rank's selection (train_lists._top_sorted, quickselect by _select_smallest): the top k of a stable
    argsort of −s as a set, its first ``ordered`` in order; on random scores, sorted ones (the anchors' lists order
    their candidates), with ties and signed zeros."""
    from anns_lab.indexes.train_lists import _top_sorted

    rng = np.random.default_rng(n + k)
    cases = [rng.standard_normal(n), np.sort(rng.standard_normal(n))[::-1], np.sort(rng.standard_normal(n)),
             np.round(rng.standard_normal(n) * 2), np.where(rng.random(n) < 0.5, 0.0, -0.0)]
    keys, out = np.empty(n, np.uint64), np.empty(k, np.int64)
    for s in cases:
        s = s.astype(np.float32)
        ref = np.argsort(-s, kind="stable")
        _top_sorted(s, k, keys, out, ordered)
        assert out[:ordered].tolist() == ref[:ordered].tolist()
        assert sorted(out.tolist()) == sorted(ref[:k].tolist())


@pytest.mark.parametrize("name", ["_radix_sort", "_sort_keys"])
def test_the_selections_sorts_are_sorts(name):
    """The selection's sorts of uint64 keys against np.sort: random keys, shared bytes (the radix sort's skipped
    passes), an odd number of passes (the result back in place), short rows (``_sort_keys``' insertion below
    SMALL_SORT: the stranded keys' 8, a gap's 30), already sorted and reversed ones, one and no element."""
    from anns_lab.indexes import train_lists

    sort = getattr(train_lists, name)
    rng = np.random.default_rng(9)
    cases = [rng.integers(0, 2**63, 199, dtype=np.uint64) * 2 + 1, (rng.integers(0, 900, 300, dtype=np.uint64) << 32) | 7,
             rng.integers(0, 256, 64, dtype=np.uint64), np.array([5], np.uint64), np.array([], np.uint64)]
    cases += [rng.integers(0, 2**64 - 1, n, dtype=np.uint64) for n in (2, 8, 30, train_lists.SMALL_SORT - 1)]
    cases += [np.sort(cases[-1]), np.sort(cases[-2])[::-1].copy()]
    for a in cases:
        got = a.copy()
        sort(got)
        assert got.tolist() == np.sort(a).tolist()
