"""Every built-in index against exact search and against independent counts of what it scanned."""

import copy
import heapq

import faiss
import numpy as np
import pytest

from anns_lab import indexes
from anns_lab.indexes import hnsw as hnsw_module
from anns_lab.testing import check_index, recall_at_k

BUILTINS = ["flat", "ivf", "hnsw", "vamana"]
N, D, K = 3000, 32, 20


def ood_data(seed=0):
    """Anisotropic keys; queries from another distribution (shifted mean, other scales), as Q is to K."""
    rng = np.random.default_rng(seed)
    scales = np.linspace(0.3, 2.0, D)
    keys = (rng.standard_normal((N, D)) * scales).astype(np.float32)
    queries = (rng.standard_normal((60, D)) * scales[::-1] * 1.5 + 1.0).astype(np.float32)
    return keys, queries


def random_data(seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N, D)).astype(np.float32), rng.standard_normal((60, D)).astype(np.float32)


@pytest.fixture(scope="module")
def built():
    """Each index built once per data set: {(name, data): (index, keys, queries)}."""
    out = {}
    for data_name, (keys, queries) in {"random": random_data(), "ood": ood_data()}.items():
        for name in BUILTINS:
            out[name, data_name] = (indexes.create(name).build(keys), keys, queries)
    return out


@pytest.mark.parametrize("name", BUILTINS)
def test_conformance(name):
    check_index(indexes.get(name))


@pytest.mark.parametrize("name", BUILTINS)
def test_batch_equals_one_query_at_a_time_to_the_last_bit(built, name):
    """The kit allows a plugin float32 rounding between a batch and single queries; the built-ins agree exactly."""
    index, keys, queries = built[name, "ood"]
    for params in (index.grid()[0], index.grid()[-1]):
        batch = index.search(queries[:8], K, **params)
        alone = [index.search(q[None], K, **params) for q in queries[:8]]
        for got, want in zip(batch[:4], zip(*(a[:4] for a in alone))):  # the arrays (a built-in has no estimate)
            assert np.array_equal(got, np.concatenate(want)), params


@pytest.mark.parametrize("data", ["random", "ood"])
@pytest.mark.parametrize("name", BUILTINS)
def test_against_exact_search(built, name, data):
    index, keys, queries = built[name, data]
    exact = np.argsort(-(queries.astype(np.float64) @ keys.T.astype(np.float64)), axis=1)[:, :K]
    recalls, scanned = [], []
    for params in index.grid():
        res = index.search(queries, K, **params)
        recalls.append(recall_at_k(res.ids, queries, keys, K))
        scanned.append(res.n_scanned.mean())
    # The knob trades scanning for recall: both rise along the grid, and the top is (near) exact.
    assert all(b >= a - 0.01 for a, b in zip(recalls, recalls[1:])), recalls
    assert all(b >= a for a, b in zip(scanned, scanned[1:])), scanned
    assert recalls[-1] >= (1.0 if name in ("flat", "ivf") else 0.99), recalls
    top = index.search(queries, K, **index.grid()[-1])
    if name in ("flat", "ivf"):
        assert np.array_equal(top.ids, exact)
    if name != "flat":
        assert scanned[0] < 0.9 * N, "the cheapest setting should not already be exhaustive"


def test_flat_scans_everything(built):
    index, keys, queries = built["flat", "random"]
    res = index.search(queries, K)
    assert (res.n_scanned == N).all()
    assert (res.bytes_read == N * 4 * keys.shape[1]).all()  # every key read once as float32


@pytest.mark.parametrize("nprobe", [1, 3, 10, 1000])
def test_ivf_scanned_equals_probed_list_sizes_plus_nlist(built, nprobe):
    index, keys, queries = built["ivf", "ood"]
    fi = index._index
    # Independent count: centroids from faiss, probing by numpy, list sizes from faiss's invlists.
    centroids = fi.quantizer.reconstruct_n(0, fi.nlist)
    probe = min(nprobe, fi.nlist)
    probed = np.argsort(-(queries @ centroids.T), axis=1)[:, :probe]
    sizes = np.array([fi.invlists.list_size(i) for i in range(fi.nlist)])
    faiss.cvar.indexIVF_stats.reset()
    res = index.search(queries, K, nprobe=nprobe)
    assert np.array_equal(res.n_scanned, sizes[probed].sum(axis=1) + fi.nlist)
    d = keys.shape[1]  # bytes: every centroid, then each probed list's vectors and int64 ids
    assert np.array_equal(res.bytes_read, 4 * d * fi.nlist + (4 * d + 8) * sizes[probed].sum(axis=1))
    assert faiss.cvar.indexIVF_stats.ndis == sizes[probed].sum()
    assert sizes.sum() == N


def reference_search(data, nbrs, degree, query, entry, ef):
    """hnswlib's searchBaseLayerST, written independently with two heaps; returns (ids best first, count,
    adjacency words read: 1 + degree per expanded node)."""
    visited = {entry}
    s = float(data[entry] @ query)
    count, words = 1, 0
    candidates = [(-s, entry)]  # max-heap of candidates by score
    top = [(s, entry)]  # min-heap of the best ef
    while candidates:
        neg, node = heapq.heappop(candidates)
        if -neg < top[0][0] and len(top) == ef:
            break
        words += 1 + int(degree[node])
        for nb in nbrs[node, : degree[node]]:
            if nb in visited:
                continue
            visited.add(int(nb))
            s = float(data[nb] @ query)
            count += 1
            if len(top) < ef or s > top[0][0]:
                heapq.heappush(candidates, (-s, int(nb)))
                heapq.heappush(top, (s, int(nb)))
                if len(top) > ef:
                    heapq.heappop(top)
    return [i for _, i in sorted(top, reverse=True)], count, words


def reference_descent(keys, graph, query):
    """hnswlib's greedy descent through the upper layers; returns (entry for layer 0, count, list words read)."""
    cur, count, words = graph.entry, 1, 0
    best = float(keys[cur] @ query)
    for level in range(graph.max_level, 0, -1):
        changed = True
        while changed:
            changed = False
            r = graph.up_row[cur]
            words += 1 + int(graph.up_deg[r, level - 1])
            for nb in graph.up_nbrs[r, level - 1, : graph.up_deg[r, level - 1]]:
                count += 1
                s = float(keys[nb] @ query)
                if s > best:
                    best, cur, changed = s, int(nb), True
    return cur, count, words


@pytest.mark.parametrize("ef", [100, 400])
def test_hnsw_matches_hnswlib_and_an_independent_count(built, ef):
    index, keys, queries = built["hnsw", "ood"]
    res = index.search(queries, K, ef=ef)
    index.hnswlib_index.set_ef(ef)
    labels, _ = index.hnswlib_index.knn_query(queries, K)
    assert (labels == res.ids).mean() >= 0.999  # the same graph, the same algorithm
    g = index.graph
    for qi in range(10):
        entry, up, up_words = reference_descent(keys, g, queries[qi])
        ids, count, words = reference_search(keys, g.nbrs, g.degree, queries[qi], entry, max(ef, K))
        assert ids[:K] == res.ids[qi].tolist()
        assert res.n_scanned[qi] == up + count
        assert res.bytes_read[qi] == 4 * keys.shape[1] * (up + count) + 4 * (up_words + words) + 8


def test_hnsw_reads_a_graph_whose_internal_ids_are_not_its_labels(built):
    """hnswlib numbers its elements as they arrive, not by label (a saved index made elsewhere, added in another order
    or on several threads): the graph read out is by label, and searches as hnswlib does. The lab adds its keys in
    label order on one thread, where the two agree and session 61's read takes a shorter path."""
    import hnswlib

    index, keys, queries = built["hnsw", "ood"]
    p = hnswlib.Index("ip", keys.shape[1])
    p.init_index(len(keys), M=index.params["M"], ef_construction=index.params["ef_construction"], random_seed=3)
    p.set_num_threads(1)
    order = np.random.default_rng(5).permutation(len(keys))
    p.add_items(keys[order], order)  # element i is key order[i]
    st = p.__getstate__()[0]
    labels = hnsw_module.level0_records(st)[1]
    assert np.array_equal(labels, order)  # the case under test
    index = copy.deepcopy(index)
    index._set(p)
    g = index.graph
    rec = hnsw_module.level0_records(st)[0]
    words = rec[:, : 4 * (st["max_M0"] + 1)].copy().view(np.uint32)
    for internal in range(0, len(keys), 97):  # each row: its label's row, neighbours as labels (independent read)
        row = sorted(labels[words[internal, 1: 1 + (words[internal, 0] & 0xFFFF)]].tolist())
        assert sorted(g.nbrs[labels[internal], : g.degree[labels[internal]]].tolist()) == row
    levels, size = st["element_levels"][: len(keys)], st["size_links_per_element"]
    blob, at = np.asarray(st["link_lists"]).view(np.uint8), 0
    for internal in np.flatnonzero(levels > 0):  # the upper layers' rows, read one node after another
        rows = blob[at: at + size * levels[internal]].copy().view(np.uint32).reshape(levels[internal], -1)
        at += size * levels[internal]
        r = g.up_row[labels[internal]]
        for lv, row in enumerate(rows):
            assert g.up_deg[r, lv] == row[0] & 0xFFFF
            assert g.up_nbrs[r, lv, : row[0] & 0xFFFF].tolist() == labels[row[1: 1 + (row[0] & 0xFFFF)]].tolist()
    res = index.search(queries, K, ef=200)
    p.set_ef(200)
    assert (p.knn_query(queries, K)[0] == res.ids).mean() >= 0.999


@pytest.mark.parametrize("L", [100, 300])
def test_vamana_count_matches_an_independent_search(built, L):
    index, keys, queries = built["vamana", "ood"]
    res = index.search(queries, K, L=L)
    for qi in range(10):
        ids, count, words = reference_search(keys, index._nbrs, index._degree, queries[qi], index.entry, L)
        assert ids[:K] == res.ids[qi].tolist()
        assert res.n_scanned[qi] == count
        assert res.bytes_read[qi] == 4 * keys.shape[1] * count + 4 * words + 8


def test_vamana_graph_is_pruned_and_reachable(built):
    index, keys, _ = built["vamana", "random"]
    R = index.params["R"]
    assert index._degree.max() <= R and index._degree.min() >= 1
    seen = np.zeros(len(keys), bool)
    stack, seen[index.entry] = [index.entry], True
    while stack:
        node = stack.pop()
        for nb in index._nbrs[node, : index._degree[node]]:
            if not seen[nb]:
                seen[nb] = True
                stack.append(nb)
    assert seen.mean() > 0.99


@pytest.mark.parametrize("name", ["vamana", "robust-vamana", "roargraph"])
def test_graphs_with_many_copies_of_one_key_stay_open_and_reach_every_copy(name):
    """34 equal keys among 3,000: under the inner-product occlusion rule copies never occluded each other, so each
    linked only copies, a closed clique; vamana's entry (the key nearest the mean, a copy) then read 33 keys at any
    beam, recall 0. Now a copy equal to a kept neighbour is occluded, and ties go round by id, a ring: a query away
    from the copies leaves them, one at them finds them (its top-20 are copies, ties counted as hits): all where
    unreachable keys are linked (robust-vamana, roargraph), most in plain vamana (a copy whose build search missed
    its successor breaks the ring)."""
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((N, 128)).astype(np.float32)
    keys[:33] = keys[33]
    queries = rng.standard_normal((30, 128)).astype(np.float32)
    train = rng.standard_normal((1000, 128)).astype(np.float32) if indexes.registry.get(name).uses_train_queries else None
    index = indexes.registry.create(name).build(keys, train)
    assert recall_at_k(index.search(queries, K, L=400).ids, queries, keys, K) > 0.9
    near = (keys[:1] + 0.01 * rng.standard_normal((5, 128))).astype(np.float32)
    assert recall_at_k(index.search(near, K, L=400).ids, near, keys, K) >= (0.7 if name == "vamana" else 1.0)
