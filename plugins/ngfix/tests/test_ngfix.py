"""HNSW-NGFix*: the conformance kit, escape hardness against a breadth-first reference, the repairs' promises (every
defect joined, only defects repaired, RFix's edges from where the search got stuck), the repair slots' rule, and
repair edges kept through add and save."""

import numpy as np
import pytest

from anns_lab import indexes
from anns_lab.indexes.graph.search import search_single
from anns_lab.testing import check_index, easy_data
from anns_lab_ngfix import NGFixIndex
from anns_lab_ngfix.fixing import EH_INF, RFIX_EH, RFIX_OUT, add_fix_edge, escape_hardness, fix_graph, ngfix, rfix

SMALL = {"M": 4, "ef_construction": 32, "MEX": 8, "fix_lists": 20, "fix_near": 5, "rfix_ef": 60}


def test_conformance():
    check_index(NGFixIndex)  # recall 1 at the last grid point (a beam wider than the keys: every reachable key)
    check_index(NGFixIndex, **SMALL)


def test_registered_through_entry_point():
    assert indexes.get("ngfix") is NGFixIndex


def _reference_hardness(rows, gt, nq, s):
    """Per pair (i, j) of the first nq ranks: the least h ≥ max(i, j) for which a breadth-first search from i over
    the keys of rank ≤ h reaches j (EH_INF: none within the top s)."""
    rank = {int(v): r for r, v in enumerate(gt[:s])}
    H = np.full((nq, nq), EH_INF)
    for i in range(nq):
        for j in range(nq):
            for h in range(max(i, j), s):
                seen, todo = {i}, [i]
                while todo:
                    a = todo.pop()
                    for v in rows[gt[a]]:
                        b = rank.get(int(v))
                        if b is not None and b <= h and b not in seen:
                            seen.add(b)
                            todo.append(b)
                if j in seen:
                    H[i, j] = h
                    break
    return H


def _random_graph(rng, n, width, degree_max):
    nbrs = np.full((n, width), -1, np.int32)
    degree = rng.integers(0, degree_max + 1, n).astype(np.int32)
    for u in range(n):
        nbrs[u, :degree[u]] = rng.choice(n, degree[u], replace=False)
    return nbrs, degree


def _scratch(n, s):
    return np.full(n, -1, np.int64), np.zeros((s, (s + 63) // 64), np.uint64), np.empty((s, s), np.int64)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("nq,s", [(10, 20), (30, 60), (70, 140)])  # 140: bitsets of three words
def test_escape_hardness_is_the_least_rank_bound_of_a_path(seed, nq, s):
    rng = np.random.default_rng(seed)
    n = 300
    nbrs, degree = _random_graph(rng, n, 12, 6 if s < 100 else 3)
    gt = rng.permutation(n)[:s].astype(np.int64)
    rank_of, f, H = _scratch(n, s)
    escape_hardness(nbrs, degree, gt, nq, s, rank_of, f, H)
    rows = [nbrs[u, :degree[u]] for u in range(n)]
    assert np.array_equal(H[:nq, :nq], _reference_hardness(rows, gt, nq, s))
    assert (rank_of == -1).all()  # left clean for the next query
    assert 0 < (H[:nq, :nq] == EH_INF).sum() < nq * nq  # the cases test both kinds of pair


@pytest.mark.parametrize("seed", range(3))
def test_ngfix_joins_every_defect_and_repairs_nothing_else(seed):
    rng = np.random.default_rng(seed)
    n, d, nq, s = 400, 8, 25, 50
    keys = rng.normal(size=(n, d)).astype(np.float32)
    nbrs, degree = _random_graph(rng, n, 40 + 3, 3)  # room for every repair: no slot is ever full
    nfix, eh = np.zeros(n, np.int32), np.zeros((n, 40), np.int64)
    gt = rng.permutation(n)[:s].astype(np.int64)
    rows_before = [set(nbrs[u, :degree[u]].tolist()) for u in range(n)]
    H_before = _reference_hardness([nbrs[u, :degree[u]] for u in range(n)], gt, nq, s)
    added = ngfix(keys, nbrs, degree, nfix, eh, gt, nq, s, *_scratch(n, s))
    assert added == nfix.sum() > 0
    # the same edges, in the same order, as a plain greedy: defects closest pair first, skipping pairs joined already
    reach = [{j for j in range(nq) if H_before[i, j] <= nq} for i in range(nq)]
    pairs = sorted(((i, j) for i in range(nq) for j in range(nq) if H_before[i, j] > nq),
                   key=lambda p: -float(keys[gt[p[0]]] @ keys[gt[p[1]]]))
    want = {}
    for a, b in pairs:
        if b not in reach[a]:
            want.setdefault(int(gt[a]), []).insert(0, int(gt[b]))  # newest first
            for i in range(nq):
                if a in reach[i]:
                    reach[i] |= reach[b]
    assert {int(u): nbrs[u, :nfix[u]].tolist() for u in np.flatnonzero(nfix)} == want
    after = _reference_hardness([nbrs[u, :degree[u]] for u in range(n)], gt, nq, s)
    assert (after <= nq).all()  # every pair of the first nq keys joined through them
    top = {int(v): r for r, v in enumerate(gt[:nq])}
    for u in np.flatnonzero(nfix):
        assert set(nbrs[u, nfix[u]:degree[u]].tolist()) == rows_before[u]  # base links kept, after the repairs
        for t in range(nfix[u]):
            v = int(nbrs[u, t])
            assert u in top and v in top and H_before[top[u], top[v]] > nq  # a repair joins a defect
            assert eh[u, t] == H_before[top[u], top[v]]  # and carries its hardness
    # greedy by closeness: fewer edges than defects whenever one edge joins several pairs
    assert added <= (H_before > nq).sum()


def test_a_full_row_keeps_its_hardest_repairs():
    """Repairs enter at the row's front (newest first, then older ones, then the base links); a full row gives the
    slot of its easiest repair, the first in row order among equals, to one at least as hard (the reference's rule)."""
    nbrs = np.full((1, 6), -1, np.int32)
    nbrs[0, :2] = [7, 8]  # two base links
    degree, nfix, eh = np.array([2], np.int32), np.zeros(1, np.int32), np.zeros((1, 3), np.int64)
    assert [add_fix_edge(nbrs, degree, nfix, eh, 0, v, e) for v, e in ((1, 50), (2, 30), (3, 70))] == [1, 1, 1]
    assert nbrs[0, :degree[0]].tolist() == [3, 2, 1, 7, 8] and nfix[0] == 3 and eh[0].tolist() == [70, 30, 50]
    assert add_fix_edge(nbrs, degree, nfix, eh, 0, 4, 20) == 0  # easier than every one held: dropped
    assert add_fix_edge(nbrs, degree, nfix, eh, 0, 1, 90) == 0  # held already: not twice
    assert add_fix_edge(nbrs, degree, nfix, eh, 0, 8, 90) == 0  # a base link already
    assert nbrs[0, :degree[0]].tolist() == [3, 2, 1, 7, 8]
    assert add_fix_edge(nbrs, degree, nfix, eh, 0, 5, 30) == 1  # as hard as the easiest (2, 30): takes its slot
    assert nbrs[0, :degree[0]].tolist() == [3, 5, 1, 7, 8]
    add_fix_edge(nbrs, degree, nfix, eh, 0, 6, RFIX_EH)  # the easiest is (5, 30) now
    assert nbrs[0, :degree[0]].tolist() == [3, 6, 1, 7, 8] and eh[0].tolist() == [70, RFIX_EH, 50]
    # ties: five reachability edges into four slots keep 1, 2, 3 and 5 (the reference's: 4, the newest, gives way)
    nbrs = np.full((1, 4), -1, np.int32)
    degree, nfix, eh = np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros((1, 4), np.int64)
    for v in range(1, 6):
        add_fix_edge(nbrs, degree, nfix, eh, 0, v, RFIX_EH)
    assert nbrs[0].tolist() == [5, 3, 2, 1]


def test_the_passes_are_ngfix_with_lists_of_n_judged_within_2n():
    """fix_graph's NGFix passes are ngfix on the query's first N keys within its first 2·N, N = 25 then 8, in that
    order; after them every pair of the first 25 keys and of the first 8 is joined within its pass's bound."""
    rng = np.random.default_rng(4)
    n, d = 400, 8
    keys = rng.normal(size=(n, d)).astype(np.float32)
    nbrs, degree = _random_graph(rng, n, 60 + 3, 3)
    q = rng.normal(size=(1, d)).astype(np.float32)
    gt = np.argsort(-(keys @ q[0]), kind="stable")[None, :50].astype(np.int64)
    state = [(nbrs.copy(), degree.copy(), np.zeros(n, np.int32), np.zeros((n, 60), np.int64)) for _ in range(3)]
    ws = (np.zeros(n, np.int32), np.empty(n + 10, np.float32), np.empty(n + 10, np.int64), np.empty(0, np.int64),
          np.empty(0, np.float32))
    fix_graph(keys, *state[0], q, gt, np.array([25, 8]), 0, 0, 10, ws)
    for nq in (25, 8):
        ngfix(keys, *state[1], gt[0], nq, 2 * nq, *_scratch(n, 50))
    ngfix(keys, *state[2], gt[0], 25, 50, *_scratch(n, 50))  # the first pass alone
    assert all(np.array_equal(a, b) for a, b in zip(state[0], state[1]))
    assert not np.array_equal(state[1][0], state[2][0])  # the second pass added edges of its own
    rows = [state[0][0][u, :state[0][1][u]] for u in range(n)]
    assert (_reference_hardness(rows, gt[0], 25, 50) <= 25).all() and (_reference_hardness(rows, gt[0], 8, 16) <= 8).all()


def _ood_data(rng, n, d, sizes):
    """Gaussian keys and query sets off their distribution (around a point 3 standard deviations out, as attention's
    queries sit apart from the keys)."""
    keys = rng.standard_normal((n, d)).astype(np.float32)
    centre = np.zeros(d, np.float32)
    centre[0] = 3.0
    return (keys, *((centre + 0.5 * rng.standard_normal((m, d))).astype(np.float32) for m in sizes))


def test_the_build_repairs_hnswlibs_bottom_layer_with_both_passes_and_rfix():
    """The index's graph is hnswlib's layer 0 (same M, ef_construction, seed) repaired by fix_graph with the exact top
    2·fix_lists keys of every training query, passes N = fix_lists then fix_near, RFix from the entry point."""
    from anns_lab.indexes.hnsw import HNSWIndex
    from anns_lab.indexes.topk import topk_ip

    params = {**SMALL, "M": 2, "ef_construction": 4}  # a sparse base in 64 dimensions: RFix has stuck searches to mend
    keys, train = _ood_data(np.random.default_rng(1), 1000, 64, (160,))
    index = NGFixIndex(**params).build(keys, train)
    base = HNSWIndex(M=params["M"], ef_construction=params["ef_construction"]).build(keys).graph
    n, mex = len(keys), SMALL["MEX"]
    nbrs = np.full((n, mex + base.nbrs.shape[1]), -1, np.int32)
    nbrs[:, :base.nbrs.shape[1]] = base.nbrs
    degree, nfix, eh = base.degree.copy(), np.zeros(n, np.int32), np.zeros((n, mex), np.int32)
    entry = int(np.argmax(keys @ keys.mean(axis=0)))
    slots = n + SMALL["rfix_ef"]
    ws = (np.zeros(n, np.int32), np.empty(slots, np.float32), np.empty(slots, np.int64), np.empty(0, np.int64),
          np.empty(0, np.float32))
    gt = topk_ip(train, keys, 2 * SMALL["fix_lists"]).astype(np.int64)
    placed = fix_graph(keys, nbrs, degree, nfix, eh, train, gt, np.array([SMALL["fix_lists"], SMALL["fix_near"]]),
                       entry, SMALL["rfix_ef"], 10, ws)
    assert index.entry == entry and tuple(index.n_fixed) == tuple(placed) and placed[1] > 0
    assert np.array_equal(index.nbrs, nbrs) and np.array_equal(index.degree, degree)


def test_the_entry_point_is_the_key_of_largest_inner_product_with_the_mean():
    keys, _, train = easy_data(seed=2)
    keys[17] = 4 * keys.mean(axis=0) / np.linalg.norm(keys.mean(axis=0))  # aligned with the mean, of a common norm
    assert NGFixIndex(**SMALL).build(keys, train).entry == 17


def _rfix_reference(keys, graph_row, q, u, s_u):
    """RFix's edges from u by plain Python: the keys better than u for q among the best 60 a beam-60 search from u
    scans, nearest to u first, thinned by the occlusion rule (kept unless a kept key is nearer to it than u is) to at
    most 6 when there are 6 or more, less those u links to already."""
    graph, row = graph_row
    ids, scores, _, _ = search_single(graph, q, np.array([u]), 60, 60)
    cands = [int(c) for c, sc in zip(ids[0], scores[0]) if c >= 0 and c != u and sc > s_u]
    cands.sort(key=lambda c: -float(keys[u] @ keys[c]))  # a stable sort, as the kernel's
    kept = []
    for c in cands:
        if len(kept) == RFIX_OUT:
            break
        if len(cands) < RFIX_OUT or all(keys[r] @ keys[c] <= keys[u] @ keys[c] for r in kept):
            kept.append(c)
    return [c for c in kept if c not in row]


@pytest.mark.parametrize("seed", range(3))
def test_rfix_links_the_stuck_key_to_keys_nearer_the_query(seed):
    """A sparse random graph strands searches: where a beam of 10 from the entry ends on a key u worse than the
    query's 10th, u gains at most 6 edges, to keys the query prefers to u; where it does not, nothing changes."""
    rng = np.random.default_rng(seed)
    n, d = 500, 8
    keys = rng.normal(size=(n, d)).astype(np.float32)
    nbrs, degree = _random_graph(rng, n, 4 + 8, 4)
    nfix, eh = np.zeros(n, np.int32), np.zeros((n, 8), np.int64)
    ws = (np.zeros(n, np.int32), np.empty(n + 61, np.float32), np.empty(n + 61, np.int64), np.empty(0, np.int64),
          np.empty(0, np.float32))
    stuck = fixed = 0
    epoch = 0
    for q in rng.normal(size=(30, d)).astype(np.float32):
        gt = np.argsort(-(keys @ q), kind="stable")[:20].astype(np.int64)
        graph_before = (keys, nbrs.copy(), degree.copy())
        ids, scores, _, _ = search_single(graph_before, q, np.array([0]), 10, 1)
        u, before = int(ids[0, 0]), nfix.copy()
        row_before = (graph_before, set(nbrs[u, :degree[u]].tolist()))
        added, epoch = rfix(keys, nbrs, degree, nfix, eh, q, gt, 10, 0, 60, ws, epoch)
        changed = np.flatnonzero(nfix != before)
        if scores[0, 0] >= keys[gt[9]] @ q - 1e-6:
            assert added == 0 and not len(changed)
            continue
        stuck += 1
        assert set(changed.tolist()) <= {u}
        assert nbrs[u, :added].tolist() == _rfix_reference(keys, row_before, q, u, scores[0, 0])[::-1]  # newest first
        fixed += bool(added)
    assert stuck and fixed  # the case happens and gets repaired


def test_lists_given_as_train_topk_build_the_same_graph():
    """The training queries' top keys computed elsewhere (the decoder's device_lists) give the graph the build's own
    exact lists give; lists narrower than the build reads are refused."""
    from anns_lab.errors import IndexConfigError
    from anns_lab.indexes.topk import topk_ip

    keys, _, train = easy_data()
    width = NGFixIndex.train_topk_width(len(keys), **SMALL)
    assert width == 2 * SMALL["fix_lists"]
    own = NGFixIndex(**SMALL).build(keys, train)
    given = NGFixIndex(**SMALL).build(keys, train, train_topk=topk_ip(train, keys, width + 5))
    assert np.array_equal(own.nbrs, given.nbrs) and np.array_equal(own.degree, given.degree)
    with pytest.raises(IndexConfigError, match="train_topk has"):
        NGFixIndex(**SMALL).build(keys, train, train_topk=topk_ip(train, keys, width - 1))


def test_repairs_survive_add_and_save(tmp_path):
    keys, queries, train = easy_data()
    index = NGFixIndex(**SMALL).build(keys[:800], train)
    fix, hard = index.fix_edges()
    assert 0 < (fix >= 0).sum() <= index.n_fixed[0] + index.n_fixed[1]  # a full row's repairs replace its easiest
    index.add(keys[800:])
    fix2, hard2 = index.fix_edges()
    assert np.array_equal(fix2[:800], fix) and np.array_equal(hard2[:800], hard) and (fix2[800:] == -1).all()
    index.save(tmp_path)
    loaded = NGFixIndex.load(tmp_path)
    assert np.array_equal(loaded.nbrs, index.nbrs) and np.array_equal(loaded.degree, index.degree)
    assert loaded.entry == index.entry
    a, b = index.search(queries, 10, L=40), loaded.search(queries, 10, L=40)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.n_scanned, b.n_scanned)


def test_repairs_lower_the_scans_of_queries_like_the_training_ones():
    """Queries out of the keys' distribution (as attention's are), test queries drawn as the training ones (another
    draw), reach recall 0.9 at fewer scans with the repairs than on the base graph alone (fix_lists 1, no second
    pass, no RFix: no repair at all)."""
    from anns_lab.testing import recall_at_k

    keys, train, queries = _ood_data(np.random.default_rng(5), 3000, 16, (600, 60))

    def scans_at(index, target=0.9):
        for L in NGFixIndex.search_grid["L"]:
            res = index.search(queries, 10, L=L)
            if recall_at_k(res.ids, queries, keys, 10) >= target:
                return res.n_scanned.mean()
        return np.inf

    fixed = NGFixIndex(M=4, ef_construction=64).build(keys, train)
    bare = NGFixIndex(M=4, ef_construction=64, fix_lists=1, fix_near=0, rfix_ef=0).build(keys, train)
    assert bare.nfix.sum() == 0 and fixed.nfix.sum() > 0
    assert scans_at(fixed) < 0.8 * scans_at(bare)


@pytest.mark.parametrize("edit", ["self-loop", "hardness within the pass", "hardness where no edge", "gap in a row"])
def test_a_saved_repair_no_build_writes_is_refused(tmp_path, edit):
    """Edits of the repair arrays with their checksums redone (a hostile, consistent save) are refused at load, each
    with one IndexConfigError naming the array; the untouched save loads."""
    import hashlib
    import json

    from anns_lab.errors import IndexConfigError

    keys, _, train = easy_data()
    index = NGFixIndex(**SMALL).build(keys, train)
    index.save(tmp_path)
    NGFixIndex.load(tmp_path)
    fix, hard = np.load(tmp_path / "fix_edges.npy"), np.load(tmp_path / "fix_hardness.npy")
    u = int(np.flatnonzero(fix[:, 1] >= 0)[0])  # a key with two repairs
    name = "fix_hardness" if edit.startswith("hardness") else "fix_edges"
    if edit == "self-loop":
        fix[u, 0] = u
    elif edit == "hardness within the pass":
        hard[u, 0] = SMALL["fix_near"]  # a pair no harder than the shorter pass's N is no defect
    elif edit == "hardness where no edge":
        hard[np.flatnonzero(fix[:, -1] < 0)[0], -1] = 30
    else:
        fix[u, 0] = -1
    np.save(tmp_path / f"{name}.npy", fix if name == "fix_edges" else hard, allow_pickle=False)
    meta = json.loads((tmp_path / "index.json").read_text())
    meta["sha256"][name] = hashlib.sha256((tmp_path / f"{name}.npy").read_bytes()).hexdigest()
    (tmp_path / "index.json").write_text(json.dumps(meta))
    with pytest.raises(IndexConfigError, match=name):
        NGFixIndex.load(tmp_path)
