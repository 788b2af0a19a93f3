"""HNSW-NGFix*: the conformance kit, escape hardness against a breadth-first reference, the repairs' promises (every
defect joined, only defects repaired, RFix's edges from where the search got stuck), the repair slots' rule, and
repair edges kept through add and save."""

import numpy as np
import pytest

from anns_lab import indexes
from anns_lab.indexes.graph.search import search_single
from anns_lab.testing import check_index, easy_data
from anns_lab_ngfix import NGFixIndex
from anns_lab_ngfix.fixing import EH_INF, RFIX_EH, RFIX_OUT, add_fix_edge, escape_hardness, ngfix, rfix

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
    nbrs = np.full((1, 6), -1, np.int32)
    nbrs[0, :2] = [7, 8]  # two base links
    degree, nfix, eh = np.array([2], np.int32), np.zeros(1, np.int32), np.zeros((1, 3), np.int64)
    for v, e in ((1, 50), (2, 30), (3, 70)):
        add_fix_edge(nbrs, degree, nfix, eh, 0, v, e)
    assert nbrs[0, :degree[0]].tolist() == [1, 2, 3, 7, 8] and nfix[0] == 3
    add_fix_edge(nbrs, degree, nfix, eh, 0, 4, 20)  # easier than every one held: dropped
    add_fix_edge(nbrs, degree, nfix, eh, 0, 3, 90)  # held already: not twice
    assert nbrs[0, :degree[0]].tolist() == [1, 2, 3, 7, 8]
    add_fix_edge(nbrs, degree, nfix, eh, 0, 5, 30)  # as hard as the easiest (2, 30): replaces it
    assert nbrs[0, :degree[0]].tolist() == [1, 5, 3, 7, 8]
    add_fix_edge(nbrs, degree, nfix, eh, 0, 6, RFIX_EH)  # the easiest is (5, 30) again
    assert nbrs[0, :degree[0]].tolist() == [1, 6, 3, 7, 8] and eh[0].tolist() == [50, RFIX_EH, 70]


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
        ids, scores, _, _ = search_single((keys, nbrs.copy(), degree.copy()), q, np.array([0]), 10, 1)
        u, before = int(ids[0, 0]), nfix.copy()
        added, epoch = rfix(keys, nbrs, degree, nfix, eh, q, gt, 10, 0, 60, ws, epoch)
        changed = np.flatnonzero(nfix != before)
        if scores[0, 0] >= keys[gt[9]] @ q - 1e-6:
            assert added == 0 and not len(changed)
            continue
        stuck += 1
        assert added <= RFIX_OUT and set(changed.tolist()) <= {u}
        new = nbrs[u, before[u]:nfix[u]] if added else []
        fixed += bool(added)
        assert all(keys[v] @ q > scores[0, 0] for v in new)
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

    rng = np.random.default_rng(5)
    d = 16
    keys = rng.standard_normal((3000, d)).astype(np.float32)
    centre = np.zeros(d, np.float32)
    centre[0] = 3.0
    train, queries = ((centre + 0.5 * rng.standard_normal((m, d))).astype(np.float32) for m in (600, 60))

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
